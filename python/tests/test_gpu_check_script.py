"""scripts/gpu_check.sh on a machine without a GPU (the GPU stages are run
by a later session with a device; this checks the script's wiring).

Dry runs (GPU_CHECK_DRY_RUN=1, about 7 s in all) check the stage list, the
issue40 preset's stages and settings and its deadline arithmetic on the
script's own clock, and that the preset's expected times agree in the
script's header, its table and docs/benchmarks.md. The end-to-end test (about
a minute on the 2-core VM: two benchmark processes and a replay) runs the
benchmark stages on the CPU at a small size; they pack their JSON and step
traces into gpu_check.tgz, which scripts/unpack_gpu_check.py turns into a
run folder that `ebbtide plan --replay` reads, as test_replay.py does for
every folder in bench/gpu-runs. No timing is asserted."""
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(REPO / "scripts"))
import unpack_gpu_check  # noqa: E402

PRESET = ["build_py", "shape_a", "budget", "shape_b", "test_cache", "budget_compiled", "shape_a_compiled", "ctest",
          "megatron", "ckpt"]
GRACE = 10  # gpu_check.sh's step: `timeout -k 10`, kept inside the deadline


def dry_run(tmp_path, *stages, **env):
    """gpu_check.sh STAGES with GPU_CHECK_DRY_RUN=1: (exit code, stdout,
    summary lines as (name, rc, seconds, note))."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir(exist_ok=True)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK_", "OFFLOAD_", "BUDGET_", "TEST_K"))}
    e.update(OUT=str(out), GPU_CHECK_SCRATCH=str(scratch), GPU_CHECK_DRY_RUN="1", PYTHON=sys.executable, **env)
    p = subprocess.run(["bash", str(SCRIPT), *stages], capture_output=True, text=True, timeout=60, env=e, cwd=REPO)
    assert p.returncode != 2, p.stderr
    summary = []
    for line in (scratch / "summary.txt").read_text().splitlines():
        m = re.match(r"\s*(\S+)\s+rc=(\S+)\s+(\d+)s\s+\S+(?:\s+\((.*)\))?$", line)
        assert m, line
        summary.append((m.group(1), m.group(2), int(m.group(3)), m.group(4) or ""))
    return p.returncode, p.stdout, summary


def script_table():
    """gpu_check.sh's stage_seconds, and the lists of its stages."""
    text = SCRIPT.read_text()
    table = re.search(r"declare -A stage_seconds=\(([^)]*)\)", text).group(1)
    seconds = {k: int(v) for k, v in re.findall(r"\[(\w+)\]=(\d+)", table)}
    all_stages = re.search(r'^all_stages="([^"]*)"', text, re.M).group(1).split()
    return text, seconds, all_stages


def commands(stdout, needle):
    """The dry run's command lines holding `needle`, as (limit, command)."""
    return [(int(m.group(1)), m.group(2)) for m in re.finditer(r"^dry run \(limit (\d+)s\): (.*)$", stdout, re.M)
            if needle in m.group(2)]


def test_preset_times_agree_in_the_script_and_the_docs():
    text, seconds, _ = script_table()
    assert set(seconds) == {"start", *PRESET} - {"ckpt"}
    # the header's table: "#   shape_a           55 s  (...)"
    header = {k: int(v) for k, v in re.findall(r"^#   (\(start\)|\w+)\s+(\d+) s\b", text, re.M)}
    assert {k.strip("()"): v for k, v in header.items()} == seconds
    assert re.search(r"expanded\+=\(" + " ".join(PRESET) + r"\)", text)
    docs = (REPO / "docs" / "benchmarks.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| [^|]+ \| ([^|]+) \|$", docs, re.M)
    assert [(int(n), s) for n, s, _ in rows] == list(enumerate(PRESET, 1))
    assert {s: int(t.split()[0]) for _, s, t in rows if s != "ckpt"} == {k: v for k, v in seconds.items()
                                                                          if k != "start"}


