#!/usr/bin/env bash
# Run here, on the Debian development machine: fetches the build dependencies
# the lent GPU machine lacks (liburing, GoogleTest, zstd headers; it has no
# package registry) as Debian packages and unpacks them into .deps/root, which
# git ignores, and wheels into .deps/wheels: nanobind (the build's
# bindings library: the version this tree is built with, not whichever one the
# machine's Python has), torchtune (bench/offload_bench.py's
# OffloadActivations row) and megatron-core (gpu_check.sh's megatron stage;
# numpy and packaging, its dependencies, are the machine's).
# scripts/gpu_check.sh unpacks the wheels without their dependencies. The device tool carries the folder with the tree:
#   run(command="bash scripts/gpu_check.sh", carry=[".deps"])
# liburing and GoogleTest are linked statically; zstd's static library is not
# position-independent, so the module links libzstd.so.1 (the machine's own at
# run time; scripts/gpu_check.sh puts this one on LD_LIBRARY_PATH as a fallback).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deps=$repo/.deps
pkgs=(liburing-dev liburing2 libgtest-dev libzstd-dev libzstd1)
command -v apt-get >/dev/null || { echo "device_deps.sh: needs apt-get (a Debian machine)" >&2; exit 1; }
rm -rf "$deps/debs" "$deps/root"
mkdir -p "$deps/debs" "$deps/root"
# apt's sandbox user cannot write into a root-owned work tree: download in a
# temporary directory it can reach, then move the files.
tmp=$(mktemp -d)
chmod 0777 "$tmp"
(cd "$tmp" && apt-get download -q "${pkgs[@]}") ||
  { echo "device_deps.sh: apt-get download failed (no package lists? run apt-get update first)" >&2; exit 1; }
mv "$tmp"/*.deb "$deps/debs/"
rmdir "$tmp"
for f in "$deps"/debs/*.deb; do
  dpkg -x "$f" "$deps/root"
done
# nanobind's wheel holds its CMake package and C++ sources; the pin is the
# version the development venv has (requirements-demo.txt pins 3.1.0).
# torchtune is pure Python. Its package __init__ imports torchao, HF datasets,
# torchdata and more, none of which OffloadActivations uses: ebbtide.harness.methods loads
# that class from its own file when the package import fails, so it needs only
# psutil (the GPU image has it) and no other wheel, torchao included
# (python/tests/test_torchtune_offload_loading.py loads it that way, with
# torchao and those packages hidden). The Python version and platform are
# the lent machine's (Python 3.12, x86-64).
# megatron-core (gpu_check.sh's megatron stage) is the version requirements-dev.txt pins.
wheels=(nanobind==3.1.0 torchtune==0.6.1 megatron-core==0.16.1)
rm -rf "$deps/wheels"
mkdir -p "$deps/wheels"
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$deps/wheels" "${wheels[@]}"
for need in usr/include/liburing.h usr/include/gtest/gtest.h usr/include/zstd.h; do
  [ -e "$deps/root/$need" ] || { echo "device_deps.sh: $need missing after unpacking ${pkgs[*]}" >&2; exit 1; }
done
for name in nanobind torchtune megatron_core; do
  compgen -G "$deps/wheels/$name-*.whl" >/dev/null || { echo "device_deps.sh: no $name wheel in $deps/wheels" >&2; exit 1; }
done
echo "device_deps.sh: $(du -sh "$deps" | cut -f1) in $deps (carry \".deps\")"
