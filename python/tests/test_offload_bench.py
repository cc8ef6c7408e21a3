"""A small run of bench/offload_bench.py is a test: it runs end to end and its JSON is complete."""
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "offload_bench.py")


def test_offload_bench_small(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "2",
                        "--seq", "64", "--batch", "2", "--steps", "1", "--warmup", "0",
                        "--path", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert [row["method"] for row in r["rows"]] == ["none", "ebbtide-ssd", "ebbtide-cpu"]
    assert all(row["max_grad_diff"] == 0.0 for row in r["rows"])
    assert {t["name"] for t in r["targets"]} == {"step time ebbtide-ssd / none <= 1.05",
                                                "peak_resident / no-offload activation peak <= 0.5"}
    assert r["date"] and r["torch"] and "gpu" not in r
    assert "targets:" in p.stdout