def test_dry_run_of_the_issue40_preset_fits_the_deadline(tmp_path):
    """The preset on the script's own clock, each stage taking its expected
    seconds: what runs, what the deadline cuts, the limits it gives."""
    _, seconds, _ = script_table()
    rc, stdout, summary = dry_run(tmp_path, "issue40")
    names = [s[0] for s in summary]
    assert names == ["configure", "build_py", "import", "offload_shape_a", "budget", "offload_shape_b",
                     "cuda-preflight", "pytest-cache-cuda", "skips:pytest-cache-cuda", "budget_compiled",
                     "offload_shape_a_compiled", "build-tests", "ctest", "megatron", "ckpt"], summary
    deadline = 540
    clock = seconds["start"] + sum(seconds[s] for s in PRESET[:8])  # through ctest
    assert clock <= deadline - GRACE
    assert all(r == "0" for _, r, _, _ in summary[:13]), summary
    # megatron gets what is left and is killed at the deadline; ckpt does not start
    assert summary[13] == ("megatron", "124", deadline - GRACE - clock, f"killed at GPU_CHECK_DEADLINE={deadline}s")
    assert summary[14][1] == "-" and "stage not run" in summary[14][3]
    assert rc != 0 and f"summary (logs in {tmp_path / 'scratch'}; {deadline - GRACE} s)" in stdout
    # The budget stage's limit: what is left less the grace; the bench's --time-limit 45 s less.
    t = seconds["start"] + seconds["build_py"] + seconds["shape_a"]
    limit = min(480, deadline - t - GRACE)
    [(got, cmd)] = set(commands(stdout, "--strategies keep,recompute,offload,torchtune,budget,memory,ssd"))
    assert got == limit and f"--time-limit {limit - 45} " in cmd, cmd
    assert "bench/budget_bench.py --device cuda --shape a --fractions 0.5,0.25 --steps 4" in cmd
    assert "--target auto" in cmd
    assert "--trace" in cmd and "--compile" not in cmd
    # The preset's settings.
    [(_, a)] = set(commands(stdout, "--shape a --steps"))
    assert "--methods none,ebbtide-cpu,ebbtide-auto,torchtune" in a and "--grad-check" not in a
    [(_, b)] = set(commands(stdout, "--shape b"))
    assert "--methods none,ebbtide-cpu,ebbtide-auto " in b
    [(_, c)] = set(commands(stdout, "--compile block --steps"))
    assert "--methods none,ebbtide-auto,compiler-offload" in c and "--grad-check off" in c
    [(_, k)] = set(commands(stdout, "-m pytest"))
    assert "-k 'not expandable_segments'" in k and "test_checkpoint_gpu" not in k
    # A shorter deadline cuts sooner: test_cache's first step is killed, nothing after it starts.
    _, _, summary = dry_run(tmp_path, "issue40", GPU_CHECK_DEADLINE="300")
    cut = [s for s in summary if s[1] != "0"]
    t = seconds["start"] + sum(seconds[s] for s in PRESET[:4])
    assert cut[0] == ("cuda-preflight", "124", 300 - GRACE - t, "killed at GPU_CHECK_DEADLINE=300s"), summary
    assert all(s[1] == "-" for s in cut[1:]) and [s[0] for s in cut[-5:]] == PRESET[-5:]


def test_dry_run_of_every_stage_and_a_caller_setting(tmp_path):
    """Each stage the script lists does something (a stage listed but not
    handled would record nothing but the import check); an unknown one is a
    summary line; a variable the caller sets wins over the preset's."""
    _, _, all_stages = script_table()
    for stage in all_stages:
        rc, _, summary = dry_run(tmp_path, stage, GPU_CHECK_DEADLINE="100000")
        assert [s for s in summary if s[0] != "import"], stage
        assert all("unknown stage" not in s[3] and "stage not run" not in s[3] for s in summary), (stage, summary)
    rc, _, summary = dry_run(tmp_path, "bogus")
    assert rc == 1 and summary == [("bogus", "?", 0, "unknown stage")]
    _, stdout, _ = dry_run(tmp_path, "issue40", OFFLOAD_METHODS="none,ebbtide-auto")
    assert all("--methods none,ebbtide-auto " in cmd for _, cmd in commands(stdout, "offload_bench.py"))
    p = subprocess.run(["bash", str(SCRIPT), "shape_a"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, GPU_CHECK_DRY_RUN="yes"))
    assert p.returncode == 2 and "GPU_CHECK_DRY_RUN=yes is not 0 or 1" in p.stderr


