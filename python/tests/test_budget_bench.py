"""A small run of bench/budget_bench.py is a test: both sweeps run end to
end, every row is bitwise, the rows are complete, and the plot is written.
Speed targets are the bench's to print (docs/benchmarks.md), not asserted."""
import json
import os
import subprocess
import sys

import pytest
import torch

BENCH_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


def test_budget_bench_small(tmp_path, run_bench):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    png = tmp_path / "rok.png"
    p, r = run_bench("budget_bench.py", "--layers", "2", "--hidden", "64", "--heads", "2", "--kv-heads", "1",
                     "--ffn-hidden", "128", "--vocab", "256", "--seq", "64", "--batch", "2", "--points", "3",
                     "--steps", "1", "--warmup", "2", "--path", str(tmp_path), "--png", str(png),
                     # The cap given: the default (a quarter of what the uncapped
                     # offload needs) follows one noisy step; 1.3 MB/s once made
                     # the capped sweep's steps 20 s each at this size.
                     "--cap", "50")
    assert png.stat().st_size > 0
    assert len(r["sweeps"]) == 2 and r["sweeps"][0]["max_write_mbps"] is None and r["sweeps"][1]["max_write_mbps"] > 0
    for sweep in r["sweeps"]:
        rows = sweep["rows"]
        assert [x["strategy"] for x in rows[:3]] == ["keep", "offload", "recompute"]
        budgets = [x for x in rows if x["strategy"] == "budget"]
        assert len(budgets) == 3
        assert budgets[0]["budget_bytes"] == sweep["smallest_budget"] < budgets[-1]["budget_bytes"] == sweep["keep_peak"]
        assert sweep["targets"]["bitwise"], [(x["strategy"], x["max_grad_diff"]) for x in rows]
        assert all(x["within_budget"] for x in budgets), [(x["budget_bytes"], x["peak_bytes"]) for x in budgets]
        assert rows[2]["blocks_recomputed"] == 2 and rows[1]["bytes_offloaded"] > 0
    assert "targets:" in p.stdout and "load average" in p.stdout


def test_gpu_stage_runs_on_cpu_with_what_it_can(tmp_path):
    """The GPU stage's harness (run_fractions) on CPU: budgets at fractions of
    the keep-all peak, recompute beside them, a peer that cannot run here (torchtune
    needs CUDA) a row with its error, not a failed stage."""
    pytest.importorskip("transformers")
    from ebbtide.harness import budget_stage

    spec = dict(layers=2, hidden=64, heads=2, kv_heads=1, ffn_hidden=128, vocab=256, seq=64, batch=2)
    r = budget_stage.run_fractions(spec, fractions=(0.9, 0.6), strategies=("keep", "recompute", "budget", "torchtune"),
                                   steps=1, warmup=2, device="cpu", dtype=torch.float32, path=str(tmp_path),
                                   log=lambda _: None)
    rows = {(x["strategy"], x["fraction"]) for x in r["rows"]}
    assert {("keep", None), ("recompute", None), ("budget", 0.9), ("budget", 0.6)} <= rows
    assert all(x["max_grad_diff"] == 0.0 for x in r["rows"])
    if not torch.cuda.is_available():
        assert [f["strategy"] for f in r["failed"]] == ["torchtune"]
    text = budget_stage.format_fractions(r)
    assert "target (faster than each peer" in text


_TINY = dict(layers=2, hidden=64, heads=2, kv_heads=1, ffn_hidden=128, vocab=256, seq=64, batch=2)


