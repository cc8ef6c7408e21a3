"""The tensor cache on a CUDA device (skipped without one): bitwise equality,
side-stream ordering under a busy compute stream, device memory savings, and
the helpers the GPU tests of issue 28's findings share
(test_cache_cuda_findings.py, test_checkpoint_gpu.py). Tests that need two GPUs skip with the reason "needs two GPUs"
(scripts/gpu_check.sh allows that skip only on a machine with one GPU)."""
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import ebbtide
from ebbtide import _core

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and _core.cuda_driver_available()),
                                reason="needs a CUDA device and driver")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
HERE = os.path.dirname(os.path.abspath(__file__))


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a = torch.nn.Linear(d, 4 * d)
        self.b = torch.nn.Linear(4 * d, d)
        self.n = torch.nn.LayerNorm(d)

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(self.n(x))))


class Net(torch.nn.Module):
    def __init__(self, layers=6, d=512):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.float().pow(2).mean()


def run(model, x, ctx=None, between=None, before=None):
    """One step under `ctx` (None: plain); `before` runs first inside it,
    `between` after the forward (e.g. a StreamGate's close and open)."""
    model.zero_grad(set_to_none=True)
    if ctx is None:
        loss = model(x)
        loss.backward()
    else:
        with ctx:
            if before is not None:
                before()
            loss = model(x)
            if between is not None:
                between()
            loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("target", ["cpu", "ssd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_bitwise_and_memory(target, dtype, tmp_path):
    torch.manual_seed(0)
    model = Net().cuda().to(dtype)
    x = torch.randn(8, 1024, 512, device="cuda", dtype=dtype)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ref = run(model, x)
    peak_ref = torch.cuda.max_memory_allocated() - base
    # Not planned (adaptive=False): everything is offloaded and released one
    # block later in the device's order (Note [Release points]), the compute
    # stream waiting for copies the link has not finished.
    cache = ebbtide.TensorCache(target=target, path=str(tmp_path) if target == "ssd" else None,
                                adaptive=False)
    cache.attach(model)
    try:
        for _ in range(2):
            torch.cuda.reset_peak_memory_stats()
            got = run(model, x, cache.step())
            peak = torch.cuda.max_memory_allocated() - base
            assert torch.equal(ref[0], got[0])
            assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
        s = cache.stats()
        assert s["tensors_offloaded"] > 0
        assert s["peak_resident_bytes"] <= s["saved_bytes_total"]
        assert s["copy_waits"] > 0
        assert peak < peak_ref, (peak, peak_ref, s)
    finally:
        cache.close()


def test_cuda_busy_compute_stream_orders_copies(tmp_path):
    # A long kernel queued before the saves: the store must wait for it (event),
    # and reloads must be visible to backward without a host sync.
    torch.manual_seed(0)
    a = torch.randn(4096, 4096, device="cuda", requires_grad=True)
    def fn(a):
        h = a
        for _ in range(4):
            h = (h @ h.t()).tanh()
        return h.sum()
    a.grad = None
    fn(a).backward()
    ref = a.grad.clone()
    cache = ebbtide.TensorCache(target="cpu", min_bytes=0)
    with cache.step():
        a.grad = None
        fn(a).backward()
    torch.cuda.synchronize()
    assert torch.equal(ref, a.grad)
    cache.close()


def test_cuda_autograd_thread_without_context_and_current_device_kept(tmp_path):
    # Note [Caller's context]: unpacks run on autograd's device thread, and the
    # cache must not change which context the training thread has current.
    torch.manual_seed(0)
    model = Net(layers=3, d=256).cuda()
    x = torch.randn(4, 512, 256, device="cuda")
    ref = run(model, x)
    before = torch.cuda.current_device()
    with ebbtide.TensorCache(target="ssd", path=str(tmp_path), adaptive=False) as cache:
        cache.attach(model)
        got = run(model, x, cache.step())
        assert cache.stats()["tensors_offloaded"] > 0
    assert torch.cuda.current_device() == before
    assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))


