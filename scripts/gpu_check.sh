#!/usr/bin/env bash
# Everything a lent GPU machine should check, in calls of the device tool:
#   (here, once)  bash scripts/device_deps.sh
#   (device)      run(command="bash scripts/gpu_check.sh build test", carry=[".deps"], timeout_s=600)
# Stages (default: build test offload offload2 pytest demo io dist; name some
# to run only those, several per call). A device call runs at most 10
# minutes, so the script stops itself first: GPU_CHECK_DEADLINE seconds after
# it starts (default 540) the running step is killed and the stages left are
# not run, each recorded so in the summary. A fresh machine rebuilds (start a
# call with `build` or `build_py`); a warm one reuses build/gpu.
#   build    CMake build of the C++ core, its tests and the Python modules
#            against the machine's python3 and torch (liburing, GoogleTest,
#            zstd and nanobind from .deps)
#   build_py only the Python modules ebbtide._core and ebbtide._torch (what
#            every stage but `test`'s ctest needs), skipping the C++ tests
#   issue40  the preset for issue 40's whole check in one device call (see
#            "The issue40 preset" below)
#   test     preflight: the CUDA shim is built and, where torch sees a GPU,
#            ebbtide._core.cuda_driver_available(); ctest (the GPU tests run
#            now); the CUDA pytest files (test_cache_cuda*.py,
#            test_checkpoint_gpu.py, test_torchtune_offload_loading.py) and
#            the checkpoint tests with CUDA tensors. On a GPU machine a
#            skipped test there fails the stage (pytest's JUnit XML is
#            read), except "needs two GPUs" on a machine with one.
#            TEST_K (pytest -k) runs only the CUDA tests it selects and
#            skips the checkpoint ones (a rerun of the tests that failed)
#   test_cache  the preflight and the tensor cache's CUDA tests
#            (test_cache_cuda.py, test_cache_cuda_findings.py) alone
#   ctest    the C++ tests: builds what build_py left out, then ctest
#   sanitize the CUDA test files under compute-sanitizer, where it is on
#            PATH or in /usr/local/cuda*/bin (else recorded as not run):
#            SANITIZE_TOOLS (default "memcheck racecheck") one after the
#            other, on the tests SANITIZE_K selects (pytest -k; default: all
#            but the two that time the device against the host)
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
#            JSON: offload_<stage>.json, step trace: trace_<stage>.json
#            (`ebbtide plan --replay` reads it). OFFLOAD_METHODS=a,b,...
#            narrows the methods, OFFLOAD_STEPS=N sets the measured steps
#            (default 6, 4 for shape_a_compiled and shape_b). The gradient
#            check runs a deterministic round (bench/offload_bench.py
#            --grad-check). The benchmark's exit code 3 (a target missed) is
#            recorded as "targets missed", other nonzero codes as errors.
#   budget   bench/budget_bench.py --shape a --fractions 0.5,0.25 (issues 29
#            and 40), ebbtide with target auto (BUDGET_TARGET: the target a
#            user with host memory picks): keep, full recompute (HF
#            checkpointing), offload of every block, torchtune's offloading
#            with HF checkpointing, ebbtide's budget at 0.5 and 0.25 of
#            keep's saved activations, ebbtide's allocator budgets at 5
#            points from keep's allocator peak down to full recompute's,
#            and the same budgets with target ssd (kept apart)
#            (BUDGET_STRATEGIES narrows them); allocator peaks; exit code 3
#            (recorded "targets missed") when ebbtide is not faster than a
#            peer whose peak is at or above its own, or an allocator budget
#            is not met or is slower than the fastest single strategy that
#            fits it. JSON: budget.json, trace: trace_budget.json. Progress
#            lines (seconds since the start, each strategy's set-up and
#            step) go to budget.txt as they happen; the bench gets
#            --time-limit (the step's limit less 45 s), so the table comes
#            out with what ran, a strategy left without a timed step marked
#            cut; BUDGET_STRATEGY_LIMIT=S cuts a strategy whose steps took
#            more than S s in all. No compiles: about 1 min on an H200.
#   budget_compiled  the same with every block compiled (--compile block):
#            compiled keep, compiled full recompute and torch's
#            activation_memory_budget at the fractions against ebbtide's
#            budgets on the compiled blocks (issue 40, item 5). JSON:
#            budget_compiled.json, trace: trace_budget_compiled.json.
#            About 1.5 min on an H200, most of it compiling (four graphs)
#   budget_a the same as budget with recompute, torchtune and ebbtide's
#            fractions only: 1 min. JSON: budget_a.json
#   budget_b torch's activation_memory_budget (eager others) and ebbtide's
#            fractions only: 1 min (two compiles). JSON: budget_b.json
#   pytest   the whole pytest suite (CPU tests included)
#   demo     ebbtide demo on CUDA, every method
#   io       ebbtide bench io (device <-> file)
#   ckpt     checkpoints with CUDA state, 1 GB (CKPT_SIZE=GB), about 130 s expected on
#            an H200 (limits 60 + 120 + 60 s; 106 s before the A/B on the 2-core VM's CPU at
#            0.05 GB): bench/ckpt_bench.py --device-loads
#            (a safetensors file into CUDA tensors, ebbtide against load_file
#            + .to("cuda") and load_file(device=); a DCP checkpoint into CUDA
#            targets, EbbtideReader against FileSystemReader; JSON
#            ckpt_loads.json) and bench/ckpt_first_save.py --mode async
#            --device cuda (every async save's blocking time, native and
#            dcp.async_save, against a D2H copy of the state; JSON
#            ckpt_async.json), then --mode async-ab (the copying paths'
#            later calls alternated in one process: DCP over native; limit
#            60 s; JSON ckpt_async_ab.json). Without a GPU all run on CPU
#            tensors
#   dist     bench/dist_offload.py under torchrun (nccl)
#   megatron bench/megatron_offload.py --device cuda (issue 43): a Megatron-core
#            GPTModel (local spec, 8 layers, hidden 2048, seq 2048, bf16) with
#            ebbtide's budget at half its saved bytes, against Megatron's full
#            recompute, the flags `ebbtide plan --megatron` prints and (where
#            Transformer Engine is installed; its row says n/a otherwise)
#            Megatron's fine-grained offloading: step time and allocator peak.
#            About 60 s. n/a (rc 10) without megatron-core (device_deps.sh
#            carries its wheel) or numpy. JSON: megatron.json
# The issue40 preset (`bash scripts/gpu_check.sh issue40`, GPU_CHECK_DEADLINE
# 540 s): issue 40's check in one device call on a fresh H200, the stages in
# order of value, so that a call the deadline cuts has the most important
# results packed already. Expected times (expected, unmeasured; from the
# stage times of 2026-11-28 on an H200, summary-call1/2.txt in
# bench/gpu-runs/2026-11-28-h200, plus what each stage adds since):
#   (start)           10 s  (env.txt: nvidia-smi and a torch import, 6 s as the
#                            import check's; unpacking .deps/wheels)
#   build_py          55 s  (configure 8 s, build_py 45 s; one import check 6 s)
#   shape_a           55 s  (none, ebbtide-cpu, ebbtide-auto, torchtune: 47 s, and
#                            the deterministic gradient round and trace)
#   budget            60 s  (13 models, no compiles; budget_a's 29 s had 5)
#   shape_b           80 s  (none, ebbtide-cpu, ebbtide-auto: 90 s less torchtune's
#                            2.6 s steps, plus the deterministic round)
#   test_cache        60 s  (the cache's CUDA tests, 82 s in 2026-11-28, less the
#                            two expandable-segments tests, 32 s: run `test` for them)
#   budget_compiled   90 s  (four compiles, 15 s each cold on 2026-11-28)
#   shape_a_compiled  70 s  (none, ebbtide-auto, compiler-offload; two compiles;
#                            no gradient round: --grad-check off)
#   ctest             30 s  (the C++ tests build_py left out, then ctest: 6 s)
#   megatron          60 s
#   ckpt              what is left (its own stages cut at the deadline)
# 510 s to the end of ctest: megatron then has 20 s before the deadline's
# 10 s of grace (it completes only where the stages before ran 40 s faster
# than expected), ckpt what is left after it. A machine without a GPU runs the benchmark stages on the CPU
# at a small size (GPU_CHECK_SMALL=1 does so on a GPU too): that checks the
# stages and their traces, not the GPU; the CUDA stages say n/a or skip.
# GPU_CHECK_INSTALLED=1 uses the installed ebbtide instead of a build of this
# tree (checking the script on a machine without a build; python/tests/
# test_gpu_check_script.py does). Unpack a returned gpu_check.tgz for the
# replay test with `python scripts/unpack_gpu_check.py gpu_check.tgz`.
# GPU_CHECK_DRY_RUN=1 runs nothing: each step prints its command and limit
# (and writes them to its log), the benchmark stages get the GPU's flags, and
# a clock of the script's own advances by each stage's expected seconds
# (stage_seconds below; 0 for a stage without one), so the stage list, the
# preset's settings and the deadline arithmetic (which steps are cut, the
# limits and --time-limit they get) can be checked in a second on any
# machine (python/tests/test_gpu_check_script.py does).
# Logs and JSON go to out/gpu (on the device: a scratch folder packed into
# $OUT/gpu_check.tgz every GPU_CHECK_PACK_EVERY seconds, default 20, while a
# step runs, after each step and at the end, so a call cut off at its limit
# still returns what ran), and a summary table is printed last. A stage that
# fails does not stop the next. The exit code is 0 only when every step has
# rc=0 or rc=n/a (not applicable here, with the reason).
# Runs on a machine without a GPU too (the CUDA tests then skip, which the
# summary says): that is how the script itself is checked. PYTHON, if set,
# must be an absolute path (e.g. PYTHON=$PWD/.venv/bin/python).
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
t_start=$SECONDS
deadline=${GPU_CHECK_DEADLINE:-540}
pack_every=${GPU_CHECK_PACK_EVERY:-20}
for v in deadline pack_every; do
  [[ ${!v} =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: GPU_CHECK_${v^^}=${!v} is not a number of seconds" >&2; exit 2; }
done
dry=${GPU_CHECK_DRY_RUN:-0}
[[ $dry =~ ^[01]$ ]] || { echo "gpu_check.sh: GPU_CHECK_DRY_RUN=$dry is not 0 or 1" >&2; exit 2; }
# A dry run's clock is its own: only the stages' expected seconds advance it
# (dry_step), so what it cuts does not depend on this machine's speed.
dry_clock=0
dry_left=0  # the running stage's expected seconds not yet spent
# The device tool returns at most 8 files from $OUT: there, logs go to a
# scratch folder and are packed into $OUT/gpu_check.tgz (written beside and
# renamed, so a copy taken at any moment is whole).
if [ -n "${OUT:-}" ]; then out=${GPU_CHECK_SCRATCH:-/tmp/gpu_check_out}; else out=$repo/out/gpu; fi
rm -rf "$out"
mkdir -p "$out"
pack() {
  [ -n "${OUT:-}" ] || return 0
  local tmp="$OUT/.gpu_check.tgz.$BASHPID" rc
  tar czf "$tmp" --warning=no-file-changed -C "$out" . 2>/dev/null
  rc=$?
  if ((rc <= 1)); then mv -f "$tmp" "$OUT/gpu_check.tgz"; else rm -f "$tmp"; fi
}
packer=
start_packer() {
  [ -n "${OUT:-}" ] || return 0
  (
    trap 'kill "$s" 2>/dev/null; exit 0' TERM
    while :; do
      sleep "$pack_every" &
      s=$!
      wait "$s"
      pack
    done
  ) >/dev/null 2>&1 &
  packer=$!
}
stop_packer() {
  [ -n "$packer" ] || return 0
  kill "$packer" 2>/dev/null
  wait "$packer" 2>/dev/null
  packer=
}
trap stop_packer EXIT
py=${PYTHON:-python3}
case $py in
  /*) ;;
  */*) echo "gpu_check.sh: PYTHON=$py must be an absolute path" >&2; exit 2 ;;
esac
jobs=$(nproc)
build=$repo/build/gpu
stages=("$@")
((${#stages[@]})) || stages=(build test offload offload2 pytest demo io dist)
all_stages="build build_py test test_cache ctest sanitize offload offload2 shape_a shape_a_compiled shape_b shape_c budget budget_compiled budget_a budget_b pytest demo io ckpt dist megatron issue40"
# The issue40 preset: its stages, and the settings it gives them (a variable
# the caller sets wins).
declare -A preset_methods=() preset_grad=()
test_deselect=
expanded=()
for s in "${stages[@]}"; do
  if [ "$s" = issue40 ]; then
    expanded+=(build_py shape_a budget shape_b test_cache budget_compiled shape_a_compiled ctest megatron ckpt)
    preset_methods=([shape_a]=none,ebbtide-cpu,ebbtide-auto,torchtune [shape_b]=none,ebbtide-cpu,ebbtide-auto
                    [shape_a_compiled]=none,ebbtide-auto,compiler-offload)
    preset_grad=([shape_a_compiled]=off)
    test_deselect="not expandable_segments"
  else
    expanded+=("$s")
  fi
done
stages=("${expanded[@]}")
# Each stage's expected seconds on an H200 (start: before the first stage):
# the preset's table above (and docs/benchmarks.md's), what
# GPU_CHECK_DRY_RUN=1 advances its clock by.
declare -A stage_seconds=([start]=10 [build_py]=55 [shape_a]=55 [budget]=60 [shape_b]=80 [test_cache]=60 [budget_compiled]=90
                          [shape_a_compiled]=70 [megatron]=60 [ctest]=30)
summary=()
deadline_hit=0

say() { printf '\033[1m[gpu_check]\033[0m %s\n' "$*"; }
# now: seconds since the start; left: until the deadline.
now() { if ((dry)); then echo "$dry_clock"; else echo $((SECONDS - t_start)); fi; }
left() { echo $((deadline - $(now))); }
# record NAME RC SECONDS LOG [NOTE]: one summary line.
record() {
  summary+=("$(printf '%-22s rc=%-4s %4ss  %s' "$1" "$2" "$3" "$4")${5:+  ($5)}")
}
# step NAME LOG LIMIT CMD...: runs CMD with its output in $out/LOG, killed
# after LIMIT seconds or at the deadline, whichever comes first; records its
# exit code. Exit code 10 from a check means "not applicable here" (rc=n/a,
# the reason its last line); 3 from a benchmark, "targets missed".
step() {
  local name=$1 log=$2 limit=$3 t0 rc note="" cut=0 remaining
  t0=$(now)
  shift 3
  remaining=$(($(left) - 10))  # timeout's grace period (-k 10) included
  if ((remaining < 5)); then
    deadline_hit=1
    record "$name" "-" 0 "$log" "not run: GPU_CHECK_DEADLINE=${deadline}s reached"
    return 124
  fi
  ((limit > remaining)) && limit=$remaining cut=1
  say "$name -> $log (limit ${limit}s)"
  if ((dry)); then
    dry_step "$out/$log" "$limit" "$@"
  else
    timeout -k 10 "$limit" "$@" >"$out/$log" 2>&1
  fi
  rc=$?
  if ((rc == 124 || rc == 137)); then
    if ((cut)); then
      deadline_hit=1
      note="killed at GPU_CHECK_DEADLINE=${deadline}s"
    else
      note="killed at its limit of ${limit}s"
    fi
  elif ((rc == 10)); then
    rc=n/a
    note=$(tail -n 1 "$out/$log")
  elif ((rc == 3)) && [[ $name == offload* || $name == budget* ]]; then
    note="targets missed"
  fi
  pack
  record "$name" "$rc" "$(($(now) - t0))" "$log" "$note"
  [ "$rc" = 0 ] || [ "$rc" = n/a ] || tail -n 25 "$out/$log"
  [ "$rc" = 0 ] || [ "$rc" = n/a ]
}

# dry_step LOG LIMIT CMD...: a dry run's step: prints CMD (to stdout and LOG)
# and spends the running stage's expected seconds, at most LIMIT; 124 (as
# timeout's) when LIMIT ends it first.
dry_step() {
  local log=$1 limit=$2 took a line
  shift 2
  line="dry run (limit ${limit}s):"
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./=:,+@-]*$ ]]; then line+=" $a"; else line+=" ${a@Q}"; fi
  done
  echo "$line" | tee "$log"
  took=$((dry_left < limit ? dry_left : limit))
  dry_left=$((dry_left - took))
  dry_clock=$((dry_clock + took))
  ((dry_left == 0)) || return 124
}

start_packer
if ((dry)); then
  printf '%s\ndry run (GPU_CHECK_DRY_RUN=1): nothing ran\nstages: %s; deadline %ss\n' "$(date -u +%FT%TZ)" \
    "${stages[*]}" "$deadline" >"$out/env.txt"
  dry_clock=${stage_seconds[start]}
else
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>&1
  "$py" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
            'available', torch.cuda.is_available())" 2>&1
  nproc; free -g | head -2; df -hT "$repo" /tmp 2>&1; uname -r
  echo "commit: $(git -C "$repo" describe --always --dirty 2>/dev/null || echo unknown)"
  echo "stages: ${stages[*]}; deadline ${deadline}s"
} >"$out/env.txt" 2>&1
fi
cat "$out/env.txt"
pack

