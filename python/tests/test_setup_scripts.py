"""scripts/demo.sh sets up only what the demo needs and builds ebbtide only
when its sources changed (issue 41, part 2); scripts/setup.sh (the tests'
setup) shares its steps (scripts/setup_lib.sh)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The development stack the demo does not need (about 2 GB).
HEAVY = ("deepspeed", "ray", "trl", "pytorch-lightning", "torchtune", "atheris", "accelerate", "torchao")


def requirement_names(path):
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            names.append(re.split(r"[<>=\[; ]", line)[0].lower())
    return names


def test_the_demo_installs_only_what_it_needs():
    demo = requirement_names(REPO / "requirements-demo.txt")
    assert set(demo) == {"nanobind", "scikit-build-core", "numpy", "transformers", "matplotlib"}, demo
    dev = (REPO / "requirements-dev.txt").read_text()
    assert "-r requirements-demo.txt" in dev and all(h in dev for h in HEAVY)
    script = (REPO / "scripts" / "demo.sh").read_text()
    assert not re.search(r"^\s*(bash|source|\.)\s+\S*setup\.sh", script, re.M)  # the tests' setup stays apart
    assert re.search(r"^ensure_requirements requirements-demo.txt$", script, re.M), script
    assert re.search(r"^ensure_system_packages liburing-dev libzstd-dev pkg-config g\+\+$", script, re.M), script


FAKE_PYTHON = """#!/usr/bin/env bash
# Records pip's calls instead of building; everything else is the real Python.
if [ "$1" = -m ] && [ "$2" = pip ]; then echo "pip $*" >>"{log}"; exit 0; fi
exec "{python}" "$@"
"""


def ensure_ebbtide(repo, venv):
    script = f'repo={repo}; venv={venv}; py={venv}/bin/python; source {REPO}/scripts/setup_lib.sh; ensure_ebbtide'
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_the_build_is_skipped_when_nothing_changed(tmp_path):
    repo = tmp_path / "repo"
    for name in ("CMakeLists.txt", "pyproject.toml"):
        repo.mkdir(exist_ok=True)
        shutil.copy(REPO / name, repo / name)
    for folder in ("cmake", "cpp/include", "cpp/src", "python/src", "python/ebbtide"):
        shutil.copytree(REPO / folder, repo / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("cpp/CMakeLists.txt", "python/CMakeLists.txt"):
        shutil.copy(REPO / name, repo / name)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "pip.log"
    (venv / "bin" / "python").write_text(FAKE_PYTHON.format(log=log, python=sys.executable))
    os.chmod(venv / "bin" / "python", 0o755)

    def pip_calls():
        return len(log.read_text().splitlines()) if log.exists() else 0

    assert "building and installing ebbtide" in ensure_ebbtide(repo, venv) and pip_calls() == 1
    assert "built from these sources already" in ensure_ebbtide(repo, venv) and pip_calls() == 1
    with open(repo / "cpp" / "src" / "util" / "settings.cpp", "a") as f:
        f.write("// changed\n")
    assert "building and installing ebbtide" in ensure_ebbtide(repo, venv) and pip_calls() == 2
    (repo / "python" / "ebbtide" / "cli.py").write_text((repo / "python" / "ebbtide" / "cli.py").read_text() + "\n")
    assert "building and installing ebbtide" in ensure_ebbtide(repo, venv) and pip_calls() == 3
    assert "built from these sources already" in ensure_ebbtide(repo, venv) and pip_calls() == 3
