"""DeepSpeed pipeline hints, tested against DeepSpeed's own TrainSchedule.

DeepSpeed's PipelineEngine needs deepspeed.initialize and a process group per
stage, which this CPU machine cannot run; the test plays DeepSpeed's real
instruction schedule (deepspeed.runtime.pipe.schedule.TrainSchedule) for a
2-stage split of a tiny GPT-2 in one process, stage 0 through the instruction
map ebbtide hands the engine (hinted_instruction_map) with a TensorCache.
Stage 0 runs several forwards before their backwards; after 3 optimizer steps
the parameters are bitwise those of the same schedule without offloading.
torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B, and a real
DeepSpeed PipelineEngine through offload_deepspeed_pipeline, run on one
stage (gloo, world size 1); its multi-stage schedules (interleaved 1F1B, zero
bubble) run both stages on that one rank, sharing one cache.
"""
import collections
import gc
import weakref

import pytest
import torch

schedule = pytest.importorskip("deepspeed.runtime.pipe.schedule")
transformers = pytest.importorskip("transformers")

from integration_models import (VOCAB, assert_changed, assert_same_params, deepspeed_pipeline_engine,  # noqa: E402
                                one_rank_deepspeed, token_rows)

import ebbtide  # noqa: E402
from ebbtide.integrations.pipeline import PipelineHints, hinted_instruction_map  # noqa: E402


# Offloaded bytes are asserted: stores finish before backward whatever the load.
pytestmark = pytest.mark.usefixtures("stores_before_backward")


def _stages():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    t = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager").transformer

    class First(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe, self.h = t.wte, t.wpe, torch.nn.ModuleList([t.h[0]])

        def forward(self, ids):
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
            x = self.h[0](x)
            return x[0] if isinstance(x, tuple) else x

    class Last(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.h, self.ln_f = torch.nn.ModuleList([t.h[1]]), t.ln_f
            self.head = torch.nn.Linear(32, VOCAB, bias=False)

        def forward(self, x):
            x = self.h[0](x)
            return self.head(self.ln_f(x[0] if isinstance(x, tuple) else x))

    return First(), Last()


class _Stage:
    """Executes one stage's DeepSpeed instructions (what PipelineEngine's
    _exec_* methods do, with the wire between stages replaced by queues)."""

    def __init__(self, module, stage_id, n_mb, wire, data):
        self.module, self.stage_id, self.n_mb, self.wire, self.data = module, stage_id, n_mb, wire, data
        self.opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
        self.loaded, self.inputs, self.outputs, self.loss = {}, {}, {}, {}
        self.next_mb = 0

    def load_micro_batch(self, buffer_id):
        self.loaded[buffer_id] = self.data[self.next_mb]
        self.next_mb += 1

    def forward_pass(self, buffer_id):
        if self.stage_id == 0:
            out = self.module(self.loaded[buffer_id])
            self.outputs[buffer_id] = out
            self.wire["act"].append(out.detach())
        else:
            x = self.wire["act"].popleft().requires_grad_()
            self.inputs[buffer_id] = x
            logits = self.module(x)
            ids = self.loaded[buffer_id]
            self.loss[buffer_id] = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()) / self.n_mb

    def backward_pass(self, buffer_id):
        if self.stage_id == 0:
            torch.autograd.backward(self.outputs.pop(buffer_id), self.wire["grad"].popleft())
        else:
            self.loss.pop(buffer_id).backward()
            self.wire["grad"].append(self.inputs.pop(buffer_id).grad)

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    instruction_map = {schedule.LoadMicroBatch: load_micro_batch, schedule.ForwardPass: forward_pass,
                       schedule.BackwardPass: backward_pass, schedule.OptimizerStep: optimizer_step}


def _train(n_mb, cache=None):
    """3 optimizer steps of DeepSpeed's TrainSchedule on 2 stages; stage 0
    through ebbtide's hinted instruction map when `cache` is given."""
    first, last = _stages()
    if cache is not None:
        cache.attach(first)
    wire = {"act": collections.deque(), "grad": collections.deque()}
    rows = token_rows(3 * n_mb * 2)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (first, last)]
    maps = [_Stage.instruction_map, _Stage.instruction_map]
    hints = None
    if cache is not None:
        hints = PipelineHints(cache)
        maps[0] = hinted_instruction_map(_Stage.instruction_map, hints)
    order = []  # stage 0's (instruction, micro-batch id the hints gave)
    for step in range(3):
        data = [rows[(step * n_mb + i) * 2:(step * n_mb + i + 1) * 2] for i in range(n_mb)]
        stages = [_Stage(first, 0, n_mb, wire, data), _Stage(last, 1, n_mb, wire, data)]
        for s, opt in zip(stages, opts):
            s.opt = opt
        clocks = [list(schedule.TrainSchedule(micro_batches=n_mb, stages=2, stage_id=i)) for i in range(2)]
        with cache.step() if cache is not None else torch.enable_grad():
            for cmds0, cmds1 in zip(*clocks):
                for cmd in cmds0:
                    if type(cmd) in maps[0]:
                        maps[0][type(cmd)](stages[0], **cmd.kwargs)
                        if hints is not None and isinstance(cmd, (schedule.ForwardPass, schedule.BackwardPass)):
                            order.append((type(cmd).__name__, hints._by_key[cmd.buffer_id]))
                # Stage 1 is another rank under DeepSpeed: its saves must not reach stage 0's cache.
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    for cmd in cmds1:
                        if type(cmd) in maps[1]:
                            maps[1][type(cmd)](stages[1], **cmd.kwargs)
    return (first, last), order


