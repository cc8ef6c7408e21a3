"""`ebbtide rok` on a tiny configuration."""
import json

import pytest

pytest.importorskip("transformers")


def test_rok_json_and_png(cli, tmp_path):
    png = tmp_path / "rok.png"
    proc = cli("rok", "--batch", "1,2", "--layers", "4", "--hidden", "128", "--heads", "4",
               "--seq", "256", "--steps", "1", "--warmup", "0", "--device", "cpu",
               "--png", str(png), "--json")
    r = json.loads(proc.stdout)
    pts = {(p["strategy"], p["batch"]): p for p in r["points"]}
    assert set(pts) == {(s, b) for s in ("keep", "offload", "recompute") for b in (1, 2)}
    for p in pts.values():
        assert p["tokens_per_second"] > 0 and p["peak_bytes"] > 0
        assert p["max_grad_diff"] == 0.0, p  # bitwise; the point names the strategy and batch
    # recompute holds fewer activations than keep at the same micro-batch
    assert pts[("recompute", 2)]["peak_bytes"] < pts[("keep", 2)]["peak_bytes"]
    assert png.stat().st_size > 1000


def test_rok_bad_batch(cli):
    proc = cli("rok", "--batch", "1,x", check=False)
    assert proc.returncode != 0 and "--batch" in proc.stderr
    proc = cli("rok", "--batch", "0", check=False)
    assert proc.returncode != 0 and "positive" in proc.stderr


def test_rok_budget_curve(cli, tmp_path):
    """`ebbtide rok --budget`: the activation-budget sweep of ebbtide.harness.budget_sweep, bitwise rows."""
    png = tmp_path / "budget.png"
    proc = cli("rok", "--budget", "--budget-points", "2", "--batch", "2", "--layers", "2", "--hidden", "64",
               "--heads", "2", "--seq", "64", "--steps", "1", "--warmup", "2", "--path", str(tmp_path),
               "--png", str(png), "--json")
    r = json.loads(proc.stdout)
    assert [x["strategy"] for x in r["rows"]] == ["keep", "offload", "recompute", "budget", "budget"]
    assert r["model"]["layers"] == 2 and r["model"]["batch"] == 2
    assert r["targets"]["bitwise"]
    assert png.stat().st_size > 1000
