#!/usr/bin/env bash
# Everything a lent GPU machine should check, in one call of the device tool:
#   (here, once)  bash scripts/device_deps.sh
#   (device)      run(command="bash scripts/gpu_check.sh", carry=[".deps"])
# Stages (default: all but the shape_* ones, in this order; name some to run
# only those). One device call runs at most 10 minutes, so split them over
# calls, each starting with `build` (a fresh machine rebuilds; a warm one
# reuses build/gpu):
#   build    CMake build of the C++ core, its tests and the Python modules
#            against the machine's python3 and torch (liburing, GoogleTest,
#            zstd and nanobind from .deps)
#   test     ctest (all C++ tests; the GPU ones run now), the CUDA pytest file and the
#            checkpoint tests with CUDA tensors
#   offload  bench/offload_bench.py --device cuda (the issue's GPU targets;
#            OFFLOAD_METHODS=a,b,... runs only those methods)
#   offload2 the same at a shape whose full offload fits PCIe bandwidth (2
#            layers, hidden 8192, seq 512: about 43 GB/s needed, by the model)
#   shape_a  bench/offload_bench.py --shape a (Llama style, SDPA, 8 layers,
#            hidden 4096, seq 2048), every method, eager blocks
#   shape_a_compiled  the same with each block compiled (--compile block),
#            adding torch's compiler offloading (compiler-offload)
#   shape_b  --shape b (hidden 8192, as many layers as fit: --layers auto)
#   shape_c  --shape c (4 layers, hidden 4096, eager attention: the issue's
#            "today's default"), every method
#            Each shape stage fits one device call after a warm `build`
#            (at most 9 minutes; shape_a_compiled is the longest). JSON:
#            offload_<stage>.json. OFFLOAD_METHODS=a,b,... narrows the methods.
#   pytest   the whole pytest suite (CPU tests included)
#   demo     ebbtide demo on CUDA, every method
#   io       ebbtide bench io (device <-> file)
#   ckpt     bench/ckpt_bench.py, safetensors (with loads into the GPU) and
#            DCP/native checkpoints, 2 GB each (CKPT_SIZE=GB): issue 16's numbers on a
#            machine whose fresh memory is cheap (fio, where installed, is the
#            reference; `io` gives the engine's own rates otherwise)
#   dist     bench/dist_offload.py under torchrun (nccl)
# Logs and JSON go to out/gpu (on the device: packed into $OUT, below), and a
# summary table is printed last. A stage that fails does not stop the next.
# Runs on a machine without a GPU too (the CUDA tests then skip): that is how
# the script itself is checked.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
# The device tool returns at most 8 files from $OUT: there, logs go to a
# scratch folder and are packed into $OUT/gpu_check.tgz after every step (so a
# call cut off at its limit still returns what ran).
if [ -n "${OUT:-}" ]; then out=/tmp/gpu_check_out; else out=$repo/out/gpu; fi
rm -rf "$out"
mkdir -p "$out"
pack() { [ -z "${OUT:-}" ] || tar czf "$OUT/gpu_check.tgz" -C "$out" .; }
py=${PYTHON:-python3}
jobs=$(nproc)
build=$repo/build/gpu
stages=("$@")
((${#stages[@]})) || stages=(build test offload offload2 pytest demo io dist)
summary=()

say() { printf '\033[1m[gpu_check]\033[0m %s\n' "$*"; }
# step NAME LOG LIMIT CMD...: runs CMD (killed after LIMIT seconds) with its
# output in $out/LOG, records the exit code.
step() {
  local name=$1 log=$2 limit=$3 t0=$SECONDS rc
  shift 3
  say "$name -> $log"
  timeout -k 10 "$limit" "$@" >"$out/$log" 2>&1
  rc=$?
  pack
  summary+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$log")")
  ((rc == 0)) || tail -n 25 "$out/$log"
  return $rc
}

{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>&1
  "$py" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
            'available', torch.cuda.is_available())" 2>&1
  nproc; free -g | head -2; df -hT "$repo" /tmp 2>&1; uname -r
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
pack

export EBBTIDE_LIBURING_ROOT=$repo/.deps/root
export PYTHONPATH=$repo/python:$build/python${PYTHONPATH:+:$PYTHONPATH}
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$repo/.deps/root/usr/lib/x86_64-linux-gnu
export PYTHONUNBUFFERED=1
# Wheels from scripts/device_deps.sh (nanobind, torchtune), pure Python: each
# is unpacked (the zipfile module; the machine's Python may lack pip), without
# its dependencies, into a scratch folder on PYTHONPATH. That puts it ahead of
# site-packages, so the build's `python -m nanobind` finds the carried nanobind,
# not the machine's own.
wheels=/tmp/ebbtide-wheels
unpack_wheels() {
  local whl sums
  sums=$(cksum "$repo"/.deps/wheels/*.whl)
  # A warm machine has them unpacked already; unpacking again would give the
  # nanobind sources new times and rebuild its objects.
  if [ "$(cat "$wheels/.unpacked" 2>/dev/null)" = "$sums" ]; then
    echo "unpacked already: $sums"
    return
  fi
  rm -rf "$wheels"
  for whl in "$repo"/.deps/wheels/*.whl; do
    echo "$whl"
    "$py" -m zipfile -e "$whl" "$wheels" || return
  done
  echo "$sums" >"$wheels/.unpacked"
}
if ! compgen -G "$repo/.deps/wheels/*.whl" >/dev/null; then
  say "no .deps/wheels: the build uses the machine's nanobind, and the torchtune row will say it was skipped" \
    "(run scripts/device_deps.sh here)"
elif unpack_wheels >"$out/wheels.log" 2>&1; then
  export PYTHONPATH=$PYTHONPATH:$wheels
else
  say "WARNING: unpacking .deps/wheels failed (see wheels.log); the build uses the machine's nanobind"
fi

# The module the tests and benchmarks import must be the one just built.
module_is_fresh() {
  step import import.log 60 "$py" -c "import torch, ebbtide._core as c, ebbtide._torch as t, sys; f = c.__file__; print(f, t.__file__)
print('cuda driver', c.cuda_driver_available(), c.cuda_unavailable_reason())
sys.exit(0 if f.startswith('$build/') and t.__file__.startswith('$build/') else 'ebbtide._core or ebbtide._torch is not the module built in $build')"
}

for stage in "${stages[@]}"; do
  case $stage in
    build | test | offload | offload2 | shape_a | shape_a_compiled | shape_b | shape_c | pytest | demo | io | ckpt | dist) ;;
    *)
      say "unknown stage '$stage' (valid: build test offload offload2 shape_a shape_a_compiled shape_b shape_c pytest demo io ckpt dist)"
      summary+=("$(printf '%-22s rc=%-3s' "$stage" "?")")
      continue
      ;;
  esac
  if [ "$stage" != build ] && ! module_is_fresh; then
    say "skipping stage $stage: no freshly built ebbtide._core"
    continue
  fi
  case $stage in
    build)
      [ -d "$repo/.deps/root/usr/include" ] || say "WARNING: no .deps (run scripts/device_deps.sh here and carry .deps)"
      # The lent machine's CXX is /opt/gcc's g++ 13, and nanobind links the
      # module with -static-libstdc++: that module crashed (SIGSEGV) whenever
      # one of its own threads formatted a number into a std::ostringstream
      # (2026-11-23, H100; the system g++ build passed the same tests). So
      # the system compiler builds here when there is one.
      compilers=()
      [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ] &&
        compilers=(-DCMAKE_CXX_COMPILER=/usr/bin/g++ -DCMAKE_C_COMPILER=/usr/bin/gcc)
      step configure configure.log 120 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${compilers[@]}" \
        -DEBBTIDE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v "$py")" \
        -DCMAKE_PREFIX_PATH="$repo/.deps/root/usr" &&
        step build build.log 400 cmake --build "$build" -j"$jobs"
      grep -E "liburing found|cuda.h|CUDA shim|GTest|ebbtide: nanobind|ebbtide._torch" "$out/configure.log"
      ;;
    test)
      step ctest ctest.log 300 ctest --test-dir "$build" --no-tests=error --output-on-failure -j8
      grep -E "tests passed|tests failed|Skipped|Failed|\*\*\*" "$out/ctest.log" | tail -n 20
      step pytest-cuda pytest-cuda.log 300 "$py" -m pytest -q -p no:cacheprovider -rs python/tests/test_cache_cuda.py
      tail -n 3 "$out/pytest-cuda.log"
      # Checkpoints with device tensors: safetensors (device= and into=) and the DCP plugin.
      step pytest-ckpt-cuda pytest-ckpt-cuda.log 200 "$py" -m pytest -q -p no:cacheprovider -rs -k cuda \
        python/tests/test_safetensors.py python/tests/test_dcp.py
      tail -n 3 "$out/pytest-ckpt-cuda.log"
      ;;
    pytest)
      step pytest-all pytest.log 480 "$py" -m pytest -q -p no:cacheprovider -rs python/tests
      tail -n 3 "$out/pytest.log"
      ;;
    offload)
      step offload_bench offload_bench.txt 300 "$py" bench/offload_bench.py --device cuda \
        ${OFFLOAD_METHODS:+--methods "$OFFLOAD_METHODS"} --json "$out/offload_bench.json"
      tail -n 25 "$out/offload_bench.txt"
      ;;
    offload2)
      step offload_bench2 offload_bench2.txt 300 "$py" bench/offload_bench.py --device cuda --layers 2 \
        --hidden 8192 --heads 64 --seq 512 --batch 4 --methods "${OFFLOAD_METHODS:-none,ebbtide-cpu,ebbtide-auto,recompute}" \
        --json "$out/offload_bench2.json"
      tail -n 25 "$out/offload_bench2.txt"
      ;;
    shape_a | shape_a_compiled | shape_b | shape_c)
      # (stage: shape, extra flags, steps, time limit in seconds)
      case $stage in
        shape_a) args=(--shape a) steps=6 limit=420 ;;
        shape_a_compiled) args=(--shape a --compile block) steps=4 limit=540 ;;
        shape_b) args=(--shape b) steps=4 limit=480 ;;
        shape_c) args=(--shape c) steps=6 limit=360 ;;
      esac
      mkdir -p /tmp/ebbtide-bench
      step "offload_$stage" "offload_$stage.txt" "$limit" "$py" bench/offload_bench.py --device cuda "${args[@]}" \
        --steps "$steps" --warmup 2 ${OFFLOAD_METHODS:+--methods "$OFFLOAD_METHODS"} \
        --path /tmp/ebbtide-bench --json "$out/offload_$stage.json"
      tail -n 30 "$out/offload_$stage.txt"
      ;;
    demo)
      step demo demo.json 300 "$py" -m ebbtide demo --device cuda \
        --methods none,ebbtide-ssd,ebbtide-cpu,ebbtide-auto,recompute,save_on_cpu --png "$out/demo.png" --json
      ;;
    io)
      mkdir -p /tmp/ebbtide-io
      step bench_io bench_io.json 300 "$py" -m ebbtide bench io --dir /tmp/ebbtide-io --size 4GiB --chunk 1MiB \
        --qd 16 --repeat 3 --json
      ;;
    ckpt)
      mkdir -p /tmp/ebbtide-ckpt
      dev=$("$py" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')
      step ckpt_safetensors ckpt_safetensors.txt 240 "$py" bench/ckpt_bench.py --safetensors --size "${CKPT_SIZE:-2.0}" --repeat 3 \
        --fresh-rounds 2 --fresh-pause 1 --device "$dev" --dir /tmp/ebbtide-ckpt --json "$out/ckpt_safetensors.json"
      tail -n 20 "$out/ckpt_safetensors.txt"
      step ckpt_dcp ckpt_dcp.txt 300 "$py" bench/ckpt_bench.py --size "${CKPT_SIZE:-2.0}" --repeat 2 --dir /tmp/ebbtide-ckpt \
        --json "$out/ckpt_dcp.json"
      tail -n 36 "$out/ckpt_dcp.txt"
      ;;
    dist)
      step dist_offload dist_offload.txt 300 "$py" -m torch.distributed.run --standalone --nproc_per_node 1 \
        bench/dist_offload.py --device cuda --dtype bf16 --hidden 2048 --heads 16 --seq 1024 --batch 4 \
        --json "$out/dist_offload.json"
      tail -n 20 "$out/dist_offload.txt"
      ;;
  esac
done

say "summary (logs in $out)"
printf '  %s\n' "${summary[@]}"
! printf '%s\n' "${summary[@]}" | grep -qv "rc=0 "
