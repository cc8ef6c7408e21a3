#!/usr/bin/env bash
# Sets everything up and runs the main job: `ebbtide demo` on built-in defaults.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$repo/scripts/setup.sh"
exec "${EBBTIDE_VENV:-$repo/.venv}/bin/ebbtide" demo "$@"
