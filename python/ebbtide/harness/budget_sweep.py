"""Activation-budget sweeps (issue 29): for a Llama-style model, the step time
and measured peak of each fixed strategy (keep, ebbtide offloading every
block, full recompute with HF gradient checkpointing) and of ebbtide with a
budget, at budgets from the smallest the planner meets to the keep-all peak.
Used by bench/budget_bench.py and `ebbtide rok --budget`.

The peak is what the tensor cache reports as ``peak_resident_bytes``: the
bytes of saved activations autograd holds in the training device's memory
(kept, or offloaded and not yet written or already reloaded). Runs without
ebbtide count the same with saved-tensor hooks that only count. Neither
counts the activations a recompute re-makes in backward (one block at a
time; the planner's predicted peak includes them).
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import tempfile
import time
import weakref
from typing import Callable, Optional

import torch

from ebbtide.harness.models import enable_hf_recompute

# keep / offload / recompute / budget run anywhere; compiler (torch's
# activation_memory_budget with each block compiled) and torchtune (its
# OffloadActivations with HF checkpointing) are the GPU stage's peers.
STRATEGIES = ("keep", "offload", "recompute", "budget", "compiler", "torchtune")

DEFAULT_MODEL = dict(layers=8, hidden=256, heads=4, kv_heads=2, ffn_hidden=704, vocab=2048, seq=512, batch=4)
# bench/offload_bench.py's shape (a), Llama 3 8B's layer: the GPU stage.
SHAPE_A = dict(layers=8, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=32000, seq=2048, batch=2)
_MODEL_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq")


def build_llama(layers, hidden, heads, kv_heads, ffn_hidden, vocab, seq, seed=0, device="cpu", dtype=torch.float32):
    """A random-init LlamaForCausalLM (nothing downloaded), made on `device`:
    shape a's 2.0 B parameters take 30-70 s to initialise on the host, one
    thread drawing the random numbers and fresh pages faulted in (the GPU
    stage built seven that way and never reached its first step)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn_hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=seq, use_cache=False)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", torch_dtype=dtype)
    model.to(device)
    model.train()
    return model


