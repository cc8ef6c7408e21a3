"""A small run of bench/ckpt_bench.py is a test: it runs end to end and its JSON is complete."""
import os

import pytest


def test_ckpt_bench_small(tmp_path, run_bench):
    pytest.importorskip("transformers")
    p, r = run_bench("ckpt_bench.py", "--size", "0.03", "--dir", str(tmp_path / "d"), "--no-torch")
    for k in ("ebbtide_save_s", "ebbtide_load_s", "ebbtide_load_into_s", "async_blocked_fraction",
              "background_blocked_fraction", "background_total_s", "lossless_bf16_weights_ratio",
              "dcp_ebb_save_s", "dcp_fs_save_s", "dcp_ebb_load_s", "dcp_ebb_async_blocked_s",
              "dcp_ebb_astage_blocked_s", "dcp_ebb_astage_staged_s"):
        assert r[k] > 0, k
    assert "ebbtide save (durable, committed)" in p.stdout
    assert "DCP save, ebbtide plugin" in p.stdout
    assert os.listdir(tmp_path / "d") == []


def test_ckpt_bench_safetensors_small(tmp_path, run_bench):
    pytest.importorskip("safetensors")
    p, r = run_bench("ckpt_bench.py", "--safetensors", "--size", "0.02", "--dir", str(tmp_path / "d"), "--no-fio",
                     "--fresh-rounds", "1", "--fresh-pause", "0")
    for k in ("ebbtide_save_s", "ebbtide_load_s", "ebbtide_load_into_s", "safetensors_save_s", "safetensors_load_s",
              "ebbtide_save_first_s", "ebbtide_load_first_s", "ebbtide_load_fresh_s", "safetensors_load_fresh_s"):
        assert r[k] > 0, k
    assert "fresh process (x1)" in p.stdout
    assert "ebbtide load_safetensors" in p.stdout
    assert os.listdir(tmp_path / "d") == []


def test_ckpt_bench_device_loads_small(tmp_path, run_bench):
    pytest.importorskip("safetensors")
    p, r = run_bench("ckpt_bench.py", "--device-loads", "--size", "0.02", "--repeat", "1", "--dir", str(tmp_path / "d"))
    assert r["device"] == "cpu" and len(r["median_s"]) == 6 and all(v > 0 for v in r["median_s"].values())
    assert "DCP load into device targets, EbbtideReader" in p.stdout
    assert os.listdir(tmp_path / "d") == []


@pytest.mark.parametrize("mode", ["native", "dcp"])
def test_ckpt_first_save_small(tmp_path, run_bench, mode):
    # 0.1 GB: more than one 64 MiB arena segment, so a writer that kept a
    # state-sized snapshot would hold 128 MiB; synchronous saves hold the ring.
    p, r = run_bench("ckpt_first_save.py", "--mode", mode, "--size", "0.1", "--saves", "2",
                     "--dir", str(tmp_path / "d"))
    assert r["state_bytes"] > 64 << 20
    assert r["first_s"] > 0 and len(r["later_s"]) == 1 and len(r["cpu_s"]) == 2
    assert r["writer_buffers_mb"] == 64, r
