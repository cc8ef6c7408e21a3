"""A small run of bench/planner_bench.py is a test: it runs end to end and its JSON is complete."""
import pytest


def test_planner_bench_small(tmp_path, run_bench):
    pytest.importorskip("transformers")
    p, r = run_bench("planner_bench.py", "--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "64",
                     "--batch", "2", "--steps", "1", "--warmup", "1", "--max-write-mbps", "50",
                     "--path", str(tmp_path))
    rows = {row["method"]: row for row in r["rows"]}
    assert set(rows) == {"none", "all", "planned"}
    assert rows["none"]["step_time_ratio"] == 1.0
    for name in ("all", "planned"):
        assert rows[name]["median_step_seconds"] > 0 and 0 < rows[name]["peak_resident_fraction"] <= 1.0
    assert len(rows["planned"]["plan"]) >= 2 and rows["planned"]["planned_write_bps"] <= 50e6 * 1.0001
    assert "load average" in p.stdout