class SavedBytesMeter:
    """Saved-tensor hooks that keep every tensor and count the bytes of the
    storages autograd holds, once per storage, and their peak; parameters
    (storages in `skip`) are not activations and not counted, as in the cache."""

    def __init__(self, skip=()):
        self.live = 0
        self.peak = 0
        self._refs: dict = {}
        self._skip = set(skip)

    def pack(self, t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self._skip:
            return _Held(t)
        if key in self._refs:
            self._refs[key][0] += 1
        else:
            self._refs[key] = [1, st.nbytes()]
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
        holder = _Held(t)
        weakref.finalize(holder, self._drop, key)
        return holder

    def _drop(self, key):
        ref = self._refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self._refs[key]

    @staticmethod
    def unpack(holder):
        return holder.t


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class _InductorAtBudget:
    """torch.compile's backend for the compiler peer at one fraction: dynamo
    keys its cache by backend (compared by identity here), so the blocks of
    one runner share one compile and a runner at another fraction compiles
    its own. With the default backend the second fraction's blocks would reuse
    the first's graphs, partitioned at the first's budget (one graph in all)."""

    def __init__(self, fraction: float):
        self.fraction = float(fraction)

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        with torch._functorch.config.patch(activation_memory_budget=self.fraction):
            return compile_fx(gm, example_inputs)


class Runner:
    """One strategy's model, inputs and cache, stepped one step at a time so a
    sweep can alternate strategies step by step (drifting machine load then
    hits all alike). `model`: one built already (build_llama's, on the
    device), else it is built here."""

    def __init__(self, strategy: str, spec: dict, *, budget: Optional[int] = None,
                 max_write_mbps: Optional[float] = None, path: Optional[str] = None, device: str = "cpu",
                 dtype=torch.float32, fraction: Optional[float] = None, model: Optional[torch.nn.Module] = None):
        import ebbtide

        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
        self.strategy, self.spec, self.budget, self.fraction = strategy, spec, budget, fraction
        self.device = torch.device(device)
        self.model = model if model is not None else build_llama(**{k: spec[k] for k in _MODEL_KEYS},
                                                                 device=self.device, dtype=dtype)
        self.ids = torch.randint(3, spec["vocab"], (spec["batch"], spec["seq"]),
                                 generator=torch.Generator().manual_seed(1)).to(self.device)
        self.cache = None
        self.context = None  # saved-tensor hooks of a peer (torchtune) around the forward
        self.config = None    # torch._functorch.config settings of the compiler peer
        self.alloc_peaks = []
        if strategy in ("recompute", "torchtune"):
            enable_hf_recompute(self.model)
        if strategy == "torchtune":
            from ebbtide.harness.methods import load_torchtune_offload

            offload_cls, _origin = load_torchtune_offload()
            self.context = offload_cls()
        elif strategy == "compiler":
            # torch's own budget: the partitioner recomputes what exceeds the
            # fraction of activation memory, in each block compiled apart.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self.config = dict(activation_memory_budget=float(fraction))
            backend = _InductorAtBudget(fraction)
            for layer in self.model.model.layers:
                layer.compile(backend=backend)
        elif strategy == "offload":
            self.cache = ebbtide.TensorCache("ssd", path, adaptive=False, max_write_mbps=max_write_mbps)
        elif strategy == "budget":
            self.cache = ebbtide.TensorCache("ssd", path, activation_budget_bytes=budget,
                                             max_write_mbps=max_write_mbps)
        if self.cache is not None:
            self.cache.attach(self.model)
        self.steps = 0
        self.times, self.peaks, self.moved = [], [], []
        self.seconds = 0.0  # every step's, warm-up (and compiles) included

    @property
    def label(self) -> str:
        return self.strategy + (f" {self.fraction:g}" if self.fraction is not None else "")

    def step(self, timed: bool) -> None:
        """One step (gradients only, seeded by its index so dropout would match)."""
        model = self.model
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + self.steps)
        self.steps += 1
        # Only a run without its own saved-tensor hooks or compiled graphs is
        # metered: the cache counts its own, the peers save past a meter.
        meter = None
        if self.cache is None and self.context is None and self.config is None:
            meter = SavedBytesMeter(p.untyped_storage().data_ptr() for p in model.parameters())
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.memory_allocated(self.device)
        t0 = time.perf_counter()
        if self.cache is not None:
            with self.cache.step():
                model(input_ids=self.ids, labels=self.ids).loss.backward()
        elif self.context is not None:
            with self.context:
                loss = model(input_ids=self.ids, labels=self.ids).loss
            loss.backward()
        elif self.config is not None:
            with torch._functorch.config.patch(**self.config):
                model(input_ids=self.ids, labels=self.ids).loss.backward()
        else:
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                loss = model(input_ids=self.ids, labels=self.ids).loss
            loss.backward()
        if cuda:
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        self.seconds += elapsed
        if not timed:
            return
        self.times.append(elapsed)
        if cuda:
            self.alloc_peaks.append(torch.cuda.max_memory_allocated(self.device) - start)
        if self.cache is None:
            self.peaks.append(meter.peak if meter is not None else None)  # None: the peers' is not known
            self.moved.append(0)
        else:
            st = self.cache.stats()
            self.peaks.append(st["peak_resident_bytes"])
            self.moved.append(st["bytes_offloaded"])

    def grads(self) -> list:
        return [p.grad for p in self.model.parameters()]

    def result(self, reference: Optional[list] = None) -> dict:
        """Median step time, largest peak and bytes offloaded of the timed
        steps, blocks recomputed, and the largest gradient difference of the
        last step to `reference`'s."""
        planner = self.cache.stats()["planner"] if self.cache is not None else None
        recomputed = self.spec["layers"] if self.strategy == "recompute" else (
            planner["modules_recomputed"] if planner else 0)
        diff = None
        if reference is not None:
            diff = max(float((a - b).abs().max()) for a, b in zip(self.grads(), reference.grads()))
        peaks = [p for p in self.peaks if p is not None]
        return dict(strategy=self.strategy, budget_bytes=self.budget, fraction=self.fraction,
                    step_seconds=statistics.median(self.times), timed_steps=len(self.times),
                    peak_bytes=max(peaks) if peaks else None,
                    allocated_peak_bytes=max(self.alloc_peaks) if self.alloc_peaks else None,
                    bytes_offloaded=max(self.moved), blocks_recomputed=recomputed,
                    max_grad_diff=diff,
                    predicted_peak_bytes=planner["peak_resident_bytes"] if planner else None,
                    predicted_step_seconds=planner["predicted_step_seconds"] if planner else None)

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()