@pytest.mark.parametrize("n_mb", [2, 4])
def test_deepspeed_train_schedule_hints_bitwise(n_mb):
    ref, _ = _train(n_mb)
    with ebbtide.TensorCache(target="cpu", min_bytes=0, keep_last_modules=0) as cache:
        got, order = _train(n_mb, cache)
        assert cache.stats()["steps"] == 3
        assert cache.stats()["total"]["bytes_offloaded"] > 0
    for a, b in zip(got, ref):
        assert_same_params(a, b)
    assert_changed(got[0], _stages()[0])
    # Several forwards precede their backwards, and each backward was hinted
    # with its own forward's micro-batch (stage 0 runs them in the same order).
    fwd = [mb for kind, mb in order if kind == "ForwardPass"]
    bwd = [mb for kind, mb in order if kind == "BackwardPass"]
    assert [k for k, _ in order[:2]] == ["ForwardPass", "ForwardPass"]
    assert fwd == bwd and len(set(fwd)) == 3 * n_mb


def test_backward_hint_without_forward_names_the_buffer():
    with ebbtide.TensorCache(target="cpu") as cache:
        with pytest.raises(RuntimeError, match="no forward into buffer 1"):
            PipelineHints(cache).backward(1)


def _torch_pipeline(hinted, schedule_name):
    """3 steps of a torch.distributed.pipelining schedule, 2 micro-batches
    each, on one stage in this process (gloo, world size 1)."""
    from torch.distributed import pipelining

    first, last = _stages()
    module = torch.nn.Sequential(first, last)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    stage = pipelining.PipelineStage(module, 0, 1, torch.device("cpu"))
    cache, order = None, []
    if hinted:
        from ebbtide.integrations.pipeline import hint_torch_pipeline_stage

        cache = ebbtide.TensorCache(target="cpu", min_bytes=0, keep_last_modules=0).attach(module)
        _record_hints(hint_torch_pipeline_stage(stage, cache), order)
    _run_schedule(getattr(pipelining, schedule_name)(stage, n_microbatches=2, loss_fn=_lm_loss), 2, opt, cache)
    return module, cache, order


