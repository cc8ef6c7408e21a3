"""A small run of bench/planner_bench.py is a test: it runs end to end and its JSON is complete."""
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "planner_bench.py")


def test_planner_bench_small(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, BENCH, "--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "64",
                        "--batch", "2", "--steps", "1", "--warmup", "1", "--max-write-mbps", "50",
                        "--path", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    rows = {row["method"]: row for row in r["rows"]}
    assert set(rows) == {"none", "all", "planned"}
    assert rows["none"]["step_time_ratio"] == 1.0
    for name in ("all", "planned"):
        assert rows[name]["median_step_seconds"] > 0 and 0 < rows[name]["peak_resident_fraction"] <= 1.0
    assert len(rows["planned"]["plan"]) >= 2 and rows["planned"]["planned_write_bps"] <= 50e6 * 1.0001
    assert "load average" in p.stdout
