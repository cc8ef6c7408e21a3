"""Activation budgets in the tensor cache (issue 29): the planner's mix of
keep, offload and recompute applied per block (Notes [Budget plan] and
[Recompute by the cache]); gradients bitwise equal to the run without
ebbtide for every placement, with dropout, HF Llama and MoE models, blocks
compiled one by one and FSDP2 on gloo; the budget met; an infeasible budget
named at the first step; blocks the user checkpoints left alone. The
planner's choices for given measurements are tested in C++
(cpp/tests/test_plan_planner.cpp, PlanBudget)."""
import os
import sys

import pytest
import torch

import ebbtide
from ebbtide import _core
from ebbtide.cache import adaptive as _adaptive
from ebbtide.plan import planner

pytestmark = pytest.mark.skipif(not _core.build_info.get("cache_ssd", False),
                                reason="storage engine not in this build")

MiB = 1 << 20


class Block(torch.nn.Module):
    def __init__(self, d, p=0.1):
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


class Net(torch.nn.Module):
    def __init__(self, layers=6, d=128, p=0.1):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d, p) for _ in range(layers))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).sum()


def make_net(layers=6, d=128, p=0.1):
    torch.manual_seed(0)
    return Net(layers, d, p)


def run(model, inputs, cache=None, steps=3, loss=None):
    """Gradients of `steps` steps (seeded per step, so dropout draws match)."""
    loss = loss or (lambda m, x: m(x))
    out = []
    for i in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + i)
        if cache is None:
            loss(model, inputs).backward()
        else:
            with cache.step():
                loss(model, inputs).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for step, (ga, gb) in enumerate(zip(a, b)):
        for i, (x, y) in enumerate(zip(ga, gb)):
            assert torch.equal(x, y), f"step {step}: gradient {i} differs from the run without ebbtide"


def force(monkeypatch, choose):
    """Makes every plan the replay of `choose(modules)` (one placement per
    module), so a test fixes the placements the measured times would pick."""
    real = planner.plan_offload

    def plan(modules, write_bps, read_bps, **kw):
        modules = list(modules)
        forced = planner.simulate(modules, choose(modules), write_bps, read_bps, **kw)
        forced.update(activation_budget_bytes=kw.get("activation_budget_bytes", 0), feasible=True)
        real(modules, write_bps, read_bps, **kw)  # the real one must accept the same profile
        return forced

    monkeypatch.setattr(_adaptive.planner, "plan_offload", plan)


def cache_for(tmp_path, **kw):
    if "activation_budget_bytes" not in kw:
        kw["activation_budget_bytes"] = 1 << 40
    return ebbtide.TensorCache("ssd", str(tmp_path), min_bytes=0, **kw)


def forced_run(tmp_path, monkeypatch, build, inputs, which, loss=None):
    """Gradients of `build()` without ebbtide, then with the placements of
    PLACEMENT_SETS[which] forced: (reference, got, stats, profiled modules)."""
    ref = run(build(), inputs, loss=loss)
    force(monkeypatch, PLACEMENT_SETS[which])
    model = build()
    with cache_for(tmp_path, keep_last_modules=0).attach(model) as cache:
        got = run(model, inputs, cache, loss=loss)
        return ref, got, cache.stats(), cache._adapt.profile_modules


PLACEMENT_SETS = {
    "recompute": lambda ms: ["recompute" if m.get("recomputable") else "keep" for m in ms],
    "recompute_offload": lambda ms: ["recompute_offload_ssd" if m.get("recomputable") else "keep" for m in ms],
    "mix": lambda ms: [("keep", "offload_ssd", "recompute", "recompute_offload_ssd")[i % 4]
                       if m.get("recomputable") else "keep" for i, m in enumerate(ms)],
}


