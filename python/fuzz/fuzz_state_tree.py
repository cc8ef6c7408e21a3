#!/usr/bin/env python3
"""Coverage-guided fuzzing of native checkpoints' state trees (issue 33).

The state tree (which containers, keys and tensor references a checkpoint
rebuilds) is parsed in Python, out of reach of the C++ fuzz targets. This
target (atheris, libFuzzer's engine for Python) turns each input into a
mutated tree with the grammar of python/tests/test_ckpt_validation.py
(references to tensor -1, 10**6, one past the last; bad dtypes and devices;
deep nesting; wrong node kinds), writes it into a copy of a real checkpoint
with its checksums recomputed, and requires that `load()` and
`ebbtide ckpt inspect` agree: both accept it, or both refuse it with the
same message, and `load()` raises only the typed errors it documents. A
disagreement or an untyped error aborts with the input saved by libFuzzer.

Run: python python/fuzz/fuzz_state_tree.py -max_total_time=30 [corpus_dir]
(scripts/test.sh runs it in its fuzzing stage).
"""
import contextlib
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

with atheris.instrument_imports(include=["ebbtide"]):
    from ebbtide import checkpoint as ckpt
    from ebbtide import cli

import test_ckpt_validation as tv  # noqa: E402  (the grammar and the helpers of the seeded sweep)
from test_checkpoint_hostile import Shard  # noqa: E402


class FuzzedRandom:
    """The slice of random.Random the tree grammar uses, drawn from the input."""

    def __init__(self, data):
        self.fdp = atheris.FuzzedDataProvider(data)

    def randrange(self, n):
        return self.fdp.ConsumeIntInRange(0, n - 1)

    def choice(self, seq):
        seq = list(seq)
        return seq[self.randrange(len(seq))]

    def random(self):
        return self.fdp.ConsumeProbability()


ROOT = Path(tempfile.mkdtemp(prefix="ebbtide-fuzz-tree-"))
ORIGINAL = ROOT / "original"
WORK = ROOT / "work"
ckpt.save(tv._native_state(), ORIGINAL)
ckpt.join()
N_TENSORS = len(Shard(ORIGINAL / "rank0.ebt").meta["tensors"])
shutil.copytree(ORIGINAL, WORK)


def refusal():
    """load()'s error message, or None when it loads."""
    try:
        ckpt.load(WORK)
    except (ValueError, OSError, NotImplementedError) as e:
        return tv._message(e)
    return None


def inspect():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["ckpt", "inspect", str(WORK)])
    return rc, err.getvalue()


def test_one_input(data):
    rng = FuzzedRandom(data)
    s = Shard(ORIGINAL / "rank0.ebt")
    s.path = WORK / "rank0.ebt"
    for _ in range(1 + rng.randrange(3)):
        s.meta["tree"] = tv._mutate_tree(s.meta["tree"], rng, N_TENSORS)
    s.write()
    refused = refusal()
    rc, err = inspect()
    if refused is None and rc != 0:
        raise AssertionError(f"load() loaded the tree, inspect exited {rc}:\n{err}")
    if refused is not None and (rc == 0 or refused not in tv._one_line(err)):
        raise AssertionError(f"load() said {refused!r}; inspect exited {rc}:\n{err}")


def main():
    atheris.Setup(sys.argv, test_one_input)
    try:
        atheris.Fuzz()
    finally:
        shutil.rmtree(ROOT, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("EBBTIDE_LOG_LEVEL", "error")
    main()