def test_gpu_check_stages_write_traces_that_replay(tmp_path):
    pytest.importorskip("transformers")
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU path of the script (a GPU machine runs it for real)")
    out = tmp_path / "out"
    out.mkdir()
    # The stages' methods narrowed to what runs here (the CUDA ones would be rows saying so).
    env = dict(os.environ, OUT=str(out), GPU_CHECK_SCRATCH=str(tmp_path / "scratch"), GPU_CHECK_INSTALLED="1",
               GPU_CHECK_DEADLINE="400", PYTHON=sys.executable, EBBTIDE_MAX_INFLIGHT="1",
               OFFLOAD_METHODS="none,ebbtide-cpu,ebbtide-auto", BUDGET_STRATEGIES="keep,recompute,budget,memory,ssd")
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "shape_a", "budget"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    summary = (tmp_path / "scratch" / "summary.txt").read_text()
    lines = {line.split()[0]: line for line in summary.splitlines()}
    assert "rc=0" in lines["import"], summary
    # 3: a target missed (a tiny model on a shared CPU); the run is complete either way.
    assert lines["offload_shape_a"].split()[1] in ("rc=0", "rc=3"), (summary, p.stdout[-3000:])
    assert lines["budget"].split()[1] in ("rc=0", "rc=3"), (summary, p.stdout[-3000:])
    assert "small size on cpu" in p.stdout

    runs = tmp_path / "runs"
    runs.mkdir()
    dest, left_out = unpack_gpu_check.unpack(str(out / "gpu_check.tgz"), str(runs))
    assert os.path.basename(dest).endswith("-cpu") and not left_out
    names = set(os.listdir(dest))
    assert {"env.txt", "summary.txt", "README.md", "offload_shape_a.json", "trace_shape_a.json", "budget.json",
            "trace_budget.json"} <= names, names
    r = subprocess.run([sys.executable, "-m", "ebbtide", "plan", "--replay", dest, "--json"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode in (0, 3), r.stderr  # 3: not within 5% at this size (the CPU's heap is no allocator)
    data = json.loads(r.stdout)
    sources = {os.path.basename(s["source"]): s for s in data["sources"]}
    assert set(sources) == {"trace_shape_a.json", "trace_budget.json"}, (sources, data["skipped"])
    assert {os.path.basename(s["file"]) for s in data["skipped"]} >= {"offload_shape_a.json", "budget.json"}
    # ebbtide-cpu is not planned on the CPU (the trace's left_out says so); ebbtide-auto is
    assert [x["name"] for x in sources["trace_shape_a.json"]["runs"]] == ["shape a none", "shape a ebbtide-auto"]
    budget = {x["name"]: x for x in sources["trace_budget.json"]["runs"]}
    assert budget["shape a keep"]["ran"]["measured"]["step_seconds"] > 0
    assert any(n.startswith("shape a memory") for n in budget) and budget["shape a ssd 0.5"]["apart"]


def test_unpack_names_the_folder_from_env_and_refuses_other_files(tmp_path):
    env = "2026-12-01T10:00:00Z\nname, memory.total [MiB]\nNVIDIA H200, 143771 MiB, 580.159.04, 5, 16\n"
    tgz = tmp_path / "gpu_check.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        for name, text in (("env.txt", env), ("summary.txt", "  build_py rc=0 45s\n"), ("trace_x.json", "{}"),
                           ("big.log", "x" * 100)):
            path = tmp_path / name
            path.write_text(text)
            tar.add(path, arcname=f"./{name}")
    runs = tmp_path / "runs"
    runs.mkdir()
    first, left = unpack_gpu_check.unpack(str(tgz), str(runs), max_bytes=99)
    second, _ = unpack_gpu_check.unpack(str(tgz), str(runs), max_bytes=99)
    assert os.path.basename(first) == "2026-12-01-h200" and os.path.basename(second) == "2026-12-01-h200-2"
    assert left == [("big.log", "100 bytes > 99")]
    assert sorted(os.listdir(first)) == ["README.md", "env.txt", "summary.txt", "trace_x.json"]
    assert "build_py rc=0" in (Path(first) / "README.md").read_text()
    (tmp_path / "bad.tgz").write_text("not a tar")
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "unpack_gpu_check.py"), str(tmp_path / "bad.tgz"),
                        "--runs-dir", str(runs)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not a gzipped tar archive" in r.stderr