@contextlib.contextmanager
def _scratch(path: Optional[str]):
    """(a directory for the SSD files: `path` or a temporary one, a list of
    runners); the runners are closed and the temporary directory removed at exit."""
    tmp = None if path else tempfile.TemporaryDirectory(prefix="ebbtide-budget-")
    runners: list = []
    try:
        yield (path or tmp.name), runners
    finally:
        for r in runners:
            r.close()
        if tmp is not None:
            tmp.cleanup()


def _step_in_turn(runners, keep, warmup, steps, log, failed=None, *, each_step=False,
                  deadline: Optional[float] = None, strategy_limit: Optional[float] = None):
    """`warmup` + `steps` rounds, each stepping every runner once (keep's first
    step ran already); `each_step` logs every runner's step and its seconds.
    With `failed`, a runner that raises leaves the rounds as a row of its
    error instead of failing the sweep, and so does one (not keep) whose
    steps took more than `strategy_limit` seconds in all, compiles included.
    At `deadline` (time.monotonic()) the rounds stop: no timed round starts
    that the last round's length says would end past it, no step starts past
    it. A runner left without a timed step is then a row saying so; the
    others' medians are of the timed steps they have."""
    def drop(r, error, cut=False):
        failed.append(dict(strategy=r.strategy, fraction=r.fraction, error=error, cut=cut))
        runners.remove(r)
        r.close()

    total = warmup + steps
    last_round = 0.0
    for i in range(total):
        start = time.monotonic()
        if deadline is not None and i > warmup and start + last_round > deadline:
            log(f"[budget] time limit: {i - warmup} of {steps} timed rounds run, the next would end past it "
                f"(the last took {last_round:.1f} s)")
            break
        log(f"[budget] step {i + 1} of {total}" + (" (warm-up)" if i < warmup else ""))
        stopped = False
        for r in list(runners):
            if r is keep and i == 0:
                continue
            if deadline is not None and time.monotonic() > deadline:
                log(f"[budget] time limit: stopped in step {i + 1}, before {r.label}")
                stopped = True
                break
            before = r.seconds
            try:
                r.step(timed=i >= warmup)
            except Exception as exc:
                if failed is None:
                    raise
                log(f"[budget]   {r.label}: {type(exc).__name__}: {exc}")
                drop(r, f"{type(exc).__name__}: {exc}")
                continue
            if each_step:
                log(f"[budget]   {r.label}: {r.seconds - before:.3f} s")
            if failed is not None and strategy_limit is not None and r is not keep and r.seconds > strategy_limit:
                log(f"[budget]   {r.label}: cut, its {r.steps} steps took {r.seconds:.1f} s > {strategy_limit:g} s")
                drop(r, f"cut: {r.steps} steps took {r.seconds:.1f} s > {strategy_limit:g} s", cut=True)
        if stopped:
            break
        last_round = time.monotonic() - start
    for r in list(runners):
        if not r.times:
            if failed is None:
                raise RuntimeError(f"{r.label}: no timed step")
            drop(r, f"cut: no timed step before the time limit ({r.steps} steps, {r.seconds:.1f} s)", cut=True)


def smallest_budget(spec: dict, *, max_write_mbps: Optional[float], path: Optional[str]) -> int:
    """The smallest budget the planner meets for this model, from one profiling step."""
    r = Runner("budget", spec, budget=1 << 60, max_write_mbps=max_write_mbps, path=path)
    try:
        r.step(timed=False)  # the profile
        return int(r.cache.predict(1)["min_budget_bytes"])
    finally:
        r.close()


