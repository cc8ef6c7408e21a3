#!/usr/bin/env bash
# Sets everything up and runs all tests: C++ units (GoogleTest via ctest), the
# same units under ASan+UBSan, then the Python integration tests (pytest).
# Set EBBTIDE_SKIP_SANITIZERS=1 to skip the sanitizer build during development.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
bash scripts/setup.sh
py=${EBBTIDE_VENV:-$repo/.venv}/bin/python
jobs=${EBBTIDE_JOBS:-2}

say() { printf '\033[1m[test]\033[0m %s\n' "$*"; }

say "C++ build (RelWithDebInfo)"
cmake -S . -B build/ci -G Ninja -DPython_EXECUTABLE="$py" -DEBBTIDE_BUILD_PYTHON=OFF >/dev/null
cmake --build build/ci -j"$jobs"
say "C++ tests"
ctest --test-dir build/ci --no-tests=error --output-on-failure -j"$jobs"

if [ "${EBBTIDE_SKIP_SANITIZERS:-0}" != 1 ]; then
  say "C++ build and tests under ASan+UBSan"
  cmake -S . -B build/asan -G Ninja -DEBBTIDE_SANITIZE=address,undefined \
    -DEBBTIDE_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=Debug >/dev/null
  cmake --build build/asan -j"$jobs"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build/asan --no-tests=error --output-on-failure -j"$jobs"
fi

say "Python tests"
# Run against the installed package (what users get), not the source tree.
cd "$repo/python/tests"
"$py" -m pytest -q -p no:cacheprovider "$repo/python/tests" "$@"
