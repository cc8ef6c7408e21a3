"""`ebbtide demo` end to end on a tiny configuration."""
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.parametrize("model", ["gpt2", "bert", "t5"])
def test_demo_json_all_methods(cli, tmp_path, model):
    png = tmp_path / "demo.png"
    proc = cli("demo", "--model", model, "--layers", "2", "--hidden", "64", "--heads", "4",
               "--seq", "64", "--batch", "2", "--steps", "1", "--warmup", "0", "--device", "cpu",
               "--png", str(png), "--path", str(tmp_path), "--json")
    r = json.loads(proc.stdout)
    methods = [row["method"] for row in r["rows"]]
    assert methods == ["none", "ebbtide-ssd", "ebbtide-cpu", "recompute", "save_on_cpu"]
    for row in r["rows"]:
        assert row["step_seconds"] > 0
        # every method computes the same gradients as no offload, bitwise
        assert row["max_grad_diff"] == 0.0, row
    ssd = r["rows"][1]
    assert ssd["bytes_written"] > 0
    # every byte written is a completed store or one whose tensor was forwarded while it ran
    assert ssd["stats"]["bytes_offloaded"] + ssd["stats"]["bytes_discarded"] == ssd["bytes_written"]
    assert png.stat().st_size > 1000
    assert [p.name for p in tmp_path.iterdir()] == ["demo.png"]  # no files left behind


def test_demo_auto_method(cli, tmp_path):
    """ebbtide-auto (the default target, adaptive) is accepted; its first step profiles."""
    proc = cli("demo", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "64", "--batch", "2",
               "--steps", "1", "--warmup", "1", "--device", "cpu", "--methods", "none,ebbtide-auto,ebbtide-cpu",
               "--png", "", "--path", str(tmp_path), "--json")
    rows = {row["method"]: row for row in json.loads(proc.stdout)["rows"]}
    auto = rows["ebbtide-auto"]
    assert auto["max_grad_diff"] == 0.0
    assert auto["stats"]["adaptive"] and auto["stats"]["planner"] is not None
    # On CPU auto has no host tier: what it offloads goes to SSD files.
    assert auto["bytes_written"] == auto["stats"]["bytes_offloaded"] + auto["stats"]["bytes_discarded"]
    assert rows["ebbtide-cpu"]["bytes_written"] == 0 and rows["ebbtide-cpu"]["stats"]["bytes_offloaded"] > 0


def test_demo_table(cli, tmp_path):
    proc = cli("demo", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "32",
               "--batch", "1", "--steps", "1", "--warmup", "0", "--methods", "none,recompute",
               "--png", "")
    assert "max|dgrad|" in proc.stdout and "recompute" in proc.stdout


def test_demo_bad_input(cli):
    proc = cli("demo", "--methods", "none,teleport", check=False)
    assert proc.returncode != 0 and "teleport" in proc.stderr
    proc = cli("demo", "--hidden", "30", "--heads", "4", "--png", "", check=False)
    assert proc.returncode != 0 and "divisible" in proc.stderr
