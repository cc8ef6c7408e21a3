"""What a new user meets in the first minutes (issue 41, part 6): the
command's version, one-line errors for a negative size, a missing extra and
a file given as doctor's folder; a cache folder that does not exist yet; a
load into a module from a checkpoint that nests its state; a readable
summary of a cache's statistics."""
import json
import subprocess
import sys

import pytest
import torch

import ebbtide
from ebbtide import checkpoint as ckpt


def ebbtide_cmd(*args, code=None):
    prefix = [sys.executable, "-c", code + "\nfrom ebbtide.cli import main; sys.exit(main(sys.argv[1:]))"] \
        if code else [sys.executable, "-m", "ebbtide"]
    p = subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def test_version():
    rc, out, err = ebbtide_cmd("--version")
    assert rc == 0 and out.strip() == f"ebbtide {ebbtide.__version__}", (out, err)


def test_a_negative_size_after_a_space_is_a_one_line_error():
    rc, out, err = ebbtide_cmd("plan", "--model", "llama3-8b", "--seq", "8192", "--activation-budget", "-5GiB")
    assert rc == 2 and err.strip().splitlines() == \
        ["ebbtide plan: error: --activation-budget: '-5GiB' is not a size (examples: 4096, 512KiB, 1MiB, 4GiB)"], err


def test_a_missing_extra_is_a_one_line_error_naming_it():
    # As in a venv with the wheel alone: transformers cannot be imported.
    rc, out, err = ebbtide_cmd("demo", "--steps", "1", code="import sys; sys.modules['transformers'] = None")
    assert rc == 2 and err.strip().splitlines() == \
        ["ebbtide demo: error: needs transformers, which is not installed: pip install 'ebbtide[demo]'"], err


def test_doctor_on_a_file_says_it_is_a_file(tmp_path):
    f = tmp_path / "notadir"
    f.write_text("x")
    rc, out, err = ebbtide_cmd("doctor", "--dir", str(f), "--size", "0", "--json")
    checks = [c for c in json.loads(out)["checks"] if c["name"] == "directory"]
    assert checks and checks[0]["status"] == "fail", checks
    assert "is a file, not a directory" in checks[0]["summary"], checks
    assert "mkdir" not in checks[0]["advice"] and str(tmp_path) in checks[0]["advice"], checks


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))


def test_the_cache_creates_its_folder(tmp_path):
    where = tmp_path / "not" / "yet"
    model = small_model()
    cache = ebbtide.TensorCache(target="ssd", path=where, min_bytes=0, keep_last_modules=0)
    try:
        cache.attach(model)
        with cache.step():
            model(torch.randn(8, 32)).sum().backward()
    finally:
        cache.close()
    assert where.is_dir()


def test_a_file_as_the_cache_folder_is_an_error_naming_it(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match=f"path '{f}' is a file, not a folder"):
        ebbtide.TensorCache(target="ssd", path=f)


def test_load_into_a_module_from_a_nested_state_says_where_the_state_is(tmp_path):
    model = small_model()
    ckpt.save({"model": model.state_dict(), "optimizer": {"lr": torch.tensor(0.1)}, "step": torch.tensor(3)},
              tmp_path / "c")
    with pytest.raises(ValueError) as e:
        ckpt.load(tmp_path / "c", into=small_model())
    text = str(e.value)
    assert "unexpected keys ['model', 'optimizer', 'step']" in text, text
    assert "holds under 'model'" in text and "model.load_state_dict(state['model'])" in text, text
    # and the hint works
    other = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    other.load_state_dict(ckpt.load(tmp_path / "c")["model"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))


def test_summary_is_a_few_readable_lines_and_stats_stays_a_dict():
    model = small_model()
    cache = ebbtide.TensorCache(target="cpu", min_bytes=0, keep_last_modules=0).attach(model)
    try:
        with cache.step():
            model(torch.randn(8, 32)).sum().backward()
        stats, text = cache.stats(), cache.summary()
    finally:
        cache.close()
    assert isinstance(stats, dict) and len(stats) > 20
    lines = text.splitlines()
    assert 3 <= len(lines) <= 10 and all(len(line) < 130 for line in lines), text
    assert lines[0].startswith("ebbtide TensorCache: target cpu, 1 step"), text
    assert f"in {stats['tensors_saved']} tensors" in text and "tier cpu: wrote" in text, text
