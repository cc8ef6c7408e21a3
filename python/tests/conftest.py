import os
import subprocess
import sys

import pytest


def run_cli(*args, check=True, timeout=600):
    """Runs `python -m ebbtide ARGS` in a subprocess; returns CompletedProcess."""
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "ebbtide", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"ebbtide {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def cli():
    return run_cli
