"""Issue 28's findings on a real GPU (skipped without one), each marked
"Finding N": backward phases without a backward, exceptions in backward,
saves on side streams, expandable segments, graphed blocks, a rank on the
second GPU, no host waits in the hot path, dynamic shapes, forked data-loader
workers. The model, the helpers (sleep_cycles, StreamGate, preload,
run_script, ...) and the basic CUDA tests are in test_cache_cuda.py; the
subprocess scripts import them from there."""
import copy
import gc
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from ebbtide import _core
from test_cache_cuda import (Net, RaiseInBackward, RaiseNet, StreamGate, assert_untouched, expert_net, fill_fresh,
                             mlp_net, offload_all, on_side_stream, result_of, run, run_script, same, saved_storage_bytes,
                             sleep_cycles, stat)

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and _core.cuda_driver_available()),
                                reason="needs a CUDA device and driver")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
HERE = os.path.dirname(os.path.abspath(__file__))


# steps reload bitwise.
@pytest.mark.parametrize("delay", [0.0, 0.5], ids=["now", "behind-sleep"])
@pytest.mark.parametrize("target", ["cpu", "ssd"])
def test_cuda_phase_backward_without_backward(target, delay, tmp_path):
    torch.manual_seed(0)
    model = Net(layers=4, d=512).cuda()
    x = torch.randn(8, 1024, 512, device="cuda")
    ref = run(model, x)
    sizes = saved_storage_bytes(model, x)
    cache = offload_all(target, tmp_path).attach(model)
    try:
        for _ in range(2):
            with cache.step():
                loss = model(x)
                cache.drain()  # every store done: phase("backward") has something to reload
                if delay:
                    torch.cuda._sleep(sleep_cycles(delay))
                cache.phase("backward")
                del loss  # no backward: the graph and its reload buffers go now
                fresh = fill_fresh(sizes)
            assert_untouched(fresh)
            del fresh
        # The reloads phase("backward") starts, then a real backward.
        model.zero_grad(set_to_none=True)
        with cache.step():
            loss = model(x)
            if delay:
                torch.cuda._sleep(sleep_cycles(delay))
            cache.phase("backward")
            loss.backward()
        assert same(ref, result_of(model, loss))
        assert same(ref, run(model, x, cache.step()))
        assert cache.stats()["total"]["bytes_reloaded"] > 0
    finally:
        cache.close()


# Finding 1 (an exception in backward): the backward raises while earlier
# blocks' reloads are pending behind a long kernel; memory allocated after the
# aborted step keeps its values, and the next step is bitwise right.
@pytest.mark.parametrize("target", ["cpu", "ssd"])
def test_cuda_exception_in_backward_then_a_clean_step(target, tmp_path):
    torch.manual_seed(0)
    model = RaiseNet(layers=6, d=512).cuda()
    x = torch.randn(8, 1024, 512, device="cuda")
    ref = run(model, x)
    sizes = saved_storage_bytes(model, x)
    cache = offload_all(target, tmp_path).attach(model)
    try:
        assert same(ref, run(model, x, cache.step()))
        RaiseInBackward.armed = sleep_cycles(0.5)
        try:
            with pytest.raises(ArithmeticError, match="boom in backward") as raised:
                run(model, x, cache.step())
        finally:
            RaiseInBackward.armed = None
        del raised  # its traceback holds the graph
        gc.collect()
        fresh = fill_fresh(sizes)
        assert_untouched(fresh)
        del fresh
        for _ in range(2):
            assert same(ref, run(model, x, cache.step()))
    finally:
        cache.close()


