#!/usr/bin/env bash
# Sets up a fresh machine for ebbtide: system packages (Debian), a virtual
# environment in .venv with torch and the test tools, and ebbtide itself.
# Idempotent: steps already done are skipped. Source-able variables:
#   EBBTIDE_VENV   where the venv goes (default: <repo>/.venv)
#   EBBTIDE_TORCH  the torch requirement (default: torch==2.13.0, the CPU build)
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${EBBTIDE_VENV:-$repo/.venv}
torch_req=${EBBTIDE_TORCH:-torch==2.13.0}

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

# 1. System packages: liburing (io_uring), GoogleTest, fio (benchmark
#    reference), zstd (checkpoint compression), pkg-config, clang (libFuzzer
#    for the fuzzing stage of scripts/test.sh).
need=()
for pkg in liburing-dev libgtest-dev fio libzstd-dev pkg-config g++ clang; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if ((${#need[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing system packages: ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    say "WARNING: missing system packages ${need[*]} and not root: install them with apt-get" >&2
  fi
fi

# 2. The virtual environment.
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
fi
py="$venv/bin/python"
if ! "$py" -c "import torch" 2>/dev/null; then
  say "installing $torch_req"
  "$py" -m pip install -q "$torch_req"
fi
stamp="$venv/.ebbtide-requirements"
if ! cmp -s "$repo/requirements-dev.txt" "$stamp" 2>/dev/null; then
  say "installing requirements-dev.txt"
  # The installed torch is a constraint: no requirement may replace it.
  torch_pin="torch==$("$py" -c 'import torch; print(torch.__version__)')"
  "$py" -m pip install -q -r "$repo/requirements-dev.txt" -c <(echo "$torch_pin")
  "$py" -m pip install -q --no-deps llm-analysis==0.2.2
  "$py" -m pip install -q --no-deps torchtune==0.6.1
  cp "$repo/requirements-dev.txt" "$stamp"
fi

# 3. ebbtide itself (the native module is built by scikit-build-core + CMake).
say "building and installing ebbtide"
"$py" -m pip install -q --no-build-isolation "$repo" 2>&1 | grep -v "^WARNING: Location" || true
"$py" -c "import ebbtide._core" || { echo "ebbtide failed to install" >&2; exit 1; }
say "ready: $venv"
