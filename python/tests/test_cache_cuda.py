"""The tensor cache on a CUDA device (skipped without one): bitwise equality,
side-stream ordering under a busy compute stream, and device memory savings."""
import pytest
import torch

import ebbtide
from ebbtide import _core

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and _core.cuda_driver_available()),
                                reason="needs a CUDA device and driver")


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


def run(model, x, ctx=None, between=None):
    model.zero_grad(set_to_none=True)
    if ctx is None:
        loss = model(x)
        loss.backward()
    else:
        with ctx:
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
# profiling step; planned steps give bitwise gradients, release memory in the
# device's order (copy_waits > 0 once something is offloaded) and never raise
# the activation peak above no offload.
@pytest.mark.parametrize("target", ["cpu", "auto"])
def test_cuda_planned_stream_ordered_steps(target, tmp_path):
    torch.manual_seed(0)
    model = Net(layers=8, d=1024).cuda().to(torch.bfloat16)
    x = torch.randn(4, 2048, 1024, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ref = run(model, x)
    peak_ref = torch.cuda.max_memory_allocated() - base
    cache = ebbtide.TensorCache(target=target, path=str(tmp_path)).attach(model)
    assert cache.adaptive, "every target is planned on a GPU"
    try:
        for i in range(3):  # profile, then planned steps
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            out = run(model, x, cache.step())
            peak = torch.cuda.max_memory_allocated() - base
            assert torch.equal(out[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(out[1], ref[1]))
            s = cache.stats()
            assert peak <= peak_ref * 1.02, f"step {i}: peak {peak} above no offload {peak_ref}"
        assert s["measured_bandwidth"]["cpu"]["source"] == "link"
        if s["bytes_offloaded"]:
            assert s["copy_waits"] > 0
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
