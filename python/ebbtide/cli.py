"""The `ebbtide` command. Each subcommand lives in ebbtide/commands/<name>.py
and defines ``register(subparsers)``, which adds its parser and sets
``func`` to the function that runs it (returning an exit code)."""
import argparse
import importlib
import pkgutil
import sys

from ebbtide import commands


def build_parser():
    parser = argparse.ArgumentParser(
        prog="ebbtide", description="Activation offloading for PyTorch training.")
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


if __name__ == "__main__":
    sys.exit(main())
