import json
import os
import subprocess
import sys

import pytest

BENCH_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


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


@pytest.fixture
def stores_before_backward(monkeypatch):
    """EBBTIDE_MAX_INFLIGHT=1: each pack waits for the stores queued before it,
    so every offloaded tensor of a forward but the last is stored before
    backward however loaded the machine is, and a test may assert offloaded
    bytes. Not for tests that hold stores at a gate (the pack would wait)."""
    monkeypatch.setenv("EBBTIDE_MAX_INFLIGHT", "1")


@pytest.fixture
def run_bench(tmp_path, stores_before_backward):
    """run_bench(SCRIPT, *ARGS, launcher=(), env=None, timeout=300) runs
    bench/SCRIPT ARGS --json FILE with this Python (after LAUNCHER, e.g. the
    torchrun module), fails the test with its output unless it exits 0, and
    returns (CompletedProcess, the JSON it wrote). The stores of its caches
    finish before backward (stores_before_backward)."""
    def run(script, *args, launcher=(), env=None, timeout=300):
        out = tmp_path / f"{script}.json"
        p = subprocess.run([sys.executable, *launcher, os.path.join(BENCH_DIR, script), *args, "--json", str(out)],
                           capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {})))
        assert p.returncode == 0, f"bench/{script} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
        return p, json.loads(out.read_text())

    return run
