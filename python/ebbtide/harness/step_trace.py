"""Step traces the GPU stages write beside their JSON (``--trace FILE`` of
bench/offload_bench.py and bench/budget_bench.py; the format is
ebbtide.plan.replay's, read back by ebbtide.harness.gpu_runs.load and
replayed by ``ebbtide plan --replay``; docs/benchmarks.md, "Step traces").

One run per ebbtide row whose cache planned its steps (TensorCache.trace_run:
the profile, the settings and the decisions the cache ran with), with what
the bench measured in ``measured``; plus runs for the single strategies
without a cache (no offload, full recompute), played on the profile of the
first ebbtide run (Note [Runs without a cache]).

BlockProbe is the bench's own view of each block, apart from the cache's:
the allocator's level at block boundaries and each block's forward and
backward time.
"""
import statistics
import time

# Counters of the cache's stats() a run's `measured` carries when the cache
# has them (the device-side waits are newer than some builds).
CACHE_COUNTERS = ("stall_seconds", "device_wait_seconds", "copy_wait_seconds", "load_wait_seconds", "copy_waits",
                  "bytes_offloaded", "bytes_reloaded", "tensors_offloaded", "peak_resident_bytes")

PEAK_SOURCES = {
    "cuda": "torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), less memory_allocated() at the "
            "step's start",
    "cpu": "the process heap (glibc mallinfo2, sampled every millisecond) plus the caches' host-tier copies "
           "above the step's start (ebbtide.harness.memmeter): the CPU has no allocator statistics",
}
LEVEL_SOURCES = {
    "cuda": "torch.cuda.memory_allocated() in the bench's block hooks (no sync: the allocator's own count, as "
            "the host queues the work), less its value at the step's start",
    "cpu": "the process heap (glibc mallinfo2) in the bench's block hooks, less its value at the step's start",
}


class BlockProbe:
    """Hooks on a model's blocks (the modules the cache scopes by) that
    record, in each step between begin() and end(), the allocator's level
    at each block's forward start and end and backward start and end, and
    each block's forward and backward time (CUDA events on a GPU, host
    clocks on the CPU).

    A block's backward starts when the gradient of its output arrives (a
    tensor hook on the output) and ends when its input's gradient is whole
    (a hook on the input: every use of it inside the block has run).
    Forward hooks that run during backward (a recompute) are not counted.
    Nothing here synchronizes: end() reads the events after the step's own
    synchronize.

    Args:
        model: the model, its blocks found as the cache finds them.
        device: the training device (torch.device).
    """

    def __init__(self, model, device):
        import torch

        from ebbtide.cache.hooks import _first_grad_tensor
        from ebbtide.cache.tensor_cache import _find_blocks

        self._grad_tensor = _first_grad_tensor  # the cache's: inputs and outputs the same way
        found = _find_blocks(model)
        self.names = [n for n, _ in found]
        self.device = device
        self._cuda = device.type == "cuda"
        self._torch = torch
        self._step = None
        self._handles = []
        for i, (_, block) in enumerate(found):
            self._handles.append(block.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._post(i)))

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _level(self):
        if self._cuda:
            return self._torch.cuda.memory_allocated(self.device)
        from ebbtide.harness.memmeter import _heap_bytes

        return _heap_bytes()

    def _now(self):
        if self._cuda:
            ev = self._torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _mark(self, i, what):
        step = self._step
        if step is not None and what not in step[i]:
            step[i][what] = (self._level() - self._base, self._now())

    def _counts(self):
        return self._step is not None and self._torch._C._current_graph_task_id() == -1

    def _pre(self, i):
        def hook(module, args, kwargs):
            if not self._counts():
                return
            self._mark(i, "forward_start")
            x = self._grad_tensor(args[0] if args else kwargs.get("hidden_states"))
            if x is not None:
                x.register_hook(lambda g: self._mark(i, "backward_end"))
        return hook

    def _post(self, i):
        def hook(module, args, output):
            if not self._counts():
                return
            self._mark(i, "forward_end")
            y = self._grad_tensor(output)
            if y is not None:
                y.register_hook(lambda g: self._mark(i, "backward_start"))
        return hook

    def begin(self):
        """Starts a step's record (call where the step's peak is measured from)."""
        self._base = self._level()
        self._step = [{} for _ in self.names]

    def end(self):
        """The step's record, after the step has synchronized: per block
        ``levels`` {forward_start, forward_end, backward_start, backward_end}
        (bytes above the step's start; None where a hook did not run) and
        ``seconds`` {forward, backward} (None likewise)."""
        step, self._step = self._step, None
        levels, seconds = [], []
        for marks in step or []:
            levels.append({k: marks[k][0] if k in marks else None
                           for k in ("forward_start", "forward_end", "backward_start", "backward_end")})
            seconds.append(dict(forward=self._span(marks, "forward_start", "forward_end"),
                                backward=self._span(marks, "backward_start", "backward_end")))
        return dict(levels=levels, seconds=seconds)

    def _span(self, marks, a, b):
        if a not in marks or b not in marks:
            return None
        t0, t1 = marks[a][1], marks[b][1]
        return t0.elapsed_time(t1) / 1e3 if self._cuda else t1 - t0


