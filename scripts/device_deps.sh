#!/usr/bin/env bash
# Run here, on the Debian development machine: fetches the build dependencies
# the lent GPU machine lacks (liburing, GoogleTest, zstd headers; it has no
# package registry) as Debian packages and unpacks them into .deps/root, which
# git ignores. The device tool carries the folder with the tree:
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
(cd "$tmp" && apt-get download -q "${pkgs[@]}")
mv "$tmp"/*.deb "$deps/debs/"
rmdir "$tmp"
for f in "$deps"/debs/*.deb; do
  dpkg -x "$f" "$deps/root"
done
for need in usr/include/liburing.h usr/include/gtest/gtest.h usr/include/zstd.h; do
  [ -e "$deps/root/$need" ] || { echo "device_deps.sh: $need missing after unpacking ${pkgs[*]}" >&2; exit 1; }
done
echo "device_deps.sh: $(du -sh "$deps" | cut -f1) in $deps (carry \".deps\")"