@pytest.mark.parametrize("which", sorted(PLACEMENT_SETS))
def test_each_placement_is_bitwise_with_dropout(tmp_path, monkeypatch, which):
    x = torch.randn(64, 128)
    ref = run(make_net(), x)
    force(monkeypatch, PLACEMENT_SETS[which])
    model = make_net()
    cache = cache_for(tmp_path, keep_last_modules=0).attach(model)
    got = run(model, x, cache, steps=4)
    st = cache.stats()
    cache.close()
    assert_bitwise(got[1:], run(make_net(), x, steps=4)[1:])
    assert_bitwise(got[:3], ref)
    placements = [m["placement"] for m in st["planner"]["modules"]]
    assert "recompute" in placements or "recompute_offload" in placements
    assert st["recomputed_blocks"], st["recomputed_blocks"]
    if which == "recompute_offload":
        assert st["bytes_offloaded"] > 0
    # The wrappers go with the cache.
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_recompute_saves_only_the_block_inputs(tmp_path, monkeypatch):
    force(monkeypatch, PLACEMENT_SETS["recompute"])
    model = make_net(layers=4)
    x = torch.randn(64, 128)
    with cache_for(tmp_path, keep_last_modules=0).attach(model) as cache:
        run(model, x, cache, steps=1)
        profiled = cache.stats()["saved_bytes_total"]
        run(model, x, cache, steps=1)
        st = cache.stats()
    # Each block saves its 64x128 fp32 input alone, plus what the head saves.
    assert st["saved_bytes_total"] < profiled / 3, (st["saved_bytes_total"], profiled)
    blocks = [m for m in st["planner"]["modules"] if m["placement"] == "recompute"]
    assert len(blocks) == 4
    for m in blocks:
        assert m["saved_bytes"] >= 64 * 128 * 4


