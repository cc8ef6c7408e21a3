"""A build without one of its fast paths stops and names the fix, unless asked
for the fallback (Note [No silent fallback] in
cmake/ebbtide_dependencies.cmake). CMake configures only: each takes seconds."""
import os
import subprocess
from pathlib import Path


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
