"""The mem area's bindings: CUDA and cuFile availability (no GPU needed)."""
import os
import subprocess
import sys

import pytest

from ebbtide import _core


def test_cuda_availability_and_reason_agree():
    available = _core.cuda_available()
    reason = _core.cuda_unavailable_reason()
    assert isinstance(available, bool)
    assert isinstance(reason, str)
    assert available == (reason == ""), reason
    if not _core.build_info["cuda_shim"]:
        assert reason == "built without cuda.h"


def test_cufile_availability_and_reason_agree():
    available = _core.cufile_available()
    reason = _core.cufile_unavailable_reason()
    assert isinstance(available, bool)
    assert available == (reason == ""), reason
    if not _core.cuda_available():
        assert not available
        assert "no CUDA driver" in reason or "EBBTIDE_CUFILE" in reason


def _run(code, **env):
    full = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True)


def test_env_switches_disable_the_shims():
    # The shims initialise once per process: check the switches in a child.
    r = _run(
        "from ebbtide import _core;"
        "print(_core.cuda_available(), _core.cuda_unavailable_reason(), sep='|');"
        "print(_core.cufile_available(), _core.cufile_unavailable_reason(), sep='|')",
        EBBTIDE_CUDA="0",
    )
    assert r.returncode == 0, r.stderr
    cuda_line, cufile_line = r.stdout.strip().splitlines()
    assert cuda_line == "False|disabled by EBBTIDE_CUDA=0"
    assert cufile_line.startswith("False|")
    assert "EBBTIDE_CUDA=0" in cufile_line

    r = _run("from ebbtide import _core; print(_core.cufile_unavailable_reason())", EBBTIDE_CUFILE="off")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "disabled by EBBTIDE_CUFILE=off"


def test_bad_switch_value_is_a_value_error():
    r = _run(
        "from ebbtide import _core\n"
        "try:\n"
        "    _core.cuda_available()\n"
        "except ValueError as e:\n"
        "    print('ValueError', e)\n",
        EBBTIDE_CUDA="sometimes",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ValueError") and "EBBTIDE_CUDA" in r.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
