"""The demo's CPU memory column against what the process really holds: the
peak growth of its resident memory (issue 30, part 5)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

# Runs in a fresh process. glibc's malloc is told to map every block of
# 128 KiB or more on its own and to give it back when freed (a fixed mmap
# threshold also stops glibc raising it as blocks are freed): resident memory
# then rises and falls with the memory in use, and the kernel's high-water
# mark (VmHWM, reset through clear_refs) is the step's true peak. Each method
# gets a fresh runner (its cache and buffer pools new) and runs three steps;
# in the first nothing is pooled yet, so the growth of resident memory is
# everything the step holds. The later steps reuse pooled buffers, which
# resident memory no longer shows as growth, but which the step holds all the
# same: the demo's column must stay at the first step's figure.
SCRIPT = r"""
import json, sys, tempfile
import torch
from ebbtide.harness.demo import _Runner
from ebbtide.harness.models import build_model, resolve_size

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

dev = torch.device("cpu")
size = resolve_size(dev, seq=512)  # steps large enough beside allocator noise (the demo defaults to 256)
torch.manual_seed(0)
model, make_batch = build_model("llama", size["layers"], size["hidden"], size["heads"], size["seq"],
                                torch.float32, dev)
out = {}
with tempfile.TemporaryDirectory(dir=sys.argv[1]) as workdir:
    warm = _Runner("none", model, make_batch, dev, size["batch"], workdir, "eager")
    for i in range(2):  # libraries, thread pools and the model's first touches
        warm.step(i, measured=False)
    warm.close()
    for method in ("none", "ebbtide-cpu", "ebbtide-ssd"):
        runner = _Runner(method, model, make_batch, dev, size["batch"], workdir, "eager")
        rows = []
        for i in range(3):
            model.zero_grad(set_to_none=True)
            start = status("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            runner.step(i, measured=True)
            rows.append(dict(column=runner.peaks[-1], rss_growth=status("VmHWM") - start))
        runner.close()
        out[method] = rows
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from ebbtide.harness.memmeter import heap_measurable

    if not heap_measurable():
        pytest.skip("glibc without mallinfo2: the demo cannot measure CPU memory here")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        pytest.skip(f"cannot reset the resident high-water mark (/proc/self/clear_refs: {e})")
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.mmap_threshold=131072:glibc.malloc.trim_threshold=131072",
               EBBTIDE_MAX_INFLIGHT="1")
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path_factory.mktemp("demo-memory"))],
                       capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize("method", ["none", "ebbtide-cpu", "ebbtide-ssd"])
def test_demo_memory_column_matches_rss_growth(measured, method):
    """Each step's column is within 3% of the first step's resident growth (everything the step holds)."""
    rows = measured[method]
    truth = rows[0]["rss_growth"]
    assert truth > 200 << 20, rows  # large enough that allocator noise is small beside it
    for i, row in enumerate(rows):
        assert abs(row["column"] - truth) <= 0.03 * truth, (method, i, rows)


def test_demo_memory_host_copies_save_nothing_on_cpu(measured):
    """On the CPU the host tier holds copies: ebbtide-cpu's peak is no offload's or more; SSD
    files lower it."""
    none = measured["none"][-1]["column"]
    assert measured["ebbtide-cpu"][-1]["column"] >= 0.97 * none, measured
    assert measured["ebbtide-ssd"][-1]["column"] <= 0.8 * none, measured
