"""A small run of bench/offload_bench.py is a test: it runs end to end and its JSON is complete."""
import pytest


def test_offload_bench_small(tmp_path, run_bench):
    pytest.importorskip("transformers")
    p, r = run_bench("offload_bench.py", "--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "2",
                     "--seq", "64", "--batch", "2", "--steps", "1", "--warmup", "0", "--path", str(tmp_path))
    assert [row["method"] for row in r["rows"]] == ["none", "ebbtide-ssd", "ebbtide-cpu"]
    assert all(row["max_grad_diff"] == 0.0 for row in r["rows"])
    assert {t["name"] for t in r["targets"]} == {"step time ebbtide-ssd / none <= 1.05",
                                                "peak_resident / no-offload activation peak <= 0.5"}
    assert r["date"] and r["torch"] and "gpu" not in r
    assert "targets:" in p.stdout
