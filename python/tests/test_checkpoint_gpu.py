"""Checkpoints of CUDA state, the GPU form of issue 28's checkpoint findings
(skipped without a GPU; "needs two GPUs" where two are needed): loads into
targets on two devices (safetensors, cuFile or pinned staging), DCP's
async staging after the caller's stream, and a background snapshot under
NCCL that returns before the GPU is done."""
import os
import warnings

import pytest
import torch

from ebbtide import _core
from test_cache_cuda import preload, run_script, sleep_cycles

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and _core.cuda_driver_available()),
                                reason="needs a CUDA device and driver")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")

_SAFETENSORS_INTO_DEVICES = """
import torch
from ebbtide import _core, checkpoint
from test_cache_cuda import preload, sleep_cycles
devices = [torch.device(f"cuda:{{i}}") for i in range({ndev})]
g = torch.Generator().manual_seed(0)
src = {{f"t{{i}}_{{k}}": torch.randn(1024, 1024 + k, generator=g) for i in range(len(devices)) for k in range(4)}}
checkpoint.save_safetensors(src, {path!r})
into = {{n: torch.empty(t.shape, device=devices[int(n[1])]) for n, t in src.items()}}
# The fill's kernel is loaded on each device first: a lazily loaded kernel's
# first launch may synchronize the context, and the host would wait for the
# sleep in the fill, before the load is called (preload in test_cache_cuda).
for d in devices:
    with torch.cuda.device(d):
        preload(lambda: [t.fill_(-1.0) for t in into.values() if t.device == d])
# Each device's current stream: a long kernel, then a fill of that device's
# targets. The load must land after both, on every device; the last device
# sleeps longest.
for i, d in enumerate(devices):
    with torch.cuda.device(d):
        torch.cuda._sleep(sleep_cycles(0.5 + 0.5 * i, d))
        for n, t in into.items():
            if t.device == d:
                t.fill_(-1.0)
checkpoint.load_safetensors({path!r}, into=into)
bad = [n for n, t in into.items() if not torch.equal(t.cpu(), src[n])]
print("cufile", _core.cufile_available(), _core.cufile_unavailable_reason())
assert not bad, f"targets not loaded (the load did not wait for their device's stream): {{bad}}"
print("ok")
"""


# Finding 8: safetensors loads into targets on one device and on two, each
# target's device stream busy (a long kernel, then a fill of the targets)
# when the load starts: the load waits for each (context, stream), by cuFile
# (EBBTIDE_CUFILE=1: its compatibility mode where nvidia-fs is absent; it
# falls back to staging if cuFile fails) and by pinned staging
# (EBBTIDE_CUFILE=0). In a fresh process each: cuFile is probed once.
@pytest.mark.parametrize("cufile", ["0", "1"], ids=["staging", "cufile"])
@pytest.mark.parametrize("ndev", [1, pytest.param(2, marks=needs_two_gpus)])
def test_cuda_safetensors_load_into_devices_waits_for_each_stream(ndev, cufile, tmp_path):
    out = run_script(_SAFETENSORS_INTO_DEVICES.format(ndev=ndev, path=str(tmp_path / "m.safetensors")),
                     env={"EBBTIDE_CUFILE": cufile})
    assert out.strip().endswith("ok"), out
    print(out)


