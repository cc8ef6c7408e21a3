"""A build without one of its fast paths or without torch stops and names the
fix, unless asked for the fallback (Note [No silent fallback] in
cmake/ebbtide_dependencies.cmake, Note [Finding torch under build isolation]
in python/CMakeLists.txt). CMake configures only: each takes seconds."""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# Where Debian/Ubuntu and RHEL-family systems keep the headers and libraries;
# CMAKE_IGNORE_PATH hides exactly these folders from find_path/find_library.
SYSTEM_DIRS = ["/usr/include", "/usr/local/include", "/usr/lib", "/usr/lib64", "/usr/local/lib",
               "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"]


def configure(build, *defines, python=False, env=None):
    args = ["cmake", "-S", str(REPO), "-B", str(build), "-G", "Ninja", "-DEBBTIDE_BUILD_TESTS=OFF",
            "-DEBBTIDE_BUILD_BENCH=OFF", f"-DEBBTIDE_BUILD_PYTHON={'ON' if python else 'OFF'}", *defines]
    env = {k: v for k, v in (env or os.environ).items() if k != "EBBTIDE_LIBURING_ROOT"}
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    return p.returncode, p.stdout + p.stderr


HIDDEN = "-DCMAKE_IGNORE_PATH=" + ";".join(SYSTEM_DIRS)


def test_without_liburing_the_configure_stops_naming_the_packages_and_the_option(tmp_path):
    rc, out = configure(tmp_path, HIDDEN)
    assert rc != 0, out
    for text in ("liburing (the io_uring storage backend) not found", "apt-get install liburing-dev",
                 "dnf install liburing-devel", "-DEBBTIDE_WITH_LIBURING=OFF",
                 "-Ccmake.define.EBBTIDE_WITH_LIBURING=OFF"):
        assert text in out, out


def test_without_zstd_the_configure_stops_naming_the_packages_and_the_option(tmp_path):
    rc, out = configure(tmp_path, HIDDEN, "-DEBBTIDE_WITH_LIBURING=OFF")
    assert rc != 0, out
    for text in ("zstd (checkpoint compression) not found", "apt-get install libzstd-dev",
                 "dnf install libzstd-devel", "-DEBBTIDE_WITH_ZSTD=OFF", "-Ccmake.define.EBBTIDE_WITH_ZSTD=OFF"):
        assert text in out, out


def test_the_fallbacks_configure_when_asked_for(tmp_path):
    rc, out = configure(tmp_path, HIDDEN, "-DEBBTIDE_WITH_LIBURING=OFF", "-DEBBTIDE_WITH_ZSTD=OFF")
    assert rc == 0, out
    assert "only the POSIX backend will be built" in out and "checkpoints cannot be compressed" in out


def test_with_the_libraries_the_configure_finds_both(tmp_path):
    rc, out = configure(tmp_path)
    assert rc == 0, out
    assert "ebbtide: liburing found" in out and "ebbtide: zstd found" in out


def test_torch_hidden_as_pip_isolation_hides_it_is_found_in_the_interpreters_environment(tmp_path):
    # pip's default isolation: the same interpreter, its site-packages hidden
    # through PYTHONPATH (here a torch that fails to import stands in front).
    hide = tmp_path / "hide" / "torch"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('hidden, as by build isolation')\n")
    env = dict(os.environ, PYTHONPATH=str(hide.parent), PYTHONNOUSERSITE="1")
    rc, out = configure(tmp_path / "b", f"-DPython_EXECUTABLE={sys.executable}", python=True, env=env)
    assert rc == 0, out
    assert "outside the build's isolation" in out, out
    assert f"building ebbtide._torch against torch {torch.__version__}" in out, out


@pytest.fixture
def python_without_torch(tmp_path):
    """A virtual environment with nanobind (linked from this one) and no torch."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    import nanobind
    os.symlink(os.path.dirname(nanobind.__file__), os.path.join(site, "nanobind"))
    assert sysconfig.get_paths()["purelib"] != site
    return py


def test_without_torch_the_build_stops_naming_no_build_isolation(tmp_path, python_without_torch):
    rc, out = configure(tmp_path / "b", f"-DPython_EXECUTABLE={python_without_torch}", python=True)
    assert rc != 0, out
    flat = " ".join(out.split())
    for text in ("cannot import torch", "No module named 'torch'", "pip install --no-build-isolation .",
                 "-Ccmake.define.EBBTIDE_WITH_TORCH=OFF"):
        assert text in flat, out


def test_without_torch_the_build_without_the_tensor_cache_configures_when_asked_for(tmp_path, python_without_torch):
    rc, out = configure(tmp_path / "b", f"-DPython_EXECUTABLE={python_without_torch}", "-DEBBTIDE_WITH_TORCH=OFF",
                        python=True)
    assert rc == 0, out
    assert "ebbtide._torch not built (EBBTIDE_WITH_TORCH=OFF)" in out, out