def block_medians(records):
    """Per block, the median forward and backward seconds over step records
    (BlockProbe.end()); None where a step lacked one."""
    if not records:
        return []
    out = []
    for i in range(len(records[0]["seconds"])):
        row = {}
        for k in ("forward", "backward"):
            vals = [r["seconds"][i][k] for r in records if r["seconds"][i][k] is not None]
            row[f"{k}_seconds"] = statistics.median(vals) if vals else None
        out.append(row)
    return out


def cache_counters(stats):
    """The counters of CACHE_COUNTERS the cache's stats() has, and every
    count of loads made on demand (a key naming "demand")."""
    out = {k: stats[k] for k in CACHE_COUNTERS if k in stats}
    out.update({k: v for k, v in stats.items() if "demand" in k and isinstance(v, (int, float))})
    return out


def with_names(names, rows):
    """Each per-block dict of `rows` with its block's name first."""
    return [dict(name=n, **r) for n, r in zip(names, rows)]


# Note [Runs without a cache]
# No offload and full recompute run without a cache, so no profile of their
# own exists; but the step model plays them as keep-all and as the cache's
# recompute of every block. Their runs take the profile and settings of the
# first ebbtide run of the same model in the same trace (forward and
# backward per module timed without offloading interference by that cache's
# profiling step) and the placements of the strategy; ``measured`` is the
# strategy's own row. They say so in ``assumptions``. replay.targets() finds
# no offload's run by its placements (every module kept), and the offload
# targets are computed against it; now_options is None: no "best" plan is
# asked of a run that did not plan.
def strategy_run(template, name, placements, measured, kind="offload", apart=None):
    """A run for a strategy without a cache on `template`'s profile (Note
    [Runs without a cache]); `apart`: why the replay leaves it out of its 5%
    bar, if it does."""
    n = len(template["modules"])
    run = dict(name=name, kind=kind, modules=template["modules"], options=dict(template["options"]),
               ran=dict(placements=list(placements), offload_limits=[None] * n, lead_bytes=[0] * n),
               measured=dict(measured), now_options=None,
               assumptions=[f"no cache ran: the profile and settings of run {template['name']!r}, the placements "
                            "of the strategy (Note [Runs without a cache] in ebbtide/harness/step_trace.py)"])
    if apart:
        run.update(apart=True, apart_why=apart)
    return run


# HF's gradient checkpointing recomputes every decoder layer, the last one
# too, and checkpoints the layer's call as HF wraps it; the step model's full
# recompute is the cache's (its recomputable modules). Close, not the same.
RECOMPUTE_APART = ("full recompute ran as HF gradient checkpointing (every layer, the last included), not as the "
                   "cache's recompute the model plays")


def recompute_placements(template):
    """Full recompute's placements on `template`'s profile: every module the
    cache may recompute, recomputed."""
    return ["recompute" if m.get("recomputable") else "keep" for m in template["modules"]]


def offload_runs(result, label):
    """The runs of one bench/offload_bench.py result, taking each row's
    ``trace_run`` out of it: per planned ebbtide row its cache's run, and no
    offload's run first (Note [Runs without a cache]).

    Returns:
        (runs, left_out): left_out lists the ebbtide rows without a run and why.
    """
    ok = {r["method"]: r for r in result["rows"] if r["status"] == "ok"}
    none = ok["none"]
    cuda = result["device"].startswith("cuda")
    runs, left_out = [], []
    for row in result["rows"]:
        run = row.pop("trace_run", None)
        if run is None:
            if row["method"].startswith("ebbtide"):
                why = row["status"] if row["status"] != "ok" else "its cache did not plan (adaptive=False)"
                left_out.append(dict(method=row["method"], why=why))
            continue
        run["measured"] = offload_measured(row, none, cuda)
        runs.append(run)
    if runs:
        template = next((r for r in runs if r["name"].endswith(" ebbtide-cpu")), runs[0])
        measured = offload_measured(none, None, cuda)
        runs.insert(0, strategy_run(template, f"{label} none", ["keep"] * len(template["modules"]), measured))
        if "recompute" in ok:
            runs.append(strategy_run(template, f"{label} recompute", recompute_placements(template),
                                     offload_measured(ok["recompute"], none, cuda), kind="recompute",
                                     apart=RECOMPUTE_APART))
    return runs, left_out


def offload_measured(row, none, cuda):
    """A run's ``measured`` from an offload_bench row (and no offload's)."""
    out = dict(step_seconds=row["step_seconds"], peak_bytes=row["peak_bytes"],
               peak_source=PEAK_SOURCES["cuda" if cuda else "cpu"],
               forward_seconds=row.get("forward_seconds"), backward_seconds=row.get("backward_seconds"),
               step_seconds_per_step=row.get("step_seconds_per_step"))
    if none is not None:
        out.update(none_step_seconds=none["step_seconds"], none_peak_bytes=none["peak_bytes"],
                   blocks_off=none.get("block_seconds"))
    else:
        out["blocks_off"] = row.get("block_seconds")
    out.update(cache_counters(row.get("stats") or {}))
    if row.get("block_levels"):
        out.update(block_levels=row["block_levels"], level_source=LEVEL_SOURCES["cuda" if cuda else "cpu"])
    return out
