"""A small run of bench/offload_bench.py is a test: it runs end to end and its JSON is complete."""
import pytest

# The columns every method that ran has (bench/offload_bench.py's docstring).
ROW_COLUMNS = {"step_seconds", "step_time_ratio", "forward_seconds", "peak_bytes", "peak_ratio",
               "offloaded_fraction", "offloaded_bytes_per_forward_second", "peak_cut_vs_link_limit",
               "max_grad_diff", "max_grad_diff_exact"}
# Methods that need CUDA and say so in their row on a CPU machine.
CUDA_ONLY = {"torchtune", "compiler-offload"}


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


def test_offload_bench_mixture_of_experts(tmp_path, run_bench):
    """--model mixtral (the demo's models are the bench's): the MoE trains bitwise
    under every CPU method and its saved storages are measured."""
    pytest.importorskip("transformers")
    p, r = run_bench("offload_bench.py", "--device", "cpu", "--model", "mixtral", "--layers", "2", "--hidden", "64",
                     "--heads", "4", "--seq", "64", "--batch", "2", "--steps", "1", "--warmup", "0",
                     "--path", str(tmp_path))
    assert r["model"] == "mixtral" and "offload_bench: mixtral" in p.stdout
    assert [row["method"] for row in r["rows"]] == ["none", "ebbtide-ssd", "ebbtide-cpu"]
    assert all(row["max_grad_diff"] == 0.0 and row["max_grad_diff_exact"] for row in r["rows"]), r["rows"]
    assert r["eligible_bytes"] > 0 and r["rows"][2]["offloaded_fraction"] > 0


def _check_run(r, ran, skipped):
    rows = {row["method"]: row for row in r["rows"]}
    assert set(rows) == ran | skipped
    for m in ran:
        row = rows[m]
        assert row["status"] == "ok", row
        assert ROW_COLUMNS <= set(row), ROW_COLUMNS - set(row)
        # every method computes the gradients of no offload, bitwise, every step
        assert row["max_grad_diff"] == 0.0 and row["max_grad_diff_exact"], row
        assert row["step_seconds"] > 0 and row["forward_seconds"] > 0
    for m in skipped:
        assert rows[m]["status"].startswith("skipped: "), rows[m]
    for m in ran & {"ebbtide-cpu", "ebbtide-ssd", "ebbtide-auto"}:
        assert 0 < rows[m]["offloaded_fraction"] <= 1 and rows[m]["offloaded_bytes_per_forward_second"] > 0
    assert r["eligible_bytes"] > 0 and r["eligible_tensors"] > 0
    assert r["link"]["d2h_gbps"] > 0 and r["link"]["h2d_gbps"] > 0 and r["link"]["bytes"] > 0
    assert 0 < r["link_limit"] <= 1


def test_offload_bench_shape_flags(tmp_path, run_bench):
    """--shape c with tiny overrides, SDPA attention, --layers auto (2 on a CPU)
    and every method: the CUDA-only ones are rows saying why they were skipped."""
    pytest.importorskip("transformers")
    methods = ["none", "ebbtide-cpu", "ebbtide-auto", "ebbtide-ssd", "torchtune", "save_on_cpu", "recompute",
               "compiler-offload"]
    p, r = run_bench("offload_bench.py", "--device", "cpu", "--shape", "c", "--layers", "auto", "--hidden", "64",
                     "--heads", "2", "--seq", "64", "--batch", "2", "--attn", "sdpa", "--steps", "1",
                     "--warmup", "1", "--methods", ",".join(methods), "--path", str(tmp_path))
    assert r["shape"] == "c" and r["attn"] == "sdpa" and r["compile"] == "none" and r["layers"] == 2
    assert r["dtype"] == "bf16" and r["layers_auto"]["reason"]
    assert [row["method"] for row in r["rows"]] == methods
    _check_run(r, set(methods) - CUDA_ONLY, CUDA_ONLY)
    assert "skipped: needs CUDA" in p.stdout and "link limit" in p.stdout


def test_offload_bench_compiled_blocks(tmp_path, run_bench):
    """--compile block: every block compiled (about 40 s of torch.compile on
    2 CPU cores, cold cache); the saved-tensor-hook methods still match no
    offload bitwise. (Recompute does not under compile: it is left out.)"""
    pytest.importorskip("transformers")
    p, r = run_bench("offload_bench.py", "--device", "cpu", "--shape", "c", "--layers", "2", "--hidden", "64",
                     "--heads", "2", "--seq", "64", "--batch", "2", "--attn", "sdpa", "--compile", "block",
                     "--steps", "1", "--warmup", "1", "--methods", "none,ebbtide-cpu,save_on_cpu,compiler-offload",
                     "--path", str(tmp_path), timeout=600)
    assert r["compile"] == "block"
    _check_run(r, {"none", "ebbtide-cpu", "save_on_cpu"}, {"compiler-offload"})