def run_sweep(spec: Optional[dict] = None, *, points: int = 6, steps: int = 3, warmup: int = 2,
              max_write_mbps: Optional[float] = None, path: Optional[str] = None,
              log: Callable[[str], None] = print) -> dict:
    """The fixed strategies and ebbtide at `points` budgets from the smallest
    the planner meets to the keep-all peak, stepped in turn (`warmup` steps
    untimed: the first profiles). Returns the rows and, per budget, the
    fastest fixed strategy that fits it."""
    spec = dict(DEFAULT_MODEL, **(spec or {}))
    if points < 2:
        raise ValueError(f"points={points}: a sweep needs at least 2 budgets")
    if steps < 1 or warmup < 2:
        raise ValueError(f"steps={steps}, warmup={warmup}: need steps >= 1 and warmup >= 2 "
                         "(the first step profiles, the second applies the plan)")
    with _scratch(path) as (path, runners):
        keep = Runner("keep", spec)
        runners.append(keep)
        keep.step(timed=True)  # the keep-all peak, before the budgets are chosen
        high = keep.peaks.pop()
        keep.times.pop()
        low = smallest_budget(spec, max_write_mbps=max_write_mbps, path=path)
        budgets = [int(low + (high - low) * i / (points - 1)) for i in range(points)] if high > low else [low]
        log(f"[budget] keep-all peak {high / 2**20:.1f} MiB, smallest budget {low / 2**20:.1f} MiB; "
            f"{len(budgets)} budgets")
        for s in ("offload", "recompute"):
            runners.append(Runner(s, spec, max_write_mbps=max_write_mbps, path=path))
        for b in budgets:
            runners.append(Runner("budget", spec, budget=b, max_write_mbps=max_write_mbps, path=path))
        _step_in_turn(runners, keep, warmup, steps, log)
        rows = [r.result(reference=keep) for r in runners]
    fixed = [r for r in rows if r["strategy"] != "budget"]
    for r in rows:
        if r["strategy"] != "budget":
            continue
        fits = [f for f in fixed if f["peak_bytes"] <= 1.05 * r["budget_bytes"]]
        best = min(fits, key=lambda f: f["step_seconds"]) if fits else None
        r["fastest_fixed_that_fits"] = best["strategy"] if best else None
        r["vs_fastest_fixed"] = r["step_seconds"] / best["step_seconds"] if best else None
        r["within_budget"] = r["peak_bytes"] <= 1.05 * r["budget_bytes"]
    return dict(model=spec, max_write_mbps=max_write_mbps, steps=steps, warmup=warmup, smallest_budget=low,
                keep_peak=high, rows=rows, targets=targets(rows))


