#!/usr/bin/env bash
# Sets everything up and runs all tests: C++ units (GoogleTest via ctest), the
# same units under ASan+UBSan, bounded libFuzzer runs of the checkpoint shard
# reader and the safetensors reader and an atheris run over the checkpoint
# state tree, then the Python integration tests (pytest).
# Set EBBTIDE_SKIP_SANITIZERS=1 to skip the sanitizer build and the fuzzing
# during development; EBBTIDE_FUZZ_SECONDS sets each fuzz target's time (default 60);
# EBBTIDE_SERIAL_TESTS=1 runs the wheel tests in line with the rest (arguments
# given are pytest's, and run in line too).
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

  # Checkpoint loading must be safe against any file (docs/checkpoints.md,
  # "Threat model"): cpp/fuzz/fuzz_ckpt_shard.cpp feeds mutated shards (with
  # their checksums repaired) to the decoders and the reader, and
  # cpp/fuzz/fuzz_safetensors.cpp mutated safetensors files to the header
  # parser and the reader, under ASan+UBSan, each for EBBTIDE_FUZZ_SECONDS. A
  # crash, sanitizer report or untyped exception fails the stage and leaves
  # the input in build/fuzz/crash-*.
  fuzz_seconds=${EBBTIDE_FUZZ_SECONDS:-60}
  probe=$(mktemp -d)
  fuzz_pids=()
  echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' >"$probe/p.cpp"
  if command -v clang++ >/dev/null && clang++ -fsanitize=fuzzer,address,undefined "$probe/p.cpp" -o "$probe/p" 2>/dev/null; then
    rm -f "$probe/p.cpp" "$probe/p"
    CC=clang CXX=clang++ cmake -S . -B build/fuzz -G Ninja -DEBBTIDE_BUILD_FUZZ=ON -DEBBTIDE_BUILD_TESTS=OFF \
      -DEBBTIDE_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
    cmake --build build/fuzz -j"$jobs" --target fuzz_ckpt_shard fuzz_safetensors
    # The fuzzers are single-threaded: the two targets and the atheris run
    # below share the two cores at once (each for its full time), one log each.
    for target in ckpt_shard safetensors; do
      say "Fuzzing ${target} (libFuzzer, ASan+UBSan, ${fuzz_seconds} s, in the background)"
      # New inputs go to a scratch directory; the checked-in seeds stay as they are.
      mkdir -p "$probe/$target"
      cp cpp/fuzz/corpus/"$target"/* "$probe/$target/"
      EBBTIDE_LOG_LEVEL=error build/fuzz/cpp/fuzz/fuzz_"$target" -max_total_time="$fuzz_seconds" -max_len=32768 \
        -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix=build/fuzz/ "$probe/$target" \
        >"$probe/$target.log" 2>&1 &
      fuzz_pids+=("$!:$target")
    done
  else
    say "SKIPPED fuzzing: clang++ cannot link -fsanitize=fuzzer here (scripts/setup.sh installs the Debian package clang)"
  fi
  # The state tree of a native checkpoint is parsed in Python: an atheris
  # target (python/fuzz/fuzz_state_tree.py) mutates it and requires that
  # load() and `ebbtide ckpt inspect` agree (issue 33), EBBTIDE_PY_FUZZ_SECONDS (default 30).
  py_fuzz_seconds=${EBBTIDE_PY_FUZZ_SECONDS:-30}
  say "Fuzzing the state tree (atheris, ${py_fuzz_seconds} s)"
  mkdir -p "$probe/state_tree" build/fuzz
  EBBTIDE_LOG_LEVEL=error "$py" python/fuzz/fuzz_state_tree.py -max_total_time="$py_fuzz_seconds" -timeout=60 \
    -print_final_stats=1 -artifact_prefix=build/fuzz/ "$probe/state_tree" >"$probe/state_tree.log" 2>&1 &
  fuzz_pids+=("$!:state_tree")
  fuzz_failed=""
  for entry in "${fuzz_pids[@]}"; do
    wait "${entry%%:*}" || fuzz_failed="$fuzz_failed ${entry#*:}"
    say "Fuzzing ${entry#*:}: its output"
    tail -n 40 "$probe/${entry#*:}.log"
  done
  if [ -n "$fuzz_failed" ]; then
    say "FAILED fuzzing:$fuzz_failed (artifacts under build/fuzz/)"
    exit 1
  fi
  rm -rf "$probe"
fi

say "Python tests"
# Run against the installed package (what users get), not the source tree.
cd "$repo/python/tests"
if [ $# -gt 0 ] || [ "${EBBTIDE_SERIAL_TESTS:-0}" = 1 ]; then
  exec "$py" -m pytest -q -p no:cacheprovider "$repo/python/tests" "$@"
fi
# The wheel tests (about 6 minutes) spend most of theirs in pip, on the
# network and on disk: they run beside the rest, in a pytest of their own
# with its own temporary folder, and their output follows the suite's.
wheel_tmp=$(mktemp -d)
"$py" -m pytest -q -p no:cacheprovider --basetemp="$wheel_tmp/t" "$repo/python/tests/test_wheel.py" \
  >"$wheel_tmp/log" 2>&1 &
wheel_pid=$!
rc=0
# --durations: the slowest tests, in CI's log, for keeping the run well under 30 minutes.
"$py" -m pytest -q -p no:cacheprovider --durations=15 "$repo/python/tests" --ignore="$repo/python/tests/test_wheel.py" || rc=$?
wheel_rc=0
wait "$wheel_pid" || wheel_rc=$?
say "Wheel tests (python/tests/test_wheel.py, run beside the rest): exit ${wheel_rc}"
cat "$wheel_tmp/log"
rm -rf "$wheel_tmp"
[ "$rc" = 0 ] && [ "$wheel_rc" = 0 ]