export EBBTIDE_LIBURING_ROOT=$repo/.deps/root
# With GPU_CHECK_INSTALLED=1 the build folder stays off the path: a stale
# build's modules there would shadow the installed ones.
if [ "${GPU_CHECK_INSTALLED:-0}" = 1 ]; then
  export PYTHONPATH=$repo/python${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$repo/python:$build/python${PYTHONPATH:+:$PYTHONPATH}
fi
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$repo/.deps/root/usr/lib/x86_64-linux-gnu
export PYTHONUNBUFFERED=1
# Wheels from scripts/device_deps.sh (nanobind, torchtune, megatron-core; the
# last has one extension module, for the machine's Python 3.12): each
# is unpacked (the zipfile module; the machine's Python may lack pip), without
# its dependencies, into a scratch folder on PYTHONPATH. That puts it ahead of
# site-packages, so the build's `python -m nanobind` finds the carried nanobind,
# not the machine's own. torchtune's package import then fails (no torchao):
# ebbtide.harness.methods.load_torchtune_offload loads its OffloadActivations by file
# (test_torchtune_offload_loading.py checks that path).
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
if ((dry)); then
  :
elif ! compgen -G "$repo/.deps/wheels/*.whl" >/dev/null; then
  say "no .deps/wheels: the build uses the machine's nanobind, and the torchtune row will say it was skipped" \
    "(run scripts/device_deps.sh here)"
elif unpack_wheels >"$out/wheels.log" 2>&1; then
  export PYTHONPATH=$PYTHONPATH:$wheels
else
  say "WARNING: unpacking .deps/wheels failed (see wheels.log); the build uses the machine's nanobind"
fi

# The module the tests and benchmarks import must be the one just built:
# checked once after a build (each check imports torch: 6 s), or, with
# GPU_CHECK_INSTALLED=1, the installed one.
fresh=
module_is_fresh() {
  [ -n "$fresh" ] && return 0
  local want="f.startswith('$build/') and t.__file__.startswith('$build/')"
  [ "${GPU_CHECK_INSTALLED:-0}" = 1 ] && want=True
  step import import.log 60 "$py" -c "import torch, ebbtide._core as c, ebbtide._torch as t, sys; f = c.__file__; print(f, t.__file__)
print('cuda driver', c.cuda_driver_available(), c.cuda_unavailable_reason())
sys.exit(0 if $want else 'ebbtide._core or ebbtide._torch is not the module built in $build')" && fresh=1
}

# Where the benchmark stages run: the GPU, or (no GPU, or GPU_CHECK_SMALL=1)
# at a small size, which checks the stages and their traces, not a GPU.
bench_dev=
small=()
small_methods=
budget_small=()
# torch_device: cuda where torch sees a GPU (a dry run stands for a GPU machine), else cpu.
torch_device() {
  if ((dry)); then echo cuda; return; fi
  "$py" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")' 2>/dev/null || echo cpu
}
bench_setup() {
  [ -n "$bench_dev" ] && return
  bench_dev=$(torch_device)
  if [ "$bench_dev" = cpu ] || [ "${GPU_CHECK_SMALL:-0}" = 1 ]; then
    say "benchmark stages at a small size on $bench_dev: they check this script, not a GPU"
    small=(--layers 2 --hidden 64 --heads 2 --seq 64 --batch 2 --link-bytes 1048576 --steps 1 --warmup 1)
    # ebbtide-auto: the CPU's one planned method (a run in the trace)
    small_methods=none,ebbtide-ssd,ebbtide-cpu,ebbtide-auto
    budget_small=(--layers 2 --hidden 64 --heads 2 --kv-heads 1 --ffn-hidden 128 --vocab 256 --seq 64 --batch 2
                  --points 3 --steps 1 --warmup 2)
  fi
}

configure() {
  [ -d "$repo/.deps/root/usr/include" ] || say "WARNING: no .deps (run scripts/device_deps.sh here and carry .deps)"
  # The lent machine's CXX is /opt/gcc's g++ 13, and nanobind links the
  # module with -static-libstdc++: that module crashed (SIGSEGV) whenever
  # one of its own threads formatted a number into a std::ostringstream
  # (2026-11-23, H100; the system g++ build passed the same tests). So
  # the system compiler builds here when there is one.
  local compilers=()
  [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ] &&
    compilers=(-DCMAKE_CXX_COMPILER=/usr/bin/g++ -DCMAKE_C_COMPILER=/usr/bin/gcc)
  step configure configure.log 120 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${compilers[@]}" \
    -DEBBTIDE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v "$py")" \
    -DCMAKE_PREFIX_PATH="$repo/.deps/root/usr"
  local rc=$?
  [ "$rc" = 0 ] && configured=1  # a dry run writes no build.ninja: the ctest stage asks this too
  grep -E "liburing found|cuda.h|CUDA shim|GTest|ebbtide: nanobind|ebbtide._torch" "$out/configure.log"
  return $rc
}

# Where torch sees a GPU, the CUDA tests must run: the shim built, the driver
# loaded. Exit 10 (n/a) on a machine with no GPU at all.
cuda_preflight() {
  step cuda-preflight cuda-preflight.log 120 "$py" -c "
import shutil, subprocess, sys, torch
from ebbtide import _core
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
smi = 0
if shutil.which('nvidia-smi'):
    smi = len([l for l in subprocess.run(['nvidia-smi', '-L'], capture_output=True, text=True).stdout.splitlines()
               if l.startswith('GPU ')])
print('torch sees', gpus, 'GPU(s); nvidia-smi lists', smi, '; build_info', dict(_core.build_info))
print('cuda driver shim:', _core.cuda_driver_available(), _core.cuda_unavailable_reason())
bad = []
if not _core.build_info.get('cuda_shim'):
    bad.append('this build has no CUDA shim (EBBTIDE_WITH_CUDA_SHIM off or cuda.h not found)')
if gpus and not _core.cuda_driver_available():
    bad.append(f'torch sees {gpus} GPU(s) but ebbtide._core.cuda_driver_available() is False: '
               + _core.cuda_unavailable_reason())
if smi and not gpus:
    bad.append(f'nvidia-smi lists {smi} GPU(s) but torch sees none (a CPU-only torch?)')
for b in bad:
    print('FAIL:', b)
if bad:
    sys.exit(1)
if not gpus:
    print('no GPU on this machine: the CUDA tests skip here, which proves nothing about the GPU path')
    sys.exit(10)
"
}

# skip_check XML: reads pytest's JUnit XML. On a GPU machine every skipped
# test is a failure, except "needs two GPUs" where there is one GPU; no test
# at all is a failure too. Exit 10 (n/a) on a machine without a GPU.
skip_check() {
  local xml=$1
  step "skips:${xml%.xml}" "skips-${xml%.xml}.log" 60 "$py" -c "
import sys, xml.etree.ElementTree as ET, torch
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
try:
    cases = list(ET.parse('$out/$xml').getroot().iter('testcase'))
except (OSError, ET.ParseError) as e:
    sys.exit(f'no JUnit XML from pytest ({e})')
skipped, allowed = [], []
for c in cases:
    for s in c.findall('skipped'):
        what = f\"{c.get('classname')}::{c.get('name')}: {s.get('message', '')}\"
        (allowed if 'needs two GPUs' in s.get('message', '') and gpus < 2 else skipped).append(what)
print(f'{len(cases)} tests, {len(skipped) + len(allowed)} skipped ({len(allowed)} for want of a second GPU)')
for a in allowed:
    print('  allowed skip:', a)
for s in skipped:
    print('  SKIPPED:', s)
if not gpus:
    print(f'no GPU: {len(skipped)} CUDA tests skipped, as they must here; not a GPU run')
    sys.exit(10)
if not cases:
    sys.exit('no test ran')
if skipped:
    sys.exit(f'{len(skipped)} CUDA tests skipped on a GPU machine: the GPU path is not proven')
"
}

for stage in "${stages[@]}"; do
  if [[ " $all_stages " != *" $stage "* ]]; then
    say "unknown stage '$stage' (valid: $all_stages)"
    record "$stage" "?" 0 "-" "unknown stage"
    continue
  fi
  if (($(left) < 20)); then
    deadline_hit=1
    record "$stage" "-" 0 "-" "stage not run: GPU_CHECK_DEADLINE=${deadline}s reached"
    continue
  fi
  if [ "$stage" != build ] && [ "$stage" != build_py ] && ! module_is_fresh; then
    say "skipping stage $stage: no freshly built ebbtide._core"
    record "$stage" "-" 0 "-" "stage not run: no freshly built ebbtide._core and ebbtide._torch"
    continue
  fi
  dry_left=${stage_seconds[$stage]:-0}
  case $stage in
    build)
      fresh=
      configure && step build build.log 400 cmake --build "$build" -j"$jobs"
      ;;
    build_py)
      fresh=
      configure && step build_py build_py.log 400 cmake --build "$build" -j"$jobs" --target _core _torch
      ;;
    ctest)
      { [ -f "$build/build.ninja" ] || [ "${configured:-0}" = 1 ] || configure; } &&
        step build-tests build-tests.log 300 cmake --build "$build" -j"$jobs" &&
        step ctest ctest.log 300 ctest --test-dir "$build" --no-tests=error --output-on-failure -j8
      grep -E "tests passed|tests failed|Skipped|Failed|\*\*\*" "$out/ctest.log" 2>/dev/null | tail -n 20
      ;;
    test | test_cache)
      cuda_preflight
      files=(python/tests/test_cache_cuda.py python/tests/test_cache_cuda_findings.py)
      if [ "$stage" = test ]; then
        files+=(python/tests/test_checkpoint_gpu.py python/tests/test_torchtune_offload_loading.py)
        if [ -x "$build/cpp/ebbtide_tests" ]; then
          step ctest ctest.log 300 ctest --test-dir "$build" --no-tests=error --output-on-failure -j8
          grep -E "tests passed|tests failed|Skipped|Failed|\*\*\*" "$out/ctest.log" | tail -n 20
        else
          record ctest "-" 0 "-" "not run: no C++ tests in $build; build_py builds only the modules, build builds them"
        fi
      fi
      k=${TEST_K:-$test_deselect}
      if [ "$stage" = test ]; then xml=pytest-cuda.xml; else xml=pytest-cache-cuda.xml; fi
      step "${xml%.xml}" "${xml%.xml}.log" 300 "$py" -m pytest -q -p no:cacheprovider -rs --junitxml="$out/$xml" \
        ${k:+-k "$k"} "${files[@]}"
      tail -n 3 "$out/${xml%.xml}.log"
      skip_check "$xml"
      # Checkpoints with device tensors: safetensors (device= and into=) and the DCP plugin.
      [ -n "${TEST_K:-}" ] || [ "$stage" = test_cache ] && continue
      step pytest-ckpt-cuda pytest-ckpt-cuda.log 200 "$py" -m pytest -q -p no:cacheprovider -rs -k cuda \
        --junitxml="$out/pytest-ckpt-cuda.xml" python/tests/test_safetensors.py python/tests/test_dcp.py
      tail -n 3 "$out/pytest-ckpt-cuda.log"
      skip_check pytest-ckpt-cuda.xml
      ;;
    sanitize)
      cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
      if [ -z "$cs" ]; then
        say "compute-sanitizer is not on PATH nor in /usr/local/cuda*/bin: the sanitize stage runs nothing here"
        record sanitize n/a 0 "-" "compute-sanitizer not found on this machine: nothing run"
      else
        # Timing tests (the host must not wait; NCCL's save returns first)
        # measure the device against the host, which the sanitizer slows
        # unevenly: left out by default.
        k=${SANITIZE_K:-not does_not_wait and not under_nccl}
        for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
          step "sanitize-$tool" "sanitize-$tool.log" 280 "$cs" --tool "$tool" --target-processes all --error-exitcode 9 \
            "$py" -m pytest -q -p no:cacheprovider -rs -k "$k" python/tests/test_cache_cuda.py python/tests/test_cache_cuda_findings.py python/tests/test_checkpoint_gpu.py
          grep -E "ERROR SUMMARY|========= (Invalid|Race|Error)|passed|failed" "$out/sanitize-$tool.log" | tail -n 8
        done
      fi
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
      bench_setup
      methods=${OFFLOAD_METHODS:-${preset_methods[$stage]:-$small_methods}}
      grad=${preset_grad[$stage]:-}
      mkdir -p /tmp/ebbtide-bench
      step "offload_$stage" "offload_$stage.txt" "$limit" "$py" bench/offload_bench.py --device "$bench_dev" "${args[@]}" \
        --steps "${OFFLOAD_STEPS:-$steps}" --warmup 2 "${small[@]}" ${methods:+--methods "$methods"} \
        ${grad:+--grad-check "$grad"} --path /tmp/ebbtide-bench --json "$out/offload_$stage.json" \
        --trace "$out/trace_$stage.json"
      tail -n 30 "$out/offload_$stage.txt"
      ;;
    budget | budget_compiled | budget_a | budget_b)
      case $stage in
        budget) strategies=${BUDGET_STRATEGIES:-keep,recompute,offload,torchtune,budget,memory,ssd} limit=480 ;;
        budget_compiled) strategies=${BUDGET_STRATEGIES:-keep,recompute,compiler,budget,memory} limit=480 ;;
        budget_a) strategies=keep,recompute,torchtune,budget limit=240 ;;
        budget_b) strategies=keep,compiler,budget limit=360 ;;
      esac
      bench_setup
      # The bench stops its rounds 45 s before the step is killed (the
      # table, the JSON and tearing down a dozen models on the GPU need less).
      room=$(($(left) - 10))
      ((limit > room)) && limit=$room
      mkdir -p /tmp/ebbtide-bench
      step "$stage" "$stage.txt" "$limit" "$py" -u bench/budget_bench.py --device "$bench_dev" --shape a --fractions 0.5,0.25 \
        --steps "${BUDGET_STEPS:-4}" --warmup 2 "${budget_small[@]}" --path /tmp/ebbtide-bench --strategies "$strategies" \
        --target "${BUDGET_TARGET:-auto}" $([ "$stage" = budget_compiled ] && echo --compile block) \
        --time-limit $((limit > 90 ? limit - 45 : limit / 2)) ${BUDGET_STRATEGY_LIMIT:+--strategy-limit "$BUDGET_STRATEGY_LIMIT"} \
        --json "$out/$stage.json" --trace "$out/trace_$stage.json"
      tail -n 30 "$out/$stage.txt"
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
      dev=$(torch_device)
      step ckpt_loads ckpt_loads.txt 60 "$py" bench/ckpt_bench.py --device-loads --device "$dev" \
        --size "${CKPT_SIZE:-1.0}" --repeat 2 --dir /tmp/ebbtide-ckpt --json "$out/ckpt_loads.json"
      tail -n 9 "$out/ckpt_loads.txt"
      step ckpt_async ckpt_async.txt 120 "$py" bench/ckpt_first_save.py --mode async --device "$dev" \
        --size "${CKPT_SIZE:-1.0}" --saves 4 --dir /tmp/ebbtide-ckpt/async --json "$out/ckpt_async.json"
      tail -n 9 "$out/ckpt_async.txt"
      step ckpt_async_ab ckpt_async_ab.txt 60 "$py" bench/ckpt_first_save.py --mode async-ab --device "$dev" \
        --size "${CKPT_SIZE:-1.0}" --saves 8 --dir /tmp/ebbtide-ckpt/ab --json "$out/ckpt_async_ab.json"
      tail -n 5 "$out/ckpt_async_ab.txt"
      ;;
    dist)
      step dist_offload dist_offload.txt 300 "$py" -m torch.distributed.run --standalone --nproc_per_node 1 \
        bench/dist_offload.py --device cuda --dtype bf16 --hidden 2048 --heads 16 --seq 1024 --batch 4 \
        --json "$out/dist_offload.json"
      tail -n 20 "$out/dist_offload.txt"
      ;;
    megatron)
      step megatron megatron.txt 150 "$py" bench/megatron_offload.py --device cuda --json "$out/megatron.json"
      tail -n 12 "$out/megatron.txt"
      ;;
  esac
done

((deadline_hit)) && say "GPU_CHECK_DEADLINE=${deadline}s reached: what was cut is marked in the summary"
say "summary (logs in $out; $(now) s)"
printf '  %s\n' "${summary[@]}" | tee "$out/summary.txt"
stop_packer
pack
! printf '%s\n' "${summary[@]}" | grep -Eqv "rc=(0|n/a) "