def run_fractions(spec: Optional[dict] = None, *, fractions=(0.5, 0.25), strategies=STRATEGIES, steps: int = 4,
                  warmup: int = 2, device: str = "cuda", dtype=torch.bfloat16, path: Optional[str] = None,
                  log: Callable[[str], None] = print, time_limit: Optional[float] = None,
                  strategy_limit: Optional[float] = None) -> dict:
    """The GPU stage (issue 29): ebbtide at budgets of `fractions` of the
    keep-all peak of saved activations, against full recompute, torch's
    activation_memory_budget at the same fractions with each block compiled,
    and torchtune's offloading with HF checkpointing, stepped in turn. Peaks
    are the allocator's (max_memory_allocated over the step, less what was
    allocated before it) on CUDA. A strategy that cannot run here is a row
    with its error. The model is built once, on the device, and copied for
    each strategy. `time_limit` (seconds from the call) and `strategy_limit`
    (seconds of one strategy's steps): _step_in_turn; what they cut is a
    failed row marked cut."""
    deadline = time.monotonic() + time_limit if time_limit is not None else None
    spec = dict(SHAPE_A, **(spec or {}))
    failed = []
    with _scratch(path) as (path, runners):
        t0 = time.perf_counter()
        template = build_llama(**{k: spec[k] for k in _MODEL_KEYS}, device=torch.device(device), dtype=dtype)
        log(f"[budget] model built on {device} in {time.perf_counter() - t0:.1f} s")
        wanted = []
        for s in strategies:
            if s in ("keep", "offload"):
                continue
            if s in ("budget", "compiler"):
                wanted += [(s, f) for f in fractions]
            else:
                wanted.append((s, None))
        # The copies first: the template then has no gradients to copy.
        t0 = time.perf_counter()
        copies = [copy.deepcopy(template) for _ in wanted]
        log(f"[budget] {len(copies)} copies in {time.perf_counter() - t0:.1f} s")
        keep = Runner("keep", spec, device=device, dtype=dtype, model=template)
        runners.append(keep)
        keep.step(timed=True)
        keep_saved = keep.peaks.pop()
        keep.times.pop()
        keep.alloc_peaks[:] = []
        log(f"[budget] keep-all peak of saved activations {keep_saved / 2**30:.2f} GiB (first step "
            f"{keep.seconds:.2f} s)")
        for (s, f), model in zip(wanted, copies):
            t0 = time.perf_counter()
            try:
                runners.append(Runner(s, spec, device=device, dtype=dtype, path=path, fraction=f, model=model,
                                      budget=int(f * keep_saved) if s == "budget" else None))
            except Exception as exc:  # a peer missing here is a row, not a failed stage
                failed.append(dict(strategy=s, fraction=f, error=f"{type(exc).__name__}: {exc}", cut=False))
                log(f"[budget] {s}" + (f" {f:g}" if f is not None else "") + f" cannot run: {failed[-1]['error']}")
                continue
            log(f"[budget] {runners[-1].label} set up in {time.perf_counter() - t0:.1f} s")
        del copies
        _step_in_turn(runners, keep, warmup, steps, log, failed, each_step=True, deadline=deadline,
                      strategy_limit=strategy_limit)
        rows = [r.result(reference=keep) for r in runners]  # keep's gradients: its last step's, cut or not
    mine = [r for r in rows if r["strategy"] == "budget"]
    checks = []
    for m in mine:
        for peer in rows:
            if peer["strategy"] in ("keep", "budget") or peer["allocated_peak_bytes"] is None:
                continue
            if peer["allocated_peak_bytes"] >= m["allocated_peak_bytes"]:
                checks.append(dict(budget_fraction=m["fraction"], peer=peer["strategy"], peer_fraction=peer["fraction"],
                                   step_ratio=m["step_seconds"] / peer["step_seconds"],
                                   faster=m["step_seconds"] < peer["step_seconds"]))
    return dict(model=spec, device=str(device), dtype=str(dtype), fractions=list(fractions),
                keep_saved_peak=keep_saved, rows=rows, failed=failed, checks=checks,
                target_met=bool(checks) and all(c["faster"] for c in checks))


def format_fractions(result) -> str:
    from ebbtide import _core

    fmt = lambda n: _core.format_bytes(n) if n is not None else "-"  # noqa: E731
    m = result["model"]
    lines = [f"activation budget vs peers on {result['device']}: Llama {m['layers']} layers, h={m['hidden']}, "
             f"s={m['seq']}, b={m['batch']}, {result['dtype']}; keep-all saved {fmt(result['keep_saved_peak'])}",
             f"{'strategy':<11}{'fraction':>9}{'step s':>9}{'alloc peak':>12}{'saved peak':>12}{'recomp':>7}"
             f"{'grad diff':>10}"]
    for r in result["rows"]:
        frac = f"{r['fraction']:g}" if r["fraction"] is not None else "-"
        diff = f"{r['max_grad_diff']:.1g}" if r["max_grad_diff"] is not None else "-"
        lines.append(f"{r['strategy']:<11}{frac:>9}{r['step_seconds']:>9.3f}{fmt(r['allocated_peak_bytes']):>12}"
                     f"{fmt(r['peak_bytes']):>12}{r['blocks_recomputed']:>7}{diff:>10}")
    for f in result["failed"]:
        frac = f" {f['fraction']:g}" if f["fraction"] is not None else ""
        lines.append(f"{f['strategy'] + frac:<11} {'cut' if f.get('cut') else 'did not run'}: "
                     f"{f['error'].removeprefix('cut: ')}")
    for c in result["checks"]:
        lines.append(f"budget {c['budget_fraction']:g} vs {c['peer']}"
                     + (f" {c['peer_fraction']:g}" if c["peer_fraction"] is not None else "")
                     + f" (peak >= ebbtide's): step {c['step_ratio']:.2f}x {'ok' if c['faster'] else 'NOT FASTER'}")
    lines.append(f"target (faster than each peer at equal or higher peak): {'met' if result['target_met'] else 'NOT met'}")
    return "\n".join(lines)