# Finding 9: DCP async_save with async staging, called with a side stream
# current on which the state's update is queued behind a long kernel: the
# staging copy is ordered after the caller's current stream, so the saved
# values are the updated ones.
def test_cuda_dcp_async_staging_orders_after_the_callers_stream(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ebbtide.dcp import EbbtideReader, EbbtideWriter
    g = torch.Generator().manual_seed(0)
    host = {"w": torch.randn(4096, 4096, generator=g), "b": torch.randn(4096, generator=g)}
    sd = {k: v.cuda() for k, v in host.items()}
    expect = {"w": host["w"] + 1.0, "b": host["b"] * 2.0}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    writer = EbbtideWriter(tmp_path / "c", async_staging=True)
    # The updates' kernels are loaded first: a lazily loaded kernel's first
    # launch may synchronize the context, and the host would wait for the
    # sleep there, so async_save would find the GPU idle (preload).
    preload(lambda: sd["w"].clone().add_(1.0), lambda: sd["b"].clone().mul_(2.0))
    try:
        with torch.cuda.stream(side):
            torch.cuda._sleep(sleep_cycles(1.0))
            sd["w"].add_(1.0)
            sd["b"].mul_(2.0)
            resp = dcp.async_save(sd, storage_writer=writer)
        resp.staging_completion.result(timeout=120)
        resp.upload_completion.result(timeout=120)
    finally:
        writer.close()
    torch.cuda.synchronize()
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=EbbtideReader(tmp_path / "c"))
    for k in expect:
        assert torch.equal(out[k].cpu(), expect[k]), f"{k}: the staging copy ran before the caller's update"


_BACKGROUND_UNDER_NCCL = """
import time, torch, torch.distributed as dist
from ebbtide import checkpoint
from test_cache_cuda import StreamGate, preload
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="file://" + {init!r}, rank=0, world_size=1)
try:
    g = torch.Generator().manual_seed(0)
    host = {{f"w{{i}}": torch.randn(2048, 2048, generator=g) for i in range(4)}}
    state = {{k: v.cuda() for k, v in host.items()}}
    # A first save: the gloo group of the checkpoint collectives (Note
    # [Checkpoint collectives]), the snapshot stream and the writer's pinned
    # arena exist after it.
    checkpoint.save(state, {path!r} + "/warm", async_=True, snapshot="background").wait()
    # The update's kernel is loaded before the gate closes: the state's first
    # kernel launch in this process, lazily loaded, may synchronize the
    # context and so wait for the gate before save() is called (preload).
    preload(lambda: [v.clone().add_(1.0) for v in state.values()])
    # The update waits behind a closed gate until save() has returned: the
    # GPU is busy with work queued before save() however fast it is.
    gate = StreamGate().close()
    for v in state.values():
        v.add_(1.0)
    done = torch.cuda.Event()
    done.record()
    update_waited = gate.forced  # the watchdog opened the gate while the host queued the update
    t0 = time.perf_counter()
    h = checkpoint.save(state, {path!r} + "/c", async_=True, snapshot="background")
    returned = time.perf_counter() - t0
    pending = not done.query() and not gate.forced
    gate.open()
    h.wait()
    out = checkpoint.load({path!r} + "/c", device="cpu")
    bad = [k for k, v in host.items() if not torch.equal(out[k], v + 1.0)]
    print("returned after", round(returned, 3), "s; GPU still busy:", pending, "; the update waited:",
          update_waited, flush=True)
    assert not bad, f"saved values are not the state at save(): {{bad}}"
    assert not update_waited, "the host waited for the gate while queueing the update, before save() was called"
    assert pending, "save() returned only after the GPU finished the work queued before it"
    print("ok")
finally:
    dist.destroy_process_group()
"""


# Finding 10: under an NCCL process group (world size 1, file:// rendezvous),
# a snapshot="background" save returns while work queued before it still
# waits (behind a closed StreamGate: the event recorded after it is not
# complete); the checkpoint is the state at save(), including an update
# queued behind the gate. In
# a fresh process: the process group and its communicator are its own.
def test_cuda_background_save_under_nccl_returns_before_the_gpu(tmp_path):
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_nccl_available()):
        pytest.fail("torch.distributed has no NCCL backend in this CUDA build")
    out = run_script(_BACKGROUND_UNDER_NCCL.format(init=str(tmp_path / "rendezvous"), path=str(tmp_path)),
                     env={"NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")}, timeout=300)
    assert out.strip().endswith("ok"), out
    print(out)