def _record_hints(hints, order):
    """Makes `hints` append (kind, key, micro-batch id) to `order` for every hint it gives."""
    for name in ("forward", "backward"):
        def record(key, _f=getattr(hints, name), _n=name):
            mb = _f(key)
            order.append((_n, key, mb))
            return mb
        setattr(hints, name, record)


def _run_schedule(sched, n_mb, opt, cache):
    """3 optimizer steps of `sched` over batches of n_mb micro-batches of 2 rows, each in a cache step."""
    rows = token_rows(3 * n_mb * 2)
    for step in range(3):
        batch = rows[step * n_mb * 2:(step + 1) * n_mb * 2]
        with cache.step() if cache is not None else torch.enable_grad():
            sched.step(batch, target=batch)
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("schedule_name", ["ScheduleGPipe", "Schedule1F1B"])
def test_torch_pipelining_hints_bitwise(one_rank_group, schedule_name):
    ref, _, _ = _torch_pipeline(False, schedule_name)
    got, cache, order = _torch_pipeline(True, schedule_name)
    try:
        assert cache.stats()["total"]["bytes_offloaded"] > 0
    finally:
        cache.close()
    assert_same_params(got, ref)
    assert_changed(got, torch.nn.Sequential(*_stages()))
    fwd = [mb for kind, _, mb in order if kind == "forward"]
    bwd = [mb for kind, _, mb in order if kind == "backward"]
    assert len(set(fwd)) == 6 and sorted(bwd) == sorted(fwd)
    if schedule_name == "ScheduleGPipe":  # every forward of a step before its backwards
        assert [k for k, _, _ in order[:2]] == ["forward", "forward"]


MULTI_STAGE = ["ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"]


def _torch_pipeline_two_stages(hinted, schedule_name, keep_last_modules=0):
    """3 steps of a multi-stage torch.distributed.pipelining schedule, 4
    micro-batches each, with both stages of the GPT-2 split on this one rank
    (gloo, world size 1), sharing one cache when `hinted`."""
    from torch.distributed import pipelining

    from ebbtide.integrations.pipeline import hint_torch_pipeline_stages

    modules = _stages()
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-2)
    stages = [pipelining.PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(modules)]
    cache, order = None, []
    if hinted:
        cache = ebbtide.TensorCache(target="cpu", min_bytes=0, keep_last_modules=keep_last_modules)
        _record_hints(hint_torch_pipeline_stages(stages, cache), order)
    _run_schedule(getattr(pipelining, schedule_name)(stages, n_microbatches=4, loss_fn=_lm_loss), 4, opt, cache)
    return torch.nn.ModuleList(modules), cache, order


@pytest.mark.parametrize("schedule_name", MULTI_STAGE)
def test_torch_pipelining_two_stages_per_rank_share_one_cache_bitwise(one_rank_group, schedule_name):
    from torch.distributed import pipelining

    if not hasattr(pipelining, schedule_name):
        pytest.skip(f"this torch has no {schedule_name}")
    ref, _, _ = _torch_pipeline_two_stages(False, schedule_name)
    got, cache, order = _torch_pipeline_two_stages(True, schedule_name)
    try:
        plan = cache.plan()
        assert cache.stats()["total"]["bytes_offloaded"] > 0
    finally:
        cache.close()
    assert_same_params(got, ref)
    assert_changed(got, torch.nn.ModuleList(_stages()))
    # Each stage forward is a micro-batch of its own, and every backward
    # (zero bubble: input and weight backward) names its forward's.
    fwd = {}
    for kind, key, mb in order:
        if kind == "forward":
            fwd[key] = mb
        else:
            assert fwd[key] == mb, (key, mb, fwd[key])
    assert len({mb for kind, _, mb in order if kind == "forward"}) == 3 * 2 * 4
    assert [(p["scope"], p["module"]) for p in plan] == [(0, "0"), (1, "1")]