def targets(rows) -> dict:
    """Issue 29's CPU targets, judged on one sweep's rows."""
    by = {r["strategy"]: r for r in rows if r["strategy"] != "budget"}
    budget_rows = [r for r in rows if r["strategy"] == "budget"]
    return dict(
        peak_within_budget=all(r["within_budget"] for r in budget_rows),
        never_slower_than_fastest_fixed=all(r["vs_fastest_fixed"] is None or r["vs_fastest_fixed"] <= 1.05
                                           for r in budget_rows),
        below_offload_and_recompute_somewhere=any(
            r["step_seconds"] < by["offload"]["step_seconds"] and r["step_seconds"] < by["recompute"]["step_seconds"]
            for r in budget_rows),
        bitwise=all(r["max_grad_diff"] == 0.0 for r in rows),
    )


def format_table(result) -> str:
    from ebbtide import _core

    m = result["model"]
    cap = f"SSD writes capped at {result['max_write_mbps']:g} MB/s" if result["max_write_mbps"] else "SSD uncapped"
    lines = [f"activation budget sweep: Llama {m['layers']} layers, h={m['hidden']}, s={m['seq']}, b={m['batch']}; "
             f"{cap}",
             f"{'strategy':<10}{'budget':>11}{'step s':>9}{'peak':>11}{'predicted':>11}{'offloaded':>11}"
             f"{'recomp':>7}{'grad diff':>10}  vs fastest fixed that fits"]
    for r in result["rows"]:
        budget = _core.format_bytes(r["budget_bytes"]) if r["budget_bytes"] else "-"
        pred = _core.format_bytes(r["predicted_peak_bytes"]) if r["predicted_peak_bytes"] is not None else "-"
        vs = ""
        if r["strategy"] == "budget":
            vs = (f"{r['vs_fastest_fixed']:.2f}x {r['fastest_fixed_that_fits']}" if r["vs_fastest_fixed"]
                  else "none fits")
            if not r["within_budget"]:
                vs += "  OVER BUDGET"
        lines.append(f"{r['strategy']:<10}{budget:>11}{r['step_seconds']:>9.3f}"
                     f"{_core.format_bytes(r['peak_bytes']):>11}{pred:>11}"
                     f"{_core.format_bytes(r['bytes_offloaded']):>11}{r['blocks_recomputed']:>7}"
                     f"{r['max_grad_diff']:>10.1g}  {vs}")
    t = result["targets"]
    lines.append("targets: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in t.items()))
    return "\n".join(lines)


def plot(results, png_path):
    """Step time against measured peak, one panel per sweep: the fixed
    strategies as points, ebbtide's budgets as a line (the ROK frontier)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.2 * len(results), 4.6), squeeze=False)
    for ax, result in zip(axes[0], results):
        budget = [r for r in result["rows"] if r["strategy"] == "budget"]
        ax.plot([r["peak_bytes"] / 2**20 for r in budget], [r["step_seconds"] for r in budget], marker="o",
                label="ebbtide with a budget")
        for r in result["rows"]:
            if r["strategy"] != "budget":
                ax.scatter([r["peak_bytes"] / 2**20], [r["step_seconds"]], marker="s", s=50, label=r["strategy"])
        ax.set_xlabel("measured peak of saved activations (MiB)")
        ax.set_ylabel("step time (s)")
        cap = result["max_write_mbps"]
        ax.set_title(f"SSD writes capped at {cap:g} MB/s" if cap else "SSD uncapped")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