def test_cuda_checkpoint_round_trip_and_load_in_place(tmp_path):
    from ebbtide import checkpoint as ckpt
    torch.manual_seed(0)
    model = Net(layers=2, d=256).cuda()
    ckpt.save(model.state_dict(), tmp_path / "c")
    other = Net(layers=2, d=256).cuda()
    ptrs = [p.data_ptr() for p in other.parameters()]
    ckpt.load(tmp_path / "c", into=other, device="cuda")  # "cuda" = the current device: read in place
    assert [p.data_ptr() for p in other.parameters()] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    h = ckpt.save(model.state_dict(), tmp_path / "c", async_=True, snapshot="background")
    h.wait()
    out = ckpt.load(tmp_path / "c")
    assert all(v.is_cuda for v in out.values())
    assert all(torch.equal(out[k], v) for k, v in model.state_dict().items())


# Note [Release points], Note [Copy bound]: a long-lived cache plans after its
# profiling step; planned steps give bitwise gradients and never raise the
# activation peak above no offload. Release points free memory in the
# device's order: the compute stream is made to wait for a copy not yet done
# (copy_waits). Whether a copy is done by then depends on the GPU's speed (on
# an H200 every copy had finished before its release point, and an
# assertion on the free-running step failed), so the last step holds the
# compute stream at a StreamGate through its forward: every copy is then
# pending at every release point, on any GPU, and each must be waited for.
@pytest.mark.parametrize("target", ["cpu", "auto"])
def test_cuda_planned_stream_ordered_steps(target, tmp_path):
    torch.manual_seed(0)
    model = Net(layers=8, d=1024).cuda().to(torch.bfloat16)
    x = torch.randn(4, 2048, 1024, device="cuda", dtype=torch.bfloat16)

    def measured(ctx=None, gate=None):
        # Each step from the same start: no gradients allocated, nothing of
        # an earlier step held (the results returned are clones of the
        # gradients; counted from before them they would add a model's size).
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        got = run(model, x, ctx, between=gate and gate.open, before=gate and gate.close)
        return got, torch.cuda.max_memory_allocated() - base

    ref, peak_ref = measured()
    cache = ebbtide.TensorCache(target=target, path=str(tmp_path)).attach(model)
    assert cache.adaptive, "every target is planned on a GPU"
    try:
        for i in range(3):  # profile, then planned steps
            out, peak = measured(cache.step())
            assert torch.equal(out[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(out[1], ref[1]))
            assert peak <= peak_ref * 1.02, f"step {i}: peak {peak} above no offload {peak_ref}"
        assert cache.stats()["measured_bandwidth"]["cpu"]["source"] == "link"
        # The plan's release points during the forward (Note [Release points]:
        # after a block, the offloaded bytes its copies have done by then; 0:
        # none there). Every kernel the gated step queues ran in the steps
        # above (loaded: preload()'s reason).
        releases = [s for s, b in cache._adapt.release_bytes.items() if b != 0]
        gate = StreamGate()
        out, peak = measured(cache.step(), gate)
        assert not gate.forced, "the forward waited on the host for the gated device (a host sync in the hooks)"
        assert torch.equal(out[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(out[1], ref[1]))
        assert peak <= peak_ref * 1.02, f"gated step: peak {peak} above no offload {peak_ref}"
        s = cache.stats()
        if s["bytes_offloaded"] and releases:
            assert s["copy_waits"] > 0, (f"{len(releases)} release points passed with every copy pending and the "
                                         f"compute stream never waited: {s}")
    finally:
        cache.close()


def test_cuda_backward_after_the_offload_block():
    torch.manual_seed(0)
    model = Net(layers=4, d=512).cuda()
    x = torch.randn(4, 512, 512, device="cuda")
    ref = run(model, x)
    model.zero_grad(set_to_none=True)
    with ebbtide.offload(model, target="cpu", min_bytes=0, keep_last_modules=0, adaptive=False) as c:
        loss = model(x)
    loss.backward()
    torch.cuda.synchronize()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ref[1]))
    del loss
    import gc
    gc.collect()
    assert c.closed


