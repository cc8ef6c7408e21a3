"""A small run of bench/trainer_offload.py is a test: inside TRL's SFTTrainer and
a torchtune recipe loop, ebbtide offloads and the parameters after training
are bitwise those without offloading; the frameworks' own offloaders either
run (on an accelerator) or their rows say why not."""
import pytest
import torch


def test_trainer_offload_small(tmp_path, run_bench):
    pytest.importorskip("trl")
    pytest.importorskip("torchtune.training")
    p, r = run_bench("trainer_offload.py", "--device", "cpu", "--layers", "2", "--hidden", "32", "--seq", "32",
                     "--batch", "2", "--vocab", "128", "--steps", "1", "--warmup", "0", "--min-bytes", "0",
                     "--path", str(tmp_path), timeout=300)
    rows = {(row["framework"], row["method"]): row for row in r["rows"]}
    assert set(rows) == {(f, m) for f in ("trl", "torchtune")
                         for m in ("none", "framework", "ebbtide-cpu", "ebbtide-ssd")}
    for key, row in rows.items():
        if key[1] == "framework" and "error" in row:
            assert not torch.cuda.is_available(), (key, row["error"])  # they need an accelerator
            continue
        assert row["params_equal_none"], key
        assert row["step_seconds"] > 0 and row["peak_bytes"] >= 0, key
    for fw in ("trl", "torchtune"):
        assert rows[(fw, "ebbtide-cpu")]["bytes_offloaded"] > 0
    assert "params==none" in p.stdout