def test_gpu_stage_builds_the_model_once(tmp_path, monkeypatch):
    """Each strategy gets a copy of one model built on the device: shape a's
    host-side init took a minute a model, seven of them the whole device call."""
    pytest.importorskip("transformers")
    from ebbtide.harness import budget_stage, budget_sweep

    built = []
    real = budget_sweep.build_llama
    monkeypatch.setattr(budget_sweep, "build_llama", lambda **kw: built.append(kw) or real(**kw))
    r = budget_stage.run_fractions(_TINY, fractions=(0.9, 0.6), strategies=("keep", "recompute", "budget"),
                                   steps=1, warmup=2, device="cpu", dtype=torch.float32, path=str(tmp_path),
                                   log=lambda _: None)
    assert len(built) == 1
    assert [(x["strategy"], x["fraction"]) for x in r["rows"]] == [("keep", None), ("recompute", None),
                                                                   ("budget", 0.9), ("budget", 0.6)]
    assert all(x["max_grad_diff"] == 0.0 and x["timed_steps"] == 1 for x in r["rows"])


def test_gpu_stage_cuts_what_the_limits_leave_no_time_for(tmp_path):
    """A strategy over --strategy-limit, or without a timed step at the time
    limit, is a row marked cut; the table still comes out."""
    pytest.importorskip("transformers")
    from ebbtide.harness import budget_stage

    kw = dict(fractions=(0.9,), strategies=("keep", "recompute", "budget"), steps=2, warmup=2, device="cpu",
              dtype=torch.float32, path=str(tmp_path), log=lambda _: None)
    r = budget_stage.run_fractions(_TINY, strategy_limit=0.0, **kw)
    assert [x["strategy"] for x in r["rows"]] == ["keep"] and r["rows"][0]["timed_steps"] == 2
    # recompute ran its two warm-up steps before the rounds (its peak sets the allocator budgets): its
    # third step, in the first timed round, is the one past the limit
    assert [(f["strategy"], f["cut"]) for f in r["failed"]] == [("budget", True), ("recompute", True)]
    assert [f["error"].split(" took")[0] for f in r["failed"]] == ["cut: 1 steps", "cut: 3 steps"]
    r = budget_stage.run_fractions(_TINY, time_limit=0.0, **kw)
    assert r["rows"] == [] and not r["target_met"]
    assert [(f["strategy"], f["cut"]) for f in r["failed"]] == [("keep", True), ("recompute", True), ("budget", True)]
    assert "keep        cut: no timed step" in budget_stage.format_fractions(r)


def test_compiler_peer_compiles_once_per_fraction(monkeypatch):
    """torch's activation_memory_budget peer: each fraction's blocks compile
    under that fraction. With one backend for all, dynamo's cache handed the
    second fraction the first one's graph (compiled at the first's budget)."""
    pytest.importorskip("transformers")
    import torch._functorch.config as fc
    import torch._inductor.compile_fx as cfx

    from ebbtide.harness import budget_sweep

    budgets = []

    def eager(gm, example_inputs, **_):  # stands in for inductor: records the budget it compiles under
        budgets.append(fc.activation_memory_budget)
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", eager)
    torch._dynamo.reset()
    try:
        runners = [budget_sweep.Runner("compiler", _TINY, fraction=f) for f in (0.5, 0.25)]
        for _ in range(2):
            for r in runners:
                r.step(timed=True)
    finally:
        torch._dynamo.reset()
    assert budgets == [0.5, 0.25]