def test_torch_pipelining_shared_cache_keeps_the_last_stage(one_rank_group):
    ref, _, _ = _torch_pipeline_two_stages(False, "ScheduleInterleaved1F1B")
    got, cache, _ = _torch_pipeline_two_stages(True, "ScheduleInterleaved1F1B", keep_last_modules=1)
    try:
        plan = cache.plan()
    finally:
        cache.close()
    assert_same_params(got, ref)
    assert [p["decision"] for p in plan] == ["offload", "keep"]
    assert plan[0]["bytes_offloaded"] > 0 and plan[1]["bytes_offloaded"] == 0


def test_torch_pipelining_shared_cache_must_be_unattached():
    from ebbtide.integrations.pipeline import hint_torch_pipeline_stages

    with ebbtide.TensorCache(target="cpu") as cache:
        cache.attach(torch.nn.Linear(2, 2))
        with pytest.raises(RuntimeError, match="already attached"):
            hint_torch_pipeline_stages([], cache)
        with pytest.raises(TypeError, match="not a torch.distributed.pipelining stage"):
            hint_torch_pipeline_stages([object()], cache)


def _lm_loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _deepspeed_engine_run(offload):
    """3 train_batch calls of a real DeepSpeed PipelineEngine (one stage, 2
    micro-batches each) over the GPT-2 split's two parts as its layers."""
    from ebbtide.integrations.pipeline import offload_deepspeed_pipeline, restore_deepspeed_pipeline

    first, last = _stages()
    engine = deepspeed_pipeline_engine([first, last], _lm_loss)
    cache = offload_deepspeed_pipeline(engine, target="cpu", min_bytes=0, keep_last_modules=0) if offload else None
    rows = token_rows(12)
    it = iter([(rows[i * 2:(i + 1) * 2], rows[i * 2:(i + 1) * 2]) for i in range(6)])
    for _ in range(3):
        engine.train_batch(it)
    if offload:
        with pytest.raises(RuntimeError, match="already offloads"):
            offload_deepspeed_pipeline(engine, cache=cache)
        # DeepSpeed's parameter hooks keep the engine alive to the end of the
        # process: let go of the cache.
        restore_deepspeed_pipeline(engine)
        assert "train_batch" not in vars(engine) and "_INSTRUCTION_MAP" not in vars(engine)
    return engine.module, cache


def test_deepspeed_pipeline_engine_bitwise(monkeypatch):
    pytest.importorskip("deepspeed.pipe")
    with one_rank_deepspeed(monkeypatch):
        ref, _ = _deepspeed_engine_run(False)
        got, cache = _deepspeed_engine_run(True)
    try:
        assert cache.stats()["steps"] == 3  # one cache step per train_batch
        assert cache.stats()["total"]["bytes_offloaded"] > 0
    finally:
        cache.close()
    assert_same_params(got, ref)
    assert_changed(got, torch.nn.Sequential(*_stages()))
    gone = weakref.ref(cache)
    del cache
    gc.collect()
    assert gone() is None, "the engine still holds the cache after restore_deepspeed_pipeline"


def test_deepspeed_two_stage_engine_bitwise(tmp_path):
    """A real 2-stage PipelineEngine under torchrun (2 gloo ranks): each stage
    runs up to 2 forwards before their backwards (1F1B), with hints."""
    import os
    import subprocess
    import sys

    pytest.importorskip("deepspeed.pipe")
    script = os.path.join(os.path.dirname(__file__), "deepspeed_two_stages.py")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        script, str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, f"deepspeed_two_stages.py exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    for rank in (0, 1):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["steps"] == 3 and r["bytes_offloaded"] > 0, (rank, r["steps"], r["bytes_offloaded"])
        assert r["ref"].keys() == r["got"].keys() and r["ref"]
        diff = [n for n in r["ref"] if not torch.equal(r["ref"][n], r["got"][n])]
        assert not diff, f"rank {rank}: parameters differ from the run without offloading: {diff}"
