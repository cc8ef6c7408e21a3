"""A small run of bench/ckpt_bench.py is a test: it runs end to end and its JSON is complete."""
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "ckpt_bench.py")


def test_ckpt_bench_small(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, BENCH, "--size", "0.03", "--dir", str(tmp_path / "d"), "--json", str(out),
                        "--no-torch"], capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    for k in ("ebbtide_save_s", "ebbtide_load_s", "ebbtide_load_into_s", "async_blocked_fraction",
              "background_blocked_fraction", "background_total_s", "lossless_bf16_weights_ratio"):
        assert r[k] > 0, k
    assert "ebbtide save (durable, committed)" in p.stdout
    assert os.listdir(tmp_path / "d") == []
