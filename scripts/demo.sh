#!/usr/bin/env bash
# Sets up what `ebbtide demo` needs, and only that, then runs it on built-in
# defaults (arguments go to `ebbtide demo`): the Debian packages the build
# needs, a venv with torch and requirements-demo.txt, and ebbtide, rebuilt only
# when its sources changed. scripts/setup.sh adds what the tests need; both
# share .venv. Variables as for scripts/setup.sh (EBBTIDE_VENV, EBBTIDE_TORCH).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${EBBTIDE_VENV:-$repo/.venv}
torch_req=${EBBTIDE_TORCH:-torch==2.13.0}
say_tag=demo
source "$repo/scripts/setup_lib.sh"

ensure_system_packages liburing-dev libzstd-dev pkg-config g++
ensure_venv_with_torch
ensure_requirements requirements-demo.txt
ensure_ebbtide
exec "$venv/bin/ebbtide" demo "$@"