# Finding 2: saves made on a stream other than the one the glue releases on.
# forward: the whole step runs under `with torch.cuda.stream(side)`; experts:
# each block's MLP runs on a side stream whose own allocations do not wait
# for the compute stream (ExpertBlock), so memory freed to its pool before
# its copy finished would be overwritten at once.
@pytest.mark.parametrize("where", ["forward", "experts"])
@pytest.mark.parametrize("target", ["cpu", "ssd"])
def test_cuda_saves_on_a_side_stream(where, target, tmp_path):
    torch.manual_seed(0)
    model = (expert_net if where == "experts" else Net)(6, 1024).cuda()
    x = torch.randn(8, 2048, 1024, device="cuda")
    step = (lambda *a: on_side_stream(run, *a)) if where == "forward" else run
    ref = step(model, x)
    assert same(ref, step(model, x)), "the step without offloading is not deterministic here"
    cache = offload_all(target, tmp_path).attach(model)
    try:
        for i in range(3):
            assert same(ref, step(model, x, cache.step())), f"step {i}"
        assert cache.stats()["total"]["tensors_offloaded"] > 0
    finally:
        cache.close()


_EXPANDABLE_SEGMENTS = """
import gc, os, torch
from test_cache_cuda import Net, offload_all, run, same, sleep_cycles
torch.manual_seed(0)
model = Net(layers=4, d=512).cuda()
x = torch.randn(8, 1024, 512, device="cuda")
ref = run(model, x)
cache = offload_all({target!r}, {path!r}).attach(model)

class Abort(Exception):
    pass

def abort(grad):
    raise Abort()

for i in range(3):  # empty_cache between steps
    assert same(ref, run(model, x, cache.step())), f"step {{i}}"
    torch.cuda.empty_cache()
# Aborted steps whose forward kernels (and so the stores after them) wait
# behind a long kernel: the step ends at once and empty_cache hands the
# segments back to the driver while the copies out of them are pending.
for how in ("raise", "drop-graph", "raise-in-backward"):
    try:
        with cache.step():
            torch.cuda._sleep(sleep_cycles(1.0))
            loss = model(x)
            if how == "raise":
                raise Abort()
            if how == "raise-in-backward":
                loss.register_hook(abort)
                loss.backward()
            del loss
    except Abort:
        pass
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    assert same(ref, run(model, x, cache.step())), how
    torch.cuda.empty_cache()
cache.close()
print("ok", os.environ["PYTORCH_CUDA_ALLOC_CONF"])
"""