def test_gpu_stage_sweeps_the_allocator_and_writes_a_trace(tmp_path, stores_before_backward):
    """budget_bench.py's GPU stage on the CPU, every strategy that runs here
    but the compiled one (torch.compile takes a minute on two cores; the
    compiled stage is the same code with --compile block): ebbtide at
    fractions of keep's saved activations and at allocator budgets from
    keep's allocator peak down to full recompute's, SSD rows apart; the
    step trace it writes replays, each planned row's run predicting what its
    cache's plan predicted. No timing is asserted."""
    pytest.importorskip("transformers")
    from ebbtide.harness import gpu_runs
    from ebbtide.plan import planner, replay

    trace, out = tmp_path / "trace_budget.json", tmp_path / "budget.json"
    p = subprocess.run([sys.executable, os.path.join(BENCH_DIR, "budget_bench.py"), "--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "2",
                        "--kv-heads", "1", "--ffn-hidden", "128", "--vocab", "256", "--seq", "64", "--batch", "2",
                        "--fractions", "0.9,0.5", "--points", "3", "--steps", "1", "--warmup", "2",
                        "--strategies", "keep,recompute,offload,budget,memory,ssd", "--path", str(tmp_path),
                        "--watchdog", "0", "--trace", str(trace), "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 3), p.stderr  # 3: a target missed (a tiny model on a loaded CPU)
    r = json.loads(out.read_text())
    assert r["target"] == "auto" and r["trace"] == trace.name
    rows = {(x["strategy"], x["fraction"], x.get("memory_budget_bytes")): x for x in r["rows"]}
    assert r["memory_budgets"][0] == r["keep_allocated_peak"] and r["memory_budgets"][-1] == r["recompute_allocated_peak"]
    assert len(r["memory_budgets"]) == 3 and len(r["sweep"]) == 3
    ran_memory = [x for x in r["rows"] if x["strategy"] == "memory"]
    refused = [f for f in r["failed"] if f["strategy"] == "memory"]
    assert len(ran_memory) + len(refused) == 3 and all(f.get("refused") for f in refused), r["failed"]
    for x in ran_memory:
        assert x["target"] == "auto" and x["memory_budget_bytes"] in r["memory_budgets"]
        assert x["budget_bytes"] is None and x["allocated_peak_bytes"] > 0
    for f in (0.9, 0.5):
        assert rows[("budget", f, None)]["target"] == "auto" and not rows[("budget", f, None)].get("apart")
        assert rows[("ssd", f, None)]["target"] == "ssd" and rows[("ssd", f, None)]["apart"]
    assert all(x["max_grad_diff"] == 0.0 for x in r["rows"]), [(x["strategy"], x["max_grad_diff"]) for x in r["rows"]]

    loaded = gpu_runs.load(str(trace))
    assert loaded["format"] == "trace"
    runs = {run["name"]: run for run in loaded["runs"]}
    names = list(runs)
    assert names[0] == "llama h=64 keep" and names[-1] == "llama h=64 recompute", names
    assert all(p == "keep" for p in runs[names[0]]["ran"]["placements"])
    planned = [x for x in r["rows"] if x["strategy"] in ("budget", "ssd", "memory")]
    assert len(runs) == len(planned) + 2
    out = replay.replay(loaded["runs"], str(trace))
    by = {x["name"]: x for x in out["runs"]}
    for x in planned:
        label = f"{x['strategy']} {x['memory_budget_bytes'] / 1e9:.3g} GB" if x["strategy"] == "memory" else \
            f"{x['strategy']} {x['fraction']:g}"
        run, res = runs[f"llama h=64 {label}"], by[f"llama h=64 {label}"]
        assert run["kind"] == "budget" and bool(run.get("apart")) == (x["strategy"] == "ssd")
        m = run["measured"]
        assert m["step_seconds"] == x["step_seconds"] and m["peak_bytes"] == x["allocated_peak_bytes"]
        assert m["none_peak_bytes"] == r["keep_allocated_peak"] or m["none_peak_bytes"] == rows[("keep", None, None)][
            "allocated_peak_bytes"]
        assert [b["name"] for b in m["block_levels"]] == ["model.layers.0", "model.layers.1"]
        assert len(m["blocks_off"]) == 2 and all(b["forward_seconds"] > 0 for b in m["blocks_off"])
        assert "stall_seconds" in m and "heap" in m["peak_source"]
        # The replay plays the decisions the cache ran with: its plan's own
        # prediction (the first planned step re-times the profile and plans
        # from it again: Note [Re-timed profile]).
        assert [planner.ran_placement(m) for m in res["ran"]["plan"]] == run["ran"]["placements"]
        assert res["ran"]["predicted"]["step_seconds"] == pytest.approx(x["predicted_step_seconds"], rel=1e-6)
        assert res["ran"]["predicted"]["peak_saved_bytes"] == x["predicted_peak_bytes"]
        assert "best" in res
    assert by["llama h=64 recompute"]["apart"] and not by["llama h=64 keep"]["apart"]
