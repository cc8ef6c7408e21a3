"""A small run of bench/budget_bench.py is a test: both sweeps run end to
end, every row is bitwise, the rows are complete, and the plot is written.
Speed targets are the bench's to print (docs/benchmarks.md), not asserted."""
import pytest
import torch


def test_budget_bench_small(tmp_path, run_bench):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    png = tmp_path / "rok.png"
    p, r = run_bench("budget_bench.py", "--layers", "2", "--hidden", "64", "--heads", "2", "--kv-heads", "1",
                     "--ffn-hidden", "128", "--vocab", "256", "--seq", "64", "--batch", "2", "--points", "3",
                     "--steps", "1", "--warmup", "2", "--path", str(tmp_path), "--png", str(png))
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
    from ebbtide.harness import budget_sweep

    spec = dict(layers=2, hidden=64, heads=2, kv_heads=1, ffn_hidden=128, vocab=256, seq=64, batch=2)
    r = budget_sweep.run_fractions(spec, fractions=(0.9, 0.6), strategies=("keep", "recompute", "budget", "torchtune"),
                                   steps=1, warmup=2, device="cpu", dtype=torch.float32, path=str(tmp_path),
                                   log=lambda _: None)
    rows = {(x["strategy"], x["fraction"]) for x in r["rows"]}
    assert {("keep", None), ("recompute", None), ("budget", 0.9), ("budget", 0.6)} <= rows
    assert all(x["max_grad_diff"] == 0.0 for x in r["rows"])
    if not torch.cuda.is_available():
        assert [f["strategy"] for f in r["failed"]] == ["torchtune"]
    text = budget_sweep.format_fractions(r)
    assert "target (faster than each peer" in text


_TINY = dict(layers=2, hidden=64, heads=2, kv_heads=1, ffn_hidden=128, vocab=256, seq=64, batch=2)


def test_gpu_stage_builds_the_model_once(tmp_path, monkeypatch):
    """Each strategy gets a copy of one model built on the device: shape a's
    host-side init took a minute a model, seven of them the whole device call."""
    pytest.importorskip("transformers")
    from ebbtide.harness import budget_sweep

    built = []
    real = budget_sweep.build_llama
    monkeypatch.setattr(budget_sweep, "build_llama", lambda **kw: built.append(kw) or real(**kw))
    r = budget_sweep.run_fractions(_TINY, fractions=(0.9, 0.6), strategies=("keep", "recompute", "budget"),
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
    from ebbtide.harness import budget_sweep

    kw = dict(fractions=(0.9,), strategies=("keep", "recompute", "budget"), steps=2, warmup=2, device="cpu",
              dtype=torch.float32, path=str(tmp_path), log=lambda _: None)
    r = budget_sweep.run_fractions(_TINY, strategy_limit=0.0, **kw)
    assert [x["strategy"] for x in r["rows"]] == ["keep"] and r["rows"][0]["timed_steps"] == 2
    assert [(f["strategy"], f["cut"]) for f in r["failed"]] == [("recompute", True), ("budget", True)]
    assert all(f["error"].startswith("cut: 1 steps took") for f in r["failed"])
    r = budget_sweep.run_fractions(_TINY, time_limit=0.0, **kw)
    assert r["rows"] == [] and not r["target_met"]
    assert [(f["strategy"], f["cut"]) for f in r["failed"]] == [("keep", True), ("recompute", True), ("budget", True)]
    assert "keep        cut: no timed step" in budget_sweep.format_fractions(r)


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