# Finding 3: entries erased before their device-to-host copy finished, with
# expandable segments (empty_cache unmaps freed memory at once), between
# steps and after aborted steps. In a fresh process: the allocator's settings
# are read once.
@pytest.mark.parametrize("target", ["cpu", "ssd"])
def test_cuda_expandable_segments_and_empty_cache(target, tmp_path):
    out = run_script(_EXPANDABLE_SEGMENTS.format(target=target, path=str(tmp_path)),
                     env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert "ok expandable_segments:True" in out


# Finding 4: a block captured by torch.cuda.make_graphed_callables inside an
# offloaded step. The capture's saves reach the cache's hooks; the cache keeps
# them resident (counted in tensors_in_capture) and does nothing a capture
# forbids; the graphed steps' gradients are those of the same graphed model
# without offloading.
def test_cuda_graphed_block_inside_an_offloaded_step():
    torch.manual_seed(0)
    model = mlp_net(4, 512).cuda()
    ref_model = copy.deepcopy(model)
    x = torch.randn(4, 512, 512, device="cuda")

    def sample():
        return (torch.randn(4, 512, 512, device="cuda", requires_grad=True),)

    ref_model.blocks[1].mlp = torch.cuda.make_graphed_callables(ref_model.blocks[1].mlp, sample())
    ref = run(ref_model, x)
    assert same(ref, run(ref_model, x))
    cache = offload_all("cpu").attach(model)
    try:
        model.zero_grad(set_to_none=True)
        with cache.step():
            model.blocks[1].mlp = torch.cuda.make_graphed_callables(model.blocks[1].mlp, sample())
            loss = model(x)
            loss.backward()
        assert stat(cache, "tensors_in_capture") > 0
        assert same(ref, result_of(model, loss))
        for i in range(2):
            assert same(ref, run(model, x, cache.step())), f"graphed step {i}"
        assert cache.stats()["total"]["tensors_offloaded"] > 0
    finally:
        cache.close()


_SECOND_GPU = """
import ctypes, os, time, torch

def primary_context_active(ordinal):  # driver API: makes no context; nothing imports ebbtide yet
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cu.cuDeviceGet(ctypes.byref(dev), ordinal) == 0
    assert cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
    return bool(active.value)

torch.cuda.set_device(1)
# torch alone, as the rank's training does: kernels, pinned memory, a backward.
w = torch.randn(256, 256, device="cuda", requires_grad=True)
(w @ w).sum().backward()
torch.empty(1 << 20, pin_memory=True).copy_(w.detach().flatten().repeat(16), non_blocking=True)
torch.cuda.synchronize()
baseline = primary_context_active(0)

import ebbtide
from ebbtide import checkpoint
from test_cache_cuda import Net, run, same
torch.manual_seed(0)
model = Net(layers=3, d=256).cuda()
x = torch.randn(4, 512, 256, device="cuda")
ref = run(model, x)
for target, adaptive in (("cpu", False), ("ssd", False), ("auto", True)):
    cache = ebbtide.TensorCache(target=target, path={path!r}, adaptive=adaptive, min_bytes=0).attach(model)
    for i in range(3):  # adaptive: profile, then planned steps
        assert same(ref, run(model, x, cache.step())), (target, i)
    cache.close()
with ebbtide.offload(model, target="cpu", min_bytes=0):
    loss = model(x)
loss.backward()
checkpoint.save(model.state_dict(), {path!r} + "/ckpt", async_=True, snapshot="background").wait()
checkpoint.load({path!r} + "/ckpt", into=model, device="cuda")
checkpoint.save_safetensors(model.state_dict(), {path!r} + "/m.safetensors")
checkpoint.load_safetensors({path!r} + "/m.safetensors", into=model)
torch.cuda.synchronize()
print("CTX0", baseline, primary_context_active(0), flush=True)
print("READY", os.getpid(), flush=True)
end = time.time() + 120
while not os.path.exists({done!r}) and time.time() < end:
    time.sleep(0.05)
"""


def _compute_apps_gpu_uuids(pid):
    """The GPU UUIDs on which `pid` has a compute context, by nvidia-smi (or
    pynvml), and the UUID of GPU 0; None where neither can list processes or
    `pid` is not among them (a container's PIDs are not the driver's)."""
    if shutil.which("nvidia-smi"):
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60).stdout
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60).stdout
        uuid0 = dict(line.split(", ") for line in gpus.strip().splitlines()).get("0")
        mine = {u.strip() for line in apps.strip().splitlines() for p, u in [line.split(",")[:2]]
                if p.strip() == str(pid)}
        return (mine, uuid0) if mine else None
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        mine, uuid0 = set(), None
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            uuid0 = uuid if i == 0 else uuid0
            if any(p.pid == pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)):
                mine.add(uuid)
        return (mine, uuid0) if mine else None
    finally:
        pynvml.nvmlShutdown()


# Finding 5: a rank on cuda:1 (torch.cuda.set_device(1)) runs the cache on
# every target, offload() and checkpoints, and never makes a context on GPU 0.
# In a subprocess, so this process's own context does not count: it checks
# its primary context on device 0 with the driver API, and this process asks
# nvidia-smi (or pynvml) where the subprocess has contexts.
@needs_two_gpus
def test_cuda_rank_on_the_second_gpu_makes_no_context_on_gpu0(tmp_path):
    done = tmp_path / "done"
    code = f"import sys; sys.path.insert(0, {HERE!r})\n" + textwrap.dedent(
        _SECOND_GPU.format(path=str(tmp_path), done=str(done)))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(300, p.kill)
    watchdog.start()
    lines, seen = [], None
    try:
        for line in p.stdout:
            lines.append(line)
            if line.startswith("READY"):
                seen = _compute_apps_gpu_uuids(p.pid)
                done.touch()
        p.wait()
    finally:
        watchdog.cancel()
        done.touch()
    out = "".join(lines)
    assert p.returncode == 0, out
    ctx = next(line.split() for line in lines if line.startswith("CTX0"))
    assert ctx[1] == "False", "torch alone made a context on GPU 0 in the subprocess: this check cannot tell\n" + out
    assert ctx[2] == "False", "ebbtide made a context on GPU 0 for a rank on cuda:1\n" + out
    if seen is not None:
        mine, uuid0 = seen
        assert uuid0 not in mine, f"nvidia-smi lists the cuda:1 process on GPU 0 ({mine})"