def test_planned_budget_recomputes_when_the_link_cannot_carry_it(tmp_path):
    """A 1 MB/s SSD hides nothing: a budget below keep-all is met by recompute."""
    x = torch.randn(256, 256)
    keep_all = 6 * 256 * 256 * 4 * 4  # about what 6 blocks save (4 tensors of 256x256 each)
    model = make_net(d=256)
    cache = cache_for(tmp_path, activation_budget_bytes=keep_all // 2, max_write_mbps=1).attach(model)
    got = run(model, x, cache, steps=3)
    st = cache.stats()
    plan = st["planner"]
    cache.close()
    assert_bitwise(got, run(make_net(d=256), x, steps=3))
    assert plan["feasible"]
    assert plan["modules_recomputed"] >= 1
    assert plan["peak_resident_bytes"] <= keep_all // 2
    # The budget holds for the steps after the profile (5% for what the plan
    # does not see: saves below min_bytes, the head).
    assert st["peak_resident_bytes"] <= 1.05 * (keep_all // 2), (st["peak_resident_bytes"], keep_all // 2)


def test_budget_above_the_keep_all_peak_changes_nothing(tmp_path):
    model = make_net()
    x = torch.randn(64, 128)
    with cache_for(tmp_path, activation_budget_bytes=1 << 40, max_write_mbps=1).attach(model) as cache:
        run(model, x, cache, steps=2)
        st = cache.stats()
    assert st["planner"]["modules_recomputed"] == 0
    assert st["recomputed_blocks"] == []


def test_infeasible_budget_is_named_at_the_first_step(tmp_path):
    model = make_net()
    x = torch.randn(64, 128)
    cache = cache_for(tmp_path, activation_budget_bytes=1024).attach(model)
    with pytest.raises(ValueError, match=r"activation budget 1\.0 KiB \(1024 bytes\) cannot be met: the smallest "
                                         r"peak .* is .* \((\d+) bytes;") as err:
        run(model, x, cache, steps=1)
    import re
    smallest = int(re.search(r"\((\d+) bytes;", str(err.value)).group(1))
    assert smallest > 1024
    assert cache.stats()["planner"]["feasible"] is False
    cache.close()
    # That budget fits.
    model = make_net()
    with cache_for(tmp_path, activation_budget_bytes=smallest).attach(model) as cache:
        run(model, x, cache, steps=2)
        assert cache.stats()["planner"]["feasible"]


def test_budget_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("EBBTIDE_ACTIVATION_BUDGET", "64MiB")
    with ebbtide.TensorCache("ssd", str(tmp_path)) as cache:
        assert cache.adaptive
        assert cache._adapt.budgets.activation == 64 * MiB
    with pytest.raises(ValueError, match="EBBTIDE_ACTIVATION_BUDGET=67108864 needs the planner, but adaptive=False"):
        ebbtide.TensorCache("ssd", str(tmp_path), adaptive=False)
    monkeypatch.setenv("EBBTIDE_ACTIVATION_BUDGET", "lots")
    with pytest.raises(ValueError, match="EBBTIDE_ACTIVATION_BUDGET"):
        ebbtide.TensorCache("ssd", str(tmp_path))
    monkeypatch.delenv("EBBTIDE_ACTIVATION_BUDGET")
    with pytest.raises(ValueError, match="activation_budget_bytes"):
        ebbtide.TensorCache("ssd", str(tmp_path), activation_budget_bytes=-1)
    with ebbtide.TensorCache("ssd", str(tmp_path)) as cache:
        assert cache._adapt is None  # no budget: target "ssd" stays non-adaptive


def test_offload_context_takes_the_budget(tmp_path):
    model = make_net()
    x = torch.randn(64, 128)
    with ebbtide.offload(model, "ssd", str(tmp_path), activation_budget_bytes=1 << 30) as cache:
        model(x).backward()
    assert cache.stats()["activation_budget_bytes"] == 1 << 30


def lm_loss(m, x):
    return m(input_ids=x, labels=x).loss


def assert_hf_bitwise_under_mix(tmp_path, monkeypatch, build, seed):
    """An HF causal LM's gradients under the forced mix equal those without ebbtide."""
    ids = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(seed))
    ref, got, st, _ = forced_run(tmp_path, monkeypatch, build, ids, "mix", loss=lm_loss)
    assert st["recomputed_blocks"]
    assert_bitwise(got, ref)


def test_hf_llama_with_dropout_bitwise(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")

    def llama():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       attention_dropout=0.1)
        m = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
        m.train()
        return m

    assert_hf_bitwise_under_mix(tmp_path, monkeypatch, llama, seed=1)


def test_user_checkpointed_blocks_are_not_wrapped_again(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from integration_models import tiny_llama

    from ebbtide.harness.models import enable_hf_recompute

    force(monkeypatch, PLACEMENT_SETS["recompute"])
    ids = torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(1))

    loss = lm_loss
    for reentrant in (False, True):
        kwargs = {"use_reentrant": reentrant}
        ref_model = tiny_llama()
        enable_hf_recompute(ref_model, reentrant)
        ref = run(ref_model, ids, loss=loss)
        model = tiny_llama()
        enable_hf_recompute(model, reentrant)
        with cache_for(tmp_path, keep_last_modules=0).attach(model) as cache:
            got = run(model, ids, cache, loss=loss)
            assert cache.stats()["recomputed_blocks"] == [], kwargs
            assert all("forward" not in layer.__dict__ for layer in model.model.layers)
        assert_bitwise(got, ref)

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    model = make_net()
    for i, b in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(b)
    x = torch.randn(64, 128)
    with cache_for(tmp_path, keep_last_modules=0).attach(model) as cache:
        run(model, x, cache, steps=2)
        assert cache.stats()["recomputed_blocks"] == []


def test_moe_bitwise(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")

    def moe():
        torch.manual_seed(0)
        cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2, max_position_embeddings=64)
        return transformers.MixtralForCausalLM._from_config(cfg, attn_implementation="eager")

    assert_hf_bitwise_under_mix(tmp_path, monkeypatch, moe, seed=2)


def test_blocks_compiled_one_by_one(tmp_path, monkeypatch):
    def compiled():
        m = make_net(layers=3, p=0.0)
        for b in m.blocks:
            b.compile(backend="aot_eager")
        return m

    ref, got, st, _ = forced_run(tmp_path, monkeypatch, compiled, torch.randn(32, 128), "mix")
    assert st["recomputed_blocks"]
    assert_bitwise(got, ref)


def test_pipeline_stages_are_never_recomputed(tmp_path):
    model = make_net()
    x = torch.randn(64, 128)
    with cache_for(tmp_path, activation_budget_bytes=1 << 40, max_write_mbps=1) as cache:
        cache.attach_stages(list(model.blocks))
        for _ in range(2):
            with cache.step():
                h = x
                for b in model.blocks:
                    h = b(h)
                model.head(h).sum().backward()
        mods = cache.stats()["planner"]["modules"]
    assert all(not m["placement"].startswith("recompute") for m in mods)




@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
def test_data_parallel_on_gloo_bitwise(tmp_path, mode):
    """FSDP2 and DDP on 2 gloo ranks: every placement (keep, offload,
    recompute, recompute_offload) gives each rank the gradients it gets
    without ebbtide, bit for bit."""
    import subprocess
    if mode == "fsdp2":
        pytest.importorskip("torch.distributed.fsdp")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "budget_fsdp_ranks.py")
    out = tmp_path / "result"
    r = subprocess.run([sys.executable, script, f"file://{tmp_path}/init", str(out), mode], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in range(2):
        same, recomputed, *diff = (tmp_path / f"result.{rank}").read_text().split(" ", 2)
        assert same == "1", f"rank {rank}: gradients differ from {mode} without ebbtide: {diff}"
        assert int(recomputed) > 0


def test_predict_answers_for_other_budgets(tmp_path):
    model = make_net()
    x = torch.randn(64, 128)
    with cache_for(tmp_path, activation_budget_bytes=None, adaptive=True, max_write_mbps=1).attach(model) as cache:
        with pytest.raises(RuntimeError, match="no profiling step has run yet"):
            cache.predict(1 << 20)
        run(model, x, cache, steps=1)
        free = cache.predict(0)
        smallest = cache.predict(1)
        assert not smallest["feasible"]
        fits = cache.predict(smallest["min_budget_bytes"])
        with pytest.raises(ValueError, match="activation_budget_bytes"):
            cache.predict(-5)
    assert free["modules_recomputed"] == 0
    assert fits["feasible"] and fits["peak_resident_bytes"] <= smallest["min_budget_bytes"]
    assert fits["modules_recomputed"] > 0


class KeywordNet(Net):
    """Calls its blocks with keyword tensors only (a review finding: torch's
    checkpoint saves, and restores the RNG of, positional tensors alone)."""

    def forward(self, x):
        for b in self.blocks:
            x = b(x=x)
        return self.head(x).sum()


def test_blocks_called_by_keyword_are_not_recomputed(tmp_path, monkeypatch):
    def build():
        torch.manual_seed(0)
        return KeywordNet()

    ref, got, st, modules = forced_run(tmp_path, monkeypatch, build, torch.randn(64, 128), "recompute")
    assert_bitwise(got, ref)
    assert st["recomputed_blocks"] == []
    assert all(not m.get("recomputable") for m in modules)


def test_unwrap_leaves_a_forward_someone_else_set(tmp_path, monkeypatch):
    force(monkeypatch, PLACEMENT_SETS["recompute"])
    model = make_net(layers=3)
    x = torch.randn(64, 128)
    cache = cache_for(tmp_path, keep_last_modules=0).attach(model)
    run(model, x, cache, steps=2)
    assert all("forward" in b.__dict__ for b in model.blocks)
    foreign = model.blocks[0].__dict__["forward"].__wrapped__
    model.blocks[0].forward = foreign  # e.g. accelerate's remove_hook_from_module
    cache.close()
    assert model.blocks[0].__dict__["forward"] is foreign  # not ours: left alone
    assert all("forward" not in b.__dict__ for b in model.blocks[1:])


def test_last_block_release_point_is_the_blocks(tmp_path):
    """With a budget, the head is a planner module of its own (Note [Budget
    profile]); the last block's release point comes from the block's plan row."""
    model = make_net()
    x = torch.randn(64, 128)
    with cache_for(tmp_path, activation_budget_bytes=1 << 40).attach(model) as cache:
        run(model, x, cache, steps=1)
        adapt = cache._adapt
        mods = adapt.plan["modules"]
        assert mods[-1]["name"] == "<after blocks>"
        last = mods[-2]
        # Note [Release points]: the offloaded bytes whose copies are done by
        # the block's forward end, in copy order: the block's row, not the tail's.
        done = 0
        for m in mods[:-1]:
            if m["tier"] is None or m["offload_bytes"] == 0:
                continue
            if m["write_done_seconds"] > last["forward_end_seconds"]:
                break
            done += m["offload_bytes"]
        assert last["release_bytes"] == done
        assert adapt.release_point(last["scope"]) == (last["scope"], done)


def test_budget_guard_bounds_the_writes_waiting(tmp_path):
    """Note [Budget guard]: with a budget plan on the worker path, saves wait
    while more than the budget less the plan's kept bytes wait to be stored;
    the profiling step and plans without a budget leave the user's bound."""
    model = make_net()
    x = torch.randn(64, 128)
    with cache_for(tmp_path, activation_budget_bytes=3 << 20, max_inflight_bytes=64 << 20).attach(model) as cache:
        with cache.step():
            assert cache.stats()["max_inflight_bytes"] == 64 << 20  # profiling: the user's bound
            model(x).backward()
        run(model, x, cache, steps=1)
        st = cache.stats()
    plan = st["planner"]
    assert plan["feasible"]
    kept = sum(m["fixed_bytes"] + (m["saved_bytes"] if m["tier"] is None else 0) for m in plan["modules"])
    assert st["max_inflight_bytes"] == (3 << 20) - kept < 64 << 20
    assert st["peak_resident_bytes"] <= 3 << 20


class TableBlock(torch.nn.Module):
    """A block that saves a table every block shares (as HF Llama's blocks
    save the rotary cos/sin the model computes once)."""

    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x, table):
        return x + self.lin(x) * table


