"""A small run of bench/pack_overhead.py is a test: it runs end to end, every
method leaves the gradients bitwise unchanged, and its JSON is complete."""
import pytest

METHODS = ["none", "identity", "save_on_cpu", "save_on_cpu-copy", "ebbtide-kept", "ebbtide-cpu", "ebbtide-ssd",
           "ebbtide-offload-ctx"]


@pytest.mark.parametrize("weights", ["parameter", "tensor"])
def test_pack_overhead_bench_small(tmp_path, run_bench, weights):
    p, r = run_bench("pack_overhead.py", "--device", "cpu", "--ops", "50", "--repeats", "2",
                     "--weights", weights, "--path", str(tmp_path))
    assert [row["method"] for row in r["rows"]] == METHODS
    assert r["tensors_saved"] == 100  # each matmul saves its two inputs
    for row in r["rows"]:
        assert row["max_grad_diff"] == 0.0, row["method"]
        assert len(row["step_seconds"]) == 2 and row["median_step_seconds"] > 0
    rows = {row["method"]: row for row in r["rows"]}
    to_cache = 100 if weights == "tensor" else 50  # the cache passes Parameters through
    assert rows["ebbtide-kept"]["stats"]["tensors_saved"] == to_cache
    assert rows["ebbtide-kept"]["stats"]["tensors_offloaded"] == 0
    assert rows["ebbtide-offload-ctx"]["stats"]["tensors_saved"] == to_cache
    ctx = r["offload_ctx"]
    assert len(ctx["samples_seconds"]) == 3 * 5 and ctx["median_seconds"] > 0
    names = {t["name"].split(" ")[0] for t in r["targets"]}
    assert names == {"ebbtide-kept", "ebbtide-cpu", "offload()"}
    assert len(r["targets"]) == 5  # kept vs identity, cpu vs both save_on_cpu rows, offload() twice
    assert r["date"] and r["torch"] and "gpu" not in r
    assert "targets:" in p.stdout
