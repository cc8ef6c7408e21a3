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
STRATEGIES = ("keep", "offload", "recompute", "budget", "memory", "compiler", "torchtune")

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
    device), else it is built here.

    Strategies: keep, offload (every block, not planned), recompute (HF
    checkpointing), budget (ebbtide's plan within `budget` bytes of saved
    activations, activation_budget_bytes), memory (within `memory_budget`
    bytes of the allocator's peak above the step's start: the cache's
    memory_budget_bytes, Note [Two budgets] in ebbtide/cache/budget.py),
    compiler (torch's activation_memory_budget at `fraction`, each block
    compiled), torchtune (its OffloadActivations with HF checkpointing).
    `target`: the cache's for offload, budget and memory. `compile`: every
    block torch.compile'd apart (harness.methods.compile_blocks, torchtitan
    style; the compiler strategy's with its budget). `meter`: the step's
    peak measured on the CPU too (memmeter's heap meter; the allocator's on
    CUDA always). `probe`: a step_trace.BlockProbe records each timed step's
    blocks. `name`: the row's strategy name (default: `strategy`)."""

    def __init__(self, strategy: str, spec: dict, *, budget: Optional[int] = None,
                 max_write_mbps: Optional[float] = None, path: Optional[str] = None, device: str = "cpu",
                 dtype=torch.float32, fraction: Optional[float] = None, model: Optional[torch.nn.Module] = None,
                 target: str = "ssd", memory_budget: Optional[int] = None,
                 compile: bool = False, meter: bool = False, probe: bool = False, name: Optional[str] = None):
        import ebbtide

        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
        self.strategy, self.spec, self.budget, self.fraction = strategy, spec, budget, fraction
        self.name = name or strategy
        self.memory_budget = memory_budget
        self.target = target if strategy in ("offload", "budget", "memory") else None
        self.device = torch.device(device)
        self.model = model if model is not None else build_llama(**{k: spec[k] for k in _MODEL_KEYS},
                                                                 device=self.device, dtype=dtype)
        self.ids = torch.randint(3, spec["vocab"], (spec["batch"], spec["seq"]),
                                 generator=torch.Generator().manual_seed(1)).to(self.device)
        self.cache = None
        self.context = None  # saved-tensor hooks of a peer (torchtune) around the forward
        self.config = None    # torch._functorch.config settings of the compiler peer
        self.alloc_peaks = []
        self.last_alloc_peak = self.last_saved_peak = None  # the last step's, timed or not
        self._meter = meter or self.device.type == "cuda"
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
            if compile:
                from ebbtide.harness.methods import compile_blocks

                compile_blocks(self.model, "block", backend=backend)
            else:
                for layer in self.model.model.layers:
                    layer.compile(backend=backend)
        if compile and strategy != "compiler":
            from ebbtide.harness.methods import compile_blocks

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            compile_blocks(self.model, "block")
        if strategy == "offload":
            self.cache = ebbtide.TensorCache(target, path, adaptive=False, max_write_mbps=max_write_mbps)
        elif strategy == "budget":
            self.cache = ebbtide.TensorCache(target, path, activation_budget_bytes=budget,
                                             max_write_mbps=max_write_mbps)
        elif strategy == "memory":
            self.cache = ebbtide.TensorCache(target, path, memory_budget_bytes=int(memory_budget),
                                             max_write_mbps=max_write_mbps)
        if self.cache is not None:
            self.cache.attach(self.model)
        self.probe = None
        if probe:
            from ebbtide.harness.step_trace import BlockProbe

            self.probe = BlockProbe(self.model, self.device)
        self.steps = 0
        self.times, self.fwd_times, self.peaks, self.moved, self.blocks, self.diffs = [], [], [], [], [], []
        self.seconds = 0.0  # every step's, warm-up (and compiles) included

    @property
    def label(self) -> str:
        if self.memory_budget is not None:
            return f"{self.name} {self.memory_budget / 1e9:.3g} GB"
        return self.name + (f" {self.fraction:g}" if self.fraction is not None else "")

    def step(self, timed: bool) -> None:
        """One step (gradients only, seeded by its index so dropout would match)."""
        from ebbtide.harness.memmeter import PeakMeter

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
        peak = PeakMeter(self.device, caches=[self.cache] if self.cache is not None else ()) if self._meter else None
        probe = self.probe if timed else None
        with peak if peak is not None else contextlib.nullcontext():
            if probe is not None:
                probe.begin()
            t0 = time.perf_counter()
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            if self.cache is not None:
                with self.cache.step():
                    loss = model(input_ids=self.ids, labels=self.ids).loss
                    t1 = self._mark()
                    loss.backward()
            elif self.context is not None:
                with self.context:
                    loss = model(input_ids=self.ids, labels=self.ids).loss
                t1 = self._mark()
                loss.backward()
            elif self.config is not None:
                with torch._functorch.config.patch(**self.config):
                    loss = model(input_ids=self.ids, labels=self.ids).loss
                    t1 = self._mark()
                    loss.backward()
            else:
                with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                    loss = model(input_ids=self.ids, labels=self.ids).loss
                t1 = self._mark()
                loss.backward()
            del loss
            if cuda:
                torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - t0
        self.seconds += elapsed
        if peak is not None:
            self.last_alloc_peak = peak.peak_bytes
        self.last_saved_peak = (meter.peak if meter is not None else
                                self.cache.stats()["peak_resident_bytes"] if self.cache is not None else None)
        if not timed:
            return
        self.times.append(elapsed)
        if cuda:
            self.fwd_times.append(start.elapsed_time(t1) / 1e3)
        else:
            self.fwd_times.append(t1 - t0)
        if probe is not None:
            self.blocks.append(probe.end())
        if peak is not None:
            self.alloc_peaks.append(peak.peak_bytes)
        if self.cache is None:
            self.peaks.append(meter.peak if meter is not None else None)  # None: the peers' is not known
            self.moved.append(0)
        else:
            st = self.cache.stats()
            self.peaks.append(st["peak_resident_bytes"])
            self.moved.append(st["bytes_offloaded"])

    def _mark(self):
        """The forward's end: a CUDA event recorded now, or the host clock."""
        if self.device.type != "cuda":
            return time.perf_counter()
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return end

    def grads(self) -> list:
        return [p.grad for p in self.model.parameters()]

    def compare(self, reference: "Runner") -> None:
        """Records this step's largest gradient difference to `reference`'s
        (the same step index of the same model) and frees the gradients: a
        stage of many strategies holds one model's gradients beside keep's."""
        self.diffs.append(max(float((a - b).abs().max()) for a, b in zip(self.grads(), reference.grads())))
        self.model.zero_grad(set_to_none=True)

    def result(self, reference: Optional["Runner"] = None) -> dict:
        """Median step time, largest peak and bytes offloaded of the timed
        steps, blocks recomputed, and the largest gradient difference to
        `reference`'s: over the steps compare() saw, else of the last step."""
        planner = self.cache.stats()["planner"] if self.cache is not None else None
        recomputed = self.spec["layers"] if self.strategy == "recompute" else (
            planner["modules_recomputed"] if planner else 0)
        diff = None
        if self.diffs:
            diff = max(self.diffs)
        elif reference is not None:
            diff = 0.0 if reference is self else max(float((a - b).abs().max())
                                                     for a, b in zip(self.grads(), reference.grads()))
        peaks = [p for p in self.peaks if p is not None]
        out = dict(strategy=self.name, budget_bytes=self.budget, fraction=self.fraction,
                   step_seconds=statistics.median(self.times), timed_steps=len(self.times),
                   peak_bytes=max(peaks) if peaks else None,
                   allocated_peak_bytes=max(self.alloc_peaks) if self.alloc_peaks else None,
                   bytes_offloaded=max(self.moved), blocks_recomputed=recomputed,
                   max_grad_diff=diff,
                   predicted_peak_bytes=planner["peak_resident_bytes"] if planner else None,
                   predicted_step_seconds=planner["predicted_step_seconds"] if planner else None)
        if self.target is not None:
            out["target"] = self.target
        if self.memory_budget is not None:
            out["memory_budget_bytes"] = self.memory_budget
        if planner and "peak_allocated_bytes" in planner:
            out["predicted_allocated_peak_bytes"] = planner["peak_allocated_bytes"]
        if self.fwd_times:
            out["forward_seconds"] = statistics.median(self.fwd_times)
        return out

    def trace_run(self, name: str, kind: str = "budget"):
        """The cache's step as a trace run (TensorCache.trace_run; ``measured``
        left for the caller), or None when no cache planned this strategy."""
        if self.cache is None or not self.cache.adaptive:
            return None
        run = self.cache.trace_run(name, {})
        run["kind"] = kind
        return run

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
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
                  deadline: Optional[float] = None, strategy_limit: Optional[float] = None,
                  compare: bool = False):
    """`warmup` + `steps` rounds, each stepping every runner once (a runner
    that ran steps before, as keep's first, skips as many of the first
    rounds); `each_step` logs every runner's step and its seconds. `compare`:
    after each timed step, a runner other than keep records its gradients'
    difference to keep's of the same round and frees them (Runner.compare).
    With `failed`, a runner that raises leaves the rounds as a row of its
    error instead of failing the sweep, and so does one (not keep) whose
    steps took more than `strategy_limit` seconds in all, compiles included.
    At `deadline` (time.monotonic()) the rounds stop: no timed round starts
    that the last round's length says would end past it, no step starts past
    it. A runner left without a timed step is then a row saying so; the
    others' medians are of the timed steps they have."""
    def drop(r, error, cut=False):
        failed.append(dict(strategy=r.name, fraction=r.fraction, error=error, cut=cut,
                           **({"memory_budget_bytes": r.memory_budget} if r.memory_budget is not None else {})))
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
            if r.steps > i:
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
            if compare and r is not keep and i >= warmup and keep in runners:
                r.compare(keep)
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
        keep.step(timed=False)  # the keep-all peak, before the budgets are chosen
        high = keep.last_saved_peak
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
