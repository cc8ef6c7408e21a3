#!/usr/bin/env bash
# Makes the two inputs of a manylinux_2_28 build on a newer Linux (Note
# [manylinux_2_28 without a container] in python/CMakeLists.txt), in OUT_DIR:
#   glibc-2.28/  link stubs of glibc 2.28 (libc.so.6, libm, libpthread, libdl,
#                librt, ld-linux) and its libc_nonshared.a, which zig's
#                toolchain generates for any glibc version, with the linker
#                scripts (libc.so, ...) that make `-L OUT_DIR/glibc-2.28` take
#                them in place of the system's: every glibc symbol the modules
#                use then binds to its 2.28 version, or stays unresolved (and
#                scripts/wheel_symbols.py refuses the build)
#   zstd/        zstd's library sources (the PyPI sdist `zstd`, which carries
#                upstream's lib/), built into the module as a static, hidden,
#                position-independent library: Debian's libzstd.a is not
#                position-independent and its libzstd.so needs glibc 2.34
# Usage: bash scripts/manylinux_sysroot.sh TOOLS_VENV OUT_DIR
#   TOOLS_VENV  a virtual environment with the `ziglang` package
# Idempotent: a finished OUT_DIR is left as it is. Prints nothing but errors.
set -euo pipefail
tools=$1
out=$2
zstd_sdist=zstd==1.5.7.2   # upstream zstd 1.5.7
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ ! -f "$out/glibc-2.28/libc.so" ]; then
  echo 'int ebbtide_stub_probe(void) { return 0; }' >"$work/probe.c"
  # zig links the probe against stubs it makes for the target's glibc; its
  # verbose link line names them.
  # (Its paths may be relative to the folder it runs in.)
  line=$(cd "$work" && ZIG_GLOBAL_CACHE_DIR="$out/zig-cache" "$tools/bin/python" -m ziglang build-lib -dynamic -lc \
           -target x86_64-linux-gnu.2.28 --verbose-link probe.c 2>&1 | grep -m1 -- '-o libprobe.so')
  mkdir -p "$out/glibc-2.28.tmp"
  for lib in libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1 libld.so.2 libc_nonshared.a; do
    path=$(tr ' ' '\n' <<<"$line" | grep -m1 "/$lib\$") || { echo "manylinux_sysroot.sh: zig made no $lib" >&2; exit 1; }
    (cd "$work" && cp "$path" "$out/glibc-2.28.tmp/$lib")
  done
  dir=$out/glibc-2.28
  mv "$out/glibc-2.28.tmp/libld.so.2" "$out/glibc-2.28.tmp/ld-linux-x86-64.so.2"  # its soname
  echo "GROUP ( $dir/libc.so.6 $dir/libc_nonshared.a AS_NEEDED ( $dir/ld-linux-x86-64.so.2 ) )" \
    >"$out/glibc-2.28.tmp/libc.so"
  for lib in libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1; do
    echo "INPUT ( $dir/$lib )" >"$out/glibc-2.28.tmp/${lib%%.so.*}.so"
  done
  rm -rf "$dir" "$out/zig-cache"
  mv "$out/glibc-2.28.tmp" "$dir"
fi

if [ ! -f "$out/zstd/zstd.h" ]; then
  "$tools/bin/python" -m pip download -q --no-deps --no-binary :all: -d "$work" "$zstd_sdist" 2>&1 \
    | grep -v "^WARNING: Location" >&2 || true
  tar -xzf "$work"/zstd-*.tar.gz -C "$work"
  lib=$(echo "$work"/zstd-*/zstd/lib)
  [ -f "$lib/zstd.h" ] || { echo "manylinux_sysroot.sh: $zstd_sdist has no zstd/lib/zstd.h" >&2; exit 1; }
  rm -rf "$out/zstd"
  mkdir -p "$out/zstd"
  cp -r "$lib"/common "$lib"/compress "$lib"/decompress "$lib"/zstd.h "$lib"/zstd_errors.h "$out/zstd/"
  cp "$work"/zstd-*/LICENSE "$out/zstd/"
fi