# Finding 6: no host waits in the hot path. The forward of a step whose
# kernels wait behind a long kernel returns while the device is still busy
# (the event recorded after that kernel has not completed).
@pytest.mark.parametrize("target", ["cpu", "ssd"])
def test_cuda_forward_does_not_wait_for_the_device(target, tmp_path):
    torch.manual_seed(0)
    model = Net(layers=4, d=512).cuda()
    x = torch.randn(4, 512, 512, device="cuda")
    ref = run(model, x)
    cache = offload_all(target, tmp_path).attach(model)
    try:
        for _ in range(2):
            assert same(ref, run(model, x, cache.step()))
        model.zero_grad(set_to_none=True)
        gated = torch.cuda.Event()
        gate = StreamGate()
        with cache.step():
            gate.close()
            gated.record()
            loss = model(x)
            busy = not gated.query()
            gate.open()
            loss.backward()
        assert busy and not gate.forced, "the forward waited on the host for the device (a host sync in the hooks)"
        assert same(ref, result_of(model, loss))
    finally:
        cache.close()


# Finding 6: dynamic shapes. Sequence lengths vary step by step; gradients stay
# bitwise, and once the lengths have been seen (the first round) the host
# store registers no more memory (store_host_registrations: cuMemHostRegister
# calls so far), neither for the same lengths again nor for others inside
# their range.
@pytest.mark.parametrize("target", ["cpu", "ssd"])
def test_cuda_variable_sequence_lengths(target, tmp_path):
    torch.manual_seed(0)
    model = Net(layers=4, d=512).cuda()
    rounds = [[1024, 512, 768, 896, 640], [640, 1024, 512, 896, 768], [576, 960, 704, 832, 1000]]
    xs = {s: torch.randn(4, s, 512, generator=torch.Generator().manual_seed(s)).cuda()
          for s in sorted({s for r in rounds for s in r})}
    refs = {s: run(model, x) for s, x in xs.items()}
    cache = offload_all(target, tmp_path).attach(model)
    try:
        regs = []
        for n, lengths in enumerate(rounds):
            for s in lengths:
                assert same(refs[s], run(model, xs[s], cache.step())), f"round {n}, length {s}"
            regs.append(stat(cache, "store_host_registrations"))
        assert regs[1] == regs[0] and regs[2] == regs[0], f"cuMemHostRegister calls after each round: {regs}"
    finally:
        cache.close()


class _Rows(torch.utils.data.Dataset):
    """Deterministic rows, made in the DataLoader's worker processes."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.randn(512, 512, generator=torch.Generator().manual_seed(i))


# Finding 7: DataLoader workers forked while the cache's pinned buffers exist
# (forked again every epoch: persistent_workers=False); the parent keeps
# copying through those buffers while the workers live.
@pytest.mark.parametrize("target", ["cpu", "ssd"])
def test_cuda_dataloader_workers_forked_every_epoch(target, tmp_path):
    torch.manual_seed(0)
    model = Net(layers=4, d=512).cuda()
    rows = _Rows()
    batches = [torch.stack([rows[2 * k], rows[2 * k + 1]]) for k in range(len(rows) // 2)]
    refs = [run(model, b.cuda()) for b in batches]
    loader = torch.utils.data.DataLoader(rows, batch_size=2, num_workers=2, persistent_workers=False,
                                         pin_memory=True, multiprocessing_context="fork")
    cache = offload_all(target, tmp_path).attach(model)
    try:
        assert same(refs[0], run(model, batches[0].cuda(), cache.step()))  # pinned buffers before the first fork
        for epoch in range(3):
            n = 0
            for k, b in enumerate(loader):
                assert same(refs[k], run(model, b.cuda(non_blocking=True), cache.step())), f"epoch {epoch} batch {k}"
                n += 1
            assert n == len(batches)
        assert cache.stats()["total"]["tensors_offloaded"] > 0
    finally:
        cache.close()
