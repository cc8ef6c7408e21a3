"""`ebbtide run`: a training command with offloading switched on, unchanged
(ebbtide.integrations.switch): torchrun, `accelerate launch`, `tune run`,
python train.py."""
import argparse
import os
import shutil
import site
import sys


def register(subparsers):
    p = subparsers.add_parser(
        "run", help="run a training command with activation offloading switched on, without editing it",
        description="Runs COMMAND with EBBTIDE_OFFLOAD set: the HF/TRL, Lightning and torchtune trainers of "
                    "every Python process it starts (torchrun's and accelerate's workers too) offload their "
                    "activations (docs/integrations.md, 'Without editing the script').",
        usage="ebbtide run [--target cpu|ssd|auto] [--path DIR] [--budget BYTES] -- COMMAND [ARG ...]")
    p.add_argument("--target", default="cpu", choices=("cpu", "ssd", "auto"),
                   help="where activations go: host memory, SSD files under --path, or both (default cpu)")
    p.add_argument("--path", help="with --target ssd or auto: the folder for the files (EBBTIDE_OFFLOAD_PATH)")
    p.add_argument("--budget", metavar="BYTES",
                   help="activation memory a step may hold, e.g. 20GiB: the planner keeps, offloads or recomputes "
                        "each block to fit it (EBBTIDE_ACTIVATION_BUDGET)")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="the training command and its arguments (after --)")
    p.set_defaults(func=run)


def switch_installed() -> bool:
    """Whether this environment's site-packages has the switch's .pth file."""
    dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    return any(os.path.exists(os.path.join(d, "ebbtide-switch.pth")) for d in dirs)


def environment(target, path=None, budget=None, base=None) -> dict:
    """The environment COMMAND runs in: `base` (default os.environ) with the
    switch's variables, each checked as the switch will read it, and this
    environment's scripts first on PATH, as in an activated virtual
    environment: `python`, `torchrun`, `accelerate` and `tune` are then the
    ones beside this ebbtide, whose Python has the switch."""
    from ebbtide import _core

    env = dict(os.environ if base is None else base)
    scripts = os.path.dirname(sys.executable)
    path_dirs = env.get("PATH", "").split(os.pathsep)
    if path_dirs[:1] != [scripts]:
        env["PATH"] = os.pathsep.join([scripts] + [d for d in path_dirs if d])
    env["EBBTIDE_OFFLOAD"] = _core.check_setting("EBBTIDE_OFFLOAD", target, "--target")
    env.pop("EBBTIDE_OFFLOAD_PATH", None)
    if path:
        if target == "cpu":
            raise ValueError("--path names an SSD folder; --target cpu offloads to host memory (use --target ssd)")
        env["EBBTIDE_OFFLOAD_PATH"] = os.path.abspath(path)
    if budget is not None:
        _core.check_setting("EBBTIDE_ACTIVATION_BUDGET", budget, "--budget")
        env["EBBTIDE_ACTIVATION_BUDGET"] = budget
    return env


def run(args):
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        raise ValueError("no command given: ebbtide run [--target cpu] -- COMMAND [ARG ...]")
    if not switch_installed():
        raise RuntimeError(f"the switch is not installed in this environment ({sys.prefix}): ebbtide-switch.pth is "
                           "missing from its site-packages; install ebbtide with pip (pip install . or the wheel)")
    env = environment(args.target, args.path, args.budget)
    exe = shutil.which(command[0], path=env.get("PATH"))
    if exe is None:
        raise OSError(f"{command[0]}: command not found")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(exe, command, env)
