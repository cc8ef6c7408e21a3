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