def _llama_step(model, ids, ctx=None):
    """One training step of an HF causal LM under `ctx` (a cache step or
    None), attention on SDPA's math kernel: its backward is deterministic,
    which the flash and memory-efficient kernels' are not guaranteed to be."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel
    model.zero_grad(set_to_none=True)
    with sdpa_kernel([SDPBackend.MATH]), (ctx if ctx is not None else contextlib.nullcontext()):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    if ids.is_cuda:
        torch.cuda.synchronize()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _llama(device, attn):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                                   use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=1)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=attn).to(device, torch.bfloat16)
    model.train()
    ids = torch.randint(2, cfg.vocab_size, (2, 512), device=device)
    return model, ids


# The saved-tensor hooks in C++ (Note [Hooks in C++]) on a real HF model: a
# Llama with grouped-query attention, rotary positions and RMSNorm in bf16,
# through every target, everything offloaded (adaptive=False: reloads are
# certain) and planned (the plan may keep everything at this size).
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("target,adaptive", [("cpu", False), ("ssd", False), ("auto", True)])
def test_cuda_hf_llama_bitwise(target, adaptive, attn, tmp_path):
    model, ids = _llama("cuda", attn)
    ref = _llama_step(model, ids)
    again = _llama_step(model, ids)
    assert torch.equal(ref[0], again[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], again[1])), \
        "the step without offloading is not deterministic here, so bitwise comparison means nothing"
    names = [n for n, _ in model.named_parameters()]
    cache = ebbtide.TensorCache(target=target, path=None if target == "cpu" else str(tmp_path),
                                adaptive=adaptive).attach(model)
    try:
        for i in range(3):
            got = _llama_step(model, ids, cache.step())
            assert torch.equal(ref[0], got[0]), f"step {i}: loss {got[0]} != {ref[0]}"
            bad = [n for n, a, b in zip(names, ref[1], got[1]) if not torch.equal(a, b)]
            assert not bad, f"step {i}: gradients differ for {bad[:4]} ({len(bad)} parameters)"
        s = cache.stats()
        if not adaptive:
            assert s["tensors_offloaded"] > 0 and s["bytes_reloaded"] + s["bytes_reused"] == s["bytes_offloaded"], s
    finally:
        cache.close()


# ------------------------------------------------------------------------------
# Issue 28's findings on a real GPU. Helpers first (the subprocess tests import
# them from this module).

_SLEEP_RATE = {}  # device index -> torch.cuda._sleep cycles per second


def sleep_cycles(seconds, device=None):
    """The torch.cuda._sleep argument that keeps a stream of `device` (default:
    the current one) busy for about `seconds`; the rate is measured once per
    device with CUDA events."""
    d = torch.cuda.current_device() if device is None else torch.device(device).index
    d = torch.cuda.current_device() if d is None else d
    if d not in _SLEEP_RATE:
        with torch.cuda.device(d):
            # One launch first: a lazily loaded kernel's first launch loads its
            # module on the host while e0 has already completed, which would
            # count the load as sleep and make every later sleep shorter.
            torch.cuda._sleep(1000)
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            torch.cuda._sleep(20_000_000)
            e1.record()
            e1.synchronize()
            _SLEEP_RATE[d] = 20_000_000 / max(e0.elapsed_time(e1) / 1e3, 1e-6)
    return int(seconds * _SLEEP_RATE[d])


class StreamGate:
    """A gate on a CUDA stream. Work queued on the stream after close() runs
    only once open() is called from the host: the stream waits, with
    cuStreamWaitValue32, for a page-locked host word to become 1. Tests that
    need "the GPU is still busy when the host gets here" close a gate rather
    than queue a long kernel, whose length depends on the GPU's speed.
    A watchdog opens the gate after `watchdog` seconds, so a host that waits
    for the gated work (the defect a test looks for) does not hang the test;
    `forced` then says the host waited.
    Every kernel queued behind a closed gate must have been launched once
    before (preload()): under CUDA lazy loading (the default since CUDA 12.2)
    a kernel's first launch in a process loads it, and the load may
    synchronize the context, so the host would wait for the gate right there,
    in the launch, whatever the code under test does."""

    def __init__(self, watchdog=60.0):
        import ctypes
        self._ct = ctypes
        self._lib = ctypes.CDLL("libcuda.so.1")
        self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        dptr = ctypes.c_uint64()
        rc = self._lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(self.flag.data_ptr()), 0)
        # Unified addressing: a page-locked host pointer is its own device address.
        self._addr = dptr.value if rc == 0 else self.flag.data_ptr()
        self._timer = threading.Timer(watchdog, self._force)
        self._timer.daemon = True
        self.forced = False

    def _force(self):
        self.forced = True
        self.open()

    def close(self, stream=None):
        """Queues the wait on `stream` (default: the current stream)."""
        ct = self._ct
        s = stream if stream is not None else torch.cuda.current_stream()
        fn = getattr(self._lib, "cuStreamWaitValue32_v2", None) or self._lib.cuStreamWaitValue32
        fn.argtypes = [ct.c_void_p, ct.c_uint64, ct.c_uint32, ct.c_uint]
        rc = fn(ct.c_void_p(s.cuda_stream), ct.c_uint64(self._addr), ct.c_uint32(1), ct.c_uint(0))  # GEQ
        if rc != 0:
            pytest.fail(f"cuStreamWaitValue32 returned CUresult {rc}: this driver or device cannot gate a stream "
                        "on a host word (CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1)")
        self._timer.start()
        return self

    def open(self):
        self.flag.fill_(1)
        self._timer.cancel()


def preload(*fns):
    """Runs each of `fns` once, then waits for the current device: the kernels
    they launch are loaded before a test queues them behind a closed
    StreamGate or a long kernel. A lazily loaded kernel's first launch may
    synchronize the context (CUDA programming guide, Lazy Loading, "Potential
    Hazards"): queued behind a gate the host would wait until the watchdog
    opens it, behind a sleep until the sleep ends, and the test would see an
    idle GPU however the code under test behaves. A kernel is one
    instantiation (dtype, vector width from the pointers' alignment): run the
    same operation on tensors like the real ones (clones, empty_like), in
    each device's context."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()


def same(a, b):
    """Two run() results (loss, gradients) equal bit for bit."""
    return torch.equal(a[0], b[0]) and len(a[1]) == len(b[1]) and all(torch.equal(u, v) for u, v in zip(a[1], b[1]))


def result_of(model, loss):
    """run()'s result, (loss, gradients), of a step run by hand."""
    torch.cuda.synchronize()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def offload_all(target, tmp_path=None, **kw):
    """A cache that offloads every saved activation (not planned, nothing kept
    resident): every tensor backward needs is reloaded."""
    return ebbtide.TensorCache(target=target, path=str(tmp_path) if target != "cpu" else None, adaptive=False,
                               min_bytes=0, keep_last_modules=0, **kw)


def stat(cache, name):
    """A counter of the cache's statistics, wherever stats() carries it: the
    step's (the core's stats()["step"], flattened into stats()), the total,
    or the store's (the core's top level)."""
    s = cache.stats()
    core = cache._core.stats()
    for where in (s, s.get("total", {}), core.get("step", {}), core):
        if name in where:
            return where[name]
    pytest.fail(f"the cache's stats() has no {name!r}: the core or the glue does not count it")


def saved_storage_bytes(model, x):
    """The sizes of the distinct storages one forward of `model` saves for
    backward, parameters excluded (identity saved-tensor hooks)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x)
    del loss
    return sorted(seen.values(), reverse=True)


def fill_fresh(sizes, value=7.0):
    """Two tensors of each byte size, allocated now and filled with `value` on
    the current stream: the caching allocator hands out what was freed last,
    so they take the memory the cache just gave up."""
    return [torch.full((n // 4,), value, device="cuda") for n in sizes for _ in range(2)]


def assert_untouched(fresh, value=7.0):
    torch.cuda.synchronize()
    bad = [i for i, f in enumerate(fresh) if not bool((f == value).all())]
    assert not bad, (f"{len(bad)} of {len(fresh)} tensors allocated after the cache dropped its buffers were "
                     "overwritten: a copy was still landing in memory the cache had given back")


def run_script(code, env=None, timeout=300):
    """Runs `code` in a fresh Python (this module importable as test_cache_cuda);
    fails the test with its output unless it exits 0. Returns its stdout."""
    p = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r})\n" + textwrap.dedent(code)],
                       capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {})))
    assert p.returncode == 0, f"the script exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p.stdout


class RaiseInBackward(torch.autograd.Function):
    """Identity in forward. Armed (with torch.cuda._sleep cycles), its backward
    first keeps the stream busy, so reloads queued behind it are still
    pending, then raises."""

    armed = None

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        if RaiseInBackward.armed is not None:
            torch.cuda._sleep(RaiseInBackward.armed)
            raise ArithmeticError("boom in backward")
        return g


class RaiseNet(Net):
    """Net with RaiseInBackward after its second block: backward raises (when
    armed) once the last blocks' gradients are done and earlier blocks'
    reloads are under way."""

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            x = b(x)
            if i == 1:
                x = RaiseInBackward.apply(x)
        return x.float().pow(2).mean()


class ExpertBlock(Block):
    """A Block whose MLP runs on a side stream, as a mixture of experts'
    dispatch and experts do: what the MLP saves is allocated on, and freed to,
    the side stream's pool. Each forward first fills a receive buffer on the
    side stream without waiting for the compute stream (an all-to-all's
    buffer), which takes at once any side-stream memory freed so far."""

    def __init__(self, d, side):
        super().__init__(d)
        self.side = side

    def forward(self, x):
        cur = torch.cuda.current_stream()
        with torch.cuda.stream(self.side):
            torch.empty(x.shape[:-1] + (4 * x.shape[-1],), device=x.device).fill_(1.0)
        h = self.n(x)
        self.side.wait_stream(cur)
        with torch.cuda.stream(self.side):
            y = self.b(torch.nn.functional.gelu(self.a(h)))
        cur.wait_stream(self.side)
        h.record_stream(self.side)
        y.record_stream(cur)
        return x + y


def expert_net(layers, d):
    net = Net(layers=0, d=d)
    side = torch.cuda.Stream()
    net.blocks = torch.nn.ModuleList(ExpertBlock(d, side) for _ in range(layers))
    return net


class MlpBlock(torch.nn.Module):
    """Block with its MLP as one submodule (no hooks of the cache's on it), so
    torch.cuda.make_graphed_callables can take it."""

    def __init__(self, d):
        super().__init__()
        self.n = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.mlp(self.n(x))


def mlp_net(layers, d):
    net = Net(layers=0, d=d)
    net.blocks = torch.nn.ModuleList(MlpBlock(d) for _ in range(layers))
    return net


def on_side_stream(fn, *args):
    """fn(*args) with a new stream current (joined with the current one before and after)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return out


# Finding 1: reload buffers dropped while their host-to-device copy may be
# pending. phase("backward") starts the reloads, and the step ends without a
# backward: the graph (and the buffers) go while the loads wait behind a long
# kernel on the compute stream (delay) or run at once (no delay). Memory
# allocated right after must keep what is written into it, and the next
