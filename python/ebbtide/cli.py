"""The `ebbtide` command. Each subcommand lives in ebbtide/commands/<name>.py
and defines ``register(subparsers)``, which adds its parser and sets
``func`` to the function that runs it (returning an exit code)."""
import argparse
import importlib
import pkgutil
import re
import sys

import ebbtide
from ebbtide import commands

# The optional dependency that brings each module a command may import
# (pyproject.toml's extras); a missing one is named in a one-line error.
EXTRAS = {"transformers": "demo", "matplotlib": "demo", "accelerate": "hf", "trl": "trl",
          "pytorch_lightning": "lightning", "lightning": "lightning", "torchtune": "torchtune",
          "deepspeed": "deepspeed", "ray": "ray"}


class _Parser(argparse.ArgumentParser):
    """argparse, except that "-5GiB" is an option's (bad) value, which the
    command then refuses in one line, not an unknown option (argparse takes
    only plain negative numbers such as -5 for values)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")


def build_parser():
    parser = _Parser(prog="ebbtide", description="Activation offloading for PyTorch training.")
    parser.add_argument("--version", action="version", version=f"ebbtide {ebbtide.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"ebbtide.commands.{info.name}")
        module.register(sub)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"ebbtide {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in EXTRAS:
            raise
        print(f"ebbtide {args.command}: error: needs {top}, which is not installed: "
              f"pip install 'ebbtide[{EXTRAS[top]}]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