class TableNet(torch.nn.Module):
    def __init__(self, layers=4, d=128):
        super().__init__()
        self.blocks = torch.nn.ModuleList(TableBlock(d) for _ in range(layers))

    def forward(self, x):
        table = torch.sin(torch.arange(x.numel(), dtype=x.dtype)).view_as(x) + 2  # made once, saved by every block
        for b in self.blocks:
            x = b(x, table)
        return x.sum()


def test_a_storage_shared_by_blocks_counts_once_in_the_profile(tmp_path):
    """The profiling step offloads every block but the last, which keeps; the
    shared table, offloaded by the first block, is kept again by the last.
    The profile counts it once (as the core dedups the offloaded saves), so
    the planner's keep-all peak equals the measured one and a budget of that
    peak keeps everything (before: one table over, and the plan offloaded)."""
    from ebbtide.harness.budget_sweep import SavedBytesMeter

    torch.manual_seed(0)
    model = TableNet()
    x = torch.randn(256, 128)
    meter = SavedBytesMeter(p.untyped_storage().data_ptr() for p in model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        loss = model(x)
    loss.backward()
    keep_all = meter.peak
    with cache_for(tmp_path, activation_budget_bytes=keep_all).attach(model) as cache:
        run(model, x, cache, steps=2)
        st = cache.stats()
    plan = st["planner"]
    assert plan["all_resident_bytes"] == keep_all
    assert all(m["placement"] == "keep" for m in plan["modules"]), [m["placement"] for m in plan["modules"]]
    assert st["peak_resident_bytes"] == keep_all


def test_replan_when_the_link_measures_faster(tmp_path, caplog, monkeypatch):
    """Note [Quiet re-plan]: the profiling step writes fresh files, slower
    than later steps do; a later step measuring more than planned / 0.7
    re-plans, so a budget met partly by recomputing at the profiled rate is
    met by offloading once the link shows it can carry it. Announced at INFO
    (a faster link is no trouble); gradients stay bitwise. The profile's
    times and the store's meters are replaced so the plans are the test's,
    not the machine's: 10 ms per block, a link that writes half the blocks'
    bytes in the forward's time, then 1000 times that."""
    import logging

    model = make_net()
    x = torch.randn(256, 128)
    want = run(model, x, steps=2)  # no optimizer: each run of 2 steps draws the same
    with cache_for(tmp_path, activation_budget_bytes=1 << 40).attach(model) as c:
        run(model, x, c, steps=2)
        keep_peak = c.stats()["peak_resident_bytes"]
    with cache_for(tmp_path, activation_budget_bytes=keep_peak // 2).attach(model) as c:
        adapt = c._adapt
        real_times = adapt._scope_times
        monkeypatch.setattr(adapt, "_scope_times", lambda: {s: 0.01 for s in real_times()})
        monkeypatch.setattr(adapt, "_block_seconds", lambda scope: 0.01)
        monkeypatch.setattr(adapt, "recomputed", lambda scope, start: None)  # recomputes timed at the profile's
        monkeypatch.setattr(adapt, "_measured_backward_factor", lambda fwd, stall: 2.0)
        monkeypatch.setattr(adapt, "_backward_times", lambda end: {})  # backward = 2 x forward
        speed = [0.5]

        def rates(core_stats):
            mods = adapt.profile_modules
            r = speed[0] * sum(m["bytes"] for m in mods) / sum(m["forward_seconds"] for m in mods)
            return {"ssd": dict(bytes_written=64 << 20, write_bps=r, bytes_read=64 << 20, read_bps=r)}
        monkeypatch.setattr(adapt, "_tier_rates", rates)
        got = run(model, x, c, steps=2)
        s = c.stats()
        slow = s["planner"]
        assert slow["modules_recomputed"] > 0 and slow["bytes_ssd"] > 0, [m["placement"] for m in slow["modules"]]
        assert s["replans"] == 0
        speed[0] = 1000.0
        with caplog.at_level(logging.INFO, logger="ebbtide"):
            got += run(model, x, c, steps=2)
        s = c.stats()
        measured = rates(None)["ssd"]["write_bps"]
    assert_bitwise(want + want, got)
    fast = s["planner"]
    assert s["replans"] == 1 and fast["reason"] == "replan"
    assert fast["planned_write_bps"] == pytest.approx(measured) and measured > slow["planned_write_bps"] / 0.7
    assert fast["modules_recomputed"] == 0
    assert fast["predicted_step_seconds"] < slow["predicted_step_seconds"]
    msgs = [r for r in caplog.records if "re-planned" in r.getMessage()]
    assert len(msgs) == 1 and msgs[0].levelno == logging.INFO and "above 143% of" in msgs[0].getMessage()


def test_no_replan_up_at_the_write_cap(tmp_path, monkeypatch):
    """A plan already at max_write_mbps gains nothing from a faster
    measurement (the cap lets bursts through): no re-plan, not even a quiet
    one, whatever the steps measure. Times and meters are the test's: 50 ms
    per block, which a 100 MB/s link carries."""
    model = make_net()
    x = torch.randn(256, 128)
    with cache_for(tmp_path, activation_budget_bytes=1 << 40).attach(model) as c:
        run(model, x, c, steps=2)
        keep_peak = c.stats()["peak_resident_bytes"]
    with cache_for(tmp_path, activation_budget_bytes=keep_peak // 2, max_write_mbps=100).attach(model) as c:
        adapt = c._adapt
        real_times = adapt._scope_times
        monkeypatch.setattr(adapt, "_scope_times", lambda: {s: 0.05 for s in real_times()})
        monkeypatch.setattr(adapt, "_block_seconds", lambda scope: 0.05)
        monkeypatch.setattr(adapt, "recomputed", lambda scope, start: None)  # recomputes timed at the profile's
        monkeypatch.setattr(adapt, "_measured_backward_factor", lambda fwd, stall: 2.0)
        monkeypatch.setattr(adapt, "_backward_times", lambda end: {})  # backward = 2 x forward
        monkeypatch.setattr(adapt, "_tier_rates", lambda core_stats: {
            "ssd": dict(bytes_written=64 << 20, write_bps=10e9, bytes_read=64 << 20, read_bps=10e9)})
        made = []
        real = adapt._make_plan
        monkeypatch.setattr(adapt, "_make_plan", lambda reason, log=True: (made.append(reason), real(reason, log)))
        run(model, x, c, steps=4)
        s = c.stats()
    assert s["planner"]["bytes_ssd"] > 0 and s["planner"]["planned_write_bps"] == pytest.approx(100e6)
    # The first planned step may re-time the profile (Note [Re-timed profile]); the link never re-plans.
    assert made[0] == "profile" and set(made) <= {"profile", "retime"}
    assert s["replans"] == 0


def test_a_slower_link_misses_the_budget_without_stopping_training(tmp_path, caplog, monkeypatch):
    """Note [Budget at a slower link]: a budget the plan meets only by
    offloading, then steps whose SSD rates measured far slower (the CI VM's
    disk once wrote at 10 MB/s for a step against 1.5 GB/s around it). The
    plan remade at that rate misses the budget; before, the step raised the
    first step's ValueError and the bench stopped mid-run. Now a WARNING
    says so once, training goes on with the plan nearest the budget
    (gradients bitwise, its peak as predicted), and rates that recover
    re-plan within the budget again. Times and meters are the test's, as
    in test_replan_when_the_link_measures_faster."""
    import logging

    model = make_net()
    x = torch.randn(256, 128)
    speed, probed = [1000.0], []
    fixed = _link_stubs(monkeypatch, speed, probed)
    smallest = _smallest_budget(tmp_path, model, x, fixed)
    want = run(model, x, steps=2)
    with cache_for(tmp_path, activation_budget_bytes=smallest).attach(model) as c:
        fixed(c._adapt)
        got = run(model, x, c, steps=2)
        fast = c.stats()["planner"]
        assert fast["feasible"] and fast["bytes_ssd"] > 0, [m["placement"] for m in fast["modules"]]
        speed[0] = 1e-3
        with caplog.at_level(logging.WARNING, logger="ebbtide"):
            got += run(model, x, c, steps=2)
        s = c.stats()
        slow = s["planner"]
        speed[0] = 1000.0
        got += run(model, x, c, steps=2)
        again = c.stats()["planner"]
        steps = c._core.current_step
    assert_bitwise(want * 3, got)
    # Probed at the step after the miss and 2 steps later (1, 2, 4, ... apart),
    # when the rates had recovered; then no more.
    assert probed == [steps - 2, steps], (probed, steps)
    assert not slow["feasible"] and slow["reason"] == "replan" and slow["bytes_ssd"] == 0
    said = [r for r in caplog.records if "at the SSD rates a step measured" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert f"activation budget 1.1 MiB ({smallest} bytes) cannot be met" in said[0].getMessage()
    assert s["peak_resident_bytes"] <= slow["peak_resident_bytes"]
    assert slow["measured"]["ssd"]["source"] == "step" and again["measured"]["ssd"]["source"] == "probe"
    assert again["feasible"] and again["bytes_ssd"] > 0


def test_the_guard_holds_a_plan_that_misses_its_budget_where_its_kept_bytes_fit():
    """Note [Budget guard]: the step model waits on writes for any budget
    plan whose kept bytes fit the budget (Note [Guarded writes]), so the
    cache bounds the writes waiting for such a plan too, a plan that misses
    its budget at a slower link's rates included (Note [Budget at a slower
    link]); before, an infeasible plan got no bound, and the cache ran a
    step the model had not. Kept bytes over the budget leave the user's."""
    from ebbtide.cache.budget import inflight_bound

    def plan(feasible, kept):
        return dict(activation_budget_bytes=10 * MiB, feasible=feasible,
                    modules=[dict(fixed_bytes=0, saved_bytes=kept, tier=None), dict(fixed_bytes=0, saved_bytes=MiB,
                                                                                     tier="ssd")])
    assert inflight_bound(plan(True, 4 * MiB), 64 * MiB, cuda=False) == 6 * MiB
    assert inflight_bound(plan(False, 4 * MiB), 64 * MiB, cuda=False) == 6 * MiB
    assert inflight_bound(plan(False, 12 * MiB), 64 * MiB, cuda=False) == 64 * MiB
    assert inflight_bound(plan(False, 4 * MiB), 64 * MiB, cuda=True) == 64 * MiB  # the device path: release points


def _link_stubs(monkeypatch, speed, probed, shrink=1.0):
    """Stubs for an Adaptive (Note [Budget at a slower link] tests): each
    block's forward 0.01 s (times `shrink` more at each step that reads it),
    backward twice that, and an SSD whose rates are speed[0] x the bytes the
    forward saves per second, by the steps' meters and by the probe (whose
    calls `probed` records by step)."""
    def fixed(adapt):
        real_times = adapt._scope_times
        scale = [1.0]

        def times():
            scale[0] *= shrink
            return {s: 0.01 * scale[0] for s in real_times()}
        monkeypatch.setattr(adapt, "_scope_times", times)
        monkeypatch.setattr(adapt, "_block_seconds", lambda scope: 0.01)
        monkeypatch.setattr(adapt, "recomputed", lambda scope, start: None)
        monkeypatch.setattr(adapt, "_measured_backward_factor", lambda fwd, stall: 2.0)
        monkeypatch.setattr(adapt, "_backward_times", lambda end: {})

        def rates(core_stats):
            mods = adapt.profile_modules
            r = speed[0] * sum(m["bytes"] for m in mods) / sum(m["forward_seconds"] for m in mods)
            return {"ssd": dict(bytes_written=64 << 20, write_bps=r, bytes_read=64 << 20, read_bps=r)}
        monkeypatch.setattr(adapt, "_tier_rates", rates)
        # A plan that moves nothing to the SSD measures its rates by the probe.
        monkeypatch.setattr(adapt, "_ssd_probe", lambda: (probed.append(adapt.cache._core.current_step),
                                                          rates(None)["ssd"])[1])
    return fixed


def _smallest_budget(tmp_path, model, x, fixed):
    """The smallest activation budget the planner meets with the stubs' link
    (a budget no plan meets is refused at the first step)."""
    with cache_for(tmp_path, activation_budget_bytes=1024).attach(model) as c:
        fixed(c._adapt)
        with pytest.raises(ValueError, match="cannot be met"):
            run(model, x, c, steps=1)
        return c._adapt.plan["min_budget_bytes"]


def test_a_retime_after_a_slower_link_goes_on(tmp_path, caplog, monkeypatch):
    """Note [Budget at a slower link] with Note [Re-timed profile]: the link
    slows at the first planned step, a re-timed one (the plan is remade at
    its rates and misses the budget), and the blocks keep getting faster, so
    the next steps re-time too. A re-timed plan made at the slow rates
    already taken misses the budget as well: it goes on (before the review
    of the change, that step raised the first step's ValueError). The probe
    runs once a step at most, 1, 2, 4 ... steps apart."""
    import logging

    model = make_net()
    x = torch.randn(256, 128)
    speed, probed = [1000.0], []
    fixed = _link_stubs(monkeypatch, speed, probed, shrink=0.8)
    smallest = _smallest_budget(tmp_path, model, x, fixed)
    want = run(model, x, steps=3)
    with cache_for(tmp_path, activation_budget_bytes=smallest).attach(model) as c:
        adapt = c._adapt
        fixed(adapt)
        run(model, x, c, steps=1)  # profiles at the fast link
        assert adapt.plan["feasible"] and adapt.plan["bytes_ssd"] > 0
        speed[0] = 1e-3
        with caplog.at_level(logging.WARNING, logger="ebbtide"):
            got = run(model, x, c, steps=3)  # each step re-times
            assert adapt._retimes_left == 0 and not adapt.plan["feasible"]
            got += run(model, x, c, steps=3)
        steps = c._core.current_step
    assert_bitwise(want + want, got)
    said = [r for r in caplog.records if "at the SSD rates a step measured" in r.getMessage()]
    assert len(said) == 1
    assert probed == [3, 5] and steps == 7


def test_a_kept_plan_that_misses_its_budget_goes_on_across_calls(tmp_path, caplog, monkeypatch):
    """Note [Budget at a slower link] with Note [Plans across offload()
    calls]: a snapshot taken while the plan missed its budget carries the
    slow rates and the miss. Restored (the next offload() call's cache), its
    plan misses the budget at once: it runs, the probe stays due as it was,
    and the WARNING said in the first cache is not said again each call.
    Before, a restored cache had not missed: its plan ran over the budget
    with no probe, so no faster link ever re-planned it."""
    import logging

    model = make_net()
    x = torch.randn(256, 128)
    speed, probed = [1000.0], []
    fixed = _link_stubs(monkeypatch, speed, probed)
    smallest = _smallest_budget(tmp_path, model, x, fixed)
    with caplog.at_level(logging.WARNING, logger="ebbtide"):
        with cache_for(tmp_path, activation_budget_bytes=smallest).attach(model) as c:
            fixed(c._adapt)
            run(model, x, c, steps=2)
            speed[0] = 1e-3
            run(model, x, c, steps=1)
            assert not c._adapt.plan["feasible"] and c._adapt.plan["bytes_ssd"] == 0
            state = c._adapt.snapshot()
        for _ in range(2):
            with cache_for(tmp_path, activation_budget_bytes=smallest).attach(model) as c:
                adapt = c._adapt
                fixed(adapt)
                adapt.restore(state)
                assert adapt.infeasible is None and adapt._slow.missed and not adapt._profile_next
                run(model, x, c, steps=1)  # no ValueError
                assert not adapt.last_profiled
                state = adapt.snapshot()
        speed[0] = 1000.0
        with cache_for(tmp_path, activation_budget_bytes=smallest).attach(model) as c:
            fixed(c._adapt)
            c._adapt.restore(state)
            run(model, x, c, steps=1)  # the probe is due: the link is fast again
            assert c._adapt.plan["feasible"] and c._adapt.plan["bytes_ssd"] > 0
    assert len(probed) == 2  # the first restored call's step, then the third's (2 apart)
    assert sum("at the SSD rates a step measured" in r.getMessage() for r in caplog.records) == 1


def test_a_step_of_another_shape_is_not_retimed(tmp_path):
    """Note [Re-timed profile]: a re-timed step whose saves are of another
    shape (another batch) profiles the next step and leaves the profile's
    times alone; before, its (faster) times were merged first."""
    model = make_net()
    with cache_for(tmp_path).attach(model) as c:
        adapt = c._adapt
        run(model, torch.randn(4096, 128), c, steps=1)
        before = [m["forward_seconds"] for m in adapt.profile_modules]
        assert adapt._retime_next
        run(model, torch.randn(64, 128), c, steps=1)
        assert adapt._profile_next
        assert [m["forward_seconds"] for m in adapt.profile_modules] == before


def test_a_kept_plan_for_another_budget_profiles_and_says_so(tmp_path, monkeypatch):
    """Note [Budget at a slower link]: a kept plan restored into a cache
    whose budget it misses without any slow link (another budget: offload()
    keys kept plans by the budgets, environment included, but restore() is
    public) is not taken for a slow link's miss, which would run on with a
    warning blaming the SSD. The next step profiles, and its plan says the
    budget cannot be met, as a first step's does."""
    model = make_net()
    x = torch.randn(256, 128)
    speed, probed = [1000.0], []
    fixed = _link_stubs(monkeypatch, speed, probed)
    with cache_for(tmp_path).attach(model) as c:
        fixed(c._adapt)
        run(model, x, c, steps=2)
        state = c._adapt.snapshot()
    with cache_for(tmp_path, activation_budget_bytes=1024).attach(model) as c:
        adapt = c._adapt
        fixed(adapt)
        adapt.restore(state)
        assert adapt.infeasible is None and adapt._profile_next and not adapt._slow.missed
        with pytest.raises(ValueError, match=r"activation budget 1\.0 KiB \(1024 bytes\) cannot be met"):
            run(model, x, c, steps=1)
        assert adapt.last_profiled
