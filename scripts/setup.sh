#!/usr/bin/env bash
# Sets up a fresh machine for ebbtide's tests: system packages (Debian), a
# virtual environment in .venv with torch and the test tools, and ebbtide
# itself. Idempotent: steps already done are skipped (ebbtide is rebuilt only
# when its sources changed). scripts/demo.sh sets up only what the demo needs.
# Source-able variables:
#   EBBTIDE_VENV   where the venv goes (default: <repo>/.venv)
#   EBBTIDE_TORCH  the torch requirement (default: torch==2.13.0, the CPU build)
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${EBBTIDE_VENV:-$repo/.venv}
torch_req=${EBBTIDE_TORCH:-torch==2.13.0}
source "$repo/scripts/setup_lib.sh"

# 1. System packages: liburing (io_uring), GoogleTest, fio (benchmark
#    reference), zstd (checkpoint compression), pkg-config, clang (libFuzzer
#    for the fuzzing stage of scripts/test.sh).
ensure_system_packages liburing-dev libgtest-dev fio libzstd-dev pkg-config g++ clang

# 2. The virtual environment: torch, then requirements-dev.txt (which includes
#    requirements-demo.txt). llm-analysis pins transformers<5, which it does
#    not need at run time, and torchtune 0.6.1 pins torchdata and pulls
#    kagglehub and blobfile, none of which its training utilities import: both
#    are installed without their dependencies (requirements-dev.txt lists
#    what they do need).
ensure_venv_with_torch
ensure_requirements requirements-dev.txt requirements-demo.txt -- llm-analysis==0.2.2 torchtune==0.6.1

# 3. ebbtide itself.
ensure_ebbtide
say "ready: $venv"
