"""The main job: train a small HF transformer for a few steps under several
ways of handling activations and compare them.

Methods: no offload, ebbtide to SSD files, ebbtide to host memory, full
recompute (torch.utils.checkpoint per block, through HF's gradient
checkpointing), and torch's save_on_cpu; on request also ebbtide's adaptive
default, torchtune's OffloadActivations and torch's compiler offloading. For
each: median step time, peak memory of the step (see memmeter.py), bytes
ebbtide wrote, and the largest |gradient difference| against no offload (0
means bitwise equal). Models are random-init (nothing is downloaded).

All methods share one model (Note [One model for every method]).
"""
import statistics
import tempfile
import time

from ebbtide.harness.methods import (_HOST_COPY_METHODS, EXTRA_METHODS, METHODS, _method_context, compile_blocks,
                                     compiler_offload_options)
from ebbtide.harness.models import DEFAULT_MODEL, build_model, resolve_size

# Note [One model for every method]
# Every method runs on the same model object: a model copy per method would
# hold one set of weights, gradients and optimizer state per method on the
# device, and the large shapes of bench/offload_bench.py fit once, not eight
# times. Comparable gradients need the same weights, batch and dropout masks:
# a round runs step i of every method on the same weights (the batch and the
# torch seed derive from i, gradients are set to None before each method),
# then one optimizer step updates the shared weights for the next round. A
# method's activation handling is on only inside its own step: caches are
# attached for the whole run, but their hooks act only inside cache.step();
# recompute turns HF's checkpointing on and off around the step; compiled
# blocks switch to the variant the method needs (_BlockVariants).


class _GradCompare:
    """Compares every method's gradients with no offload's, round by round,
    without keeping more than one copy: the first method of a round leaves its
    gradients (on the host) as the round's reference R, every method is
    measured against R on the device, and max|g - g_none| follows exactly
    when R is no offload's or no offload matches R bitwise (else it is bounded
    by d(g, R) + d(g_none, R) and flagged inexact)."""

    _CHUNK = 1 << 26  # elements compared at once: bounds the temporaries on the device

    def __init__(self, params, device):
        self.params = list(params)
        self.device = device
        self.ref = None
        self.ref_method = None
        self.rounds = []  # per round: {method: d(g, R)}

    def begin_round(self):
        self.ref_method = None
        self.rounds.append({})

    def observe(self, method):
        import torch

        grads = [p.grad for p in self.params]
        if self.ref_method is None:
            pin = self.device.type == "cuda"
            if self.ref is None:
                self.ref = [None if g is None else torch.empty(g.shape, dtype=g.dtype, pin_memory=pin)
                            for g in grads]
            for r, g in zip(self.ref, grads):
                if (r is None) != (g is None):
                    raise RuntimeError("gradients of the first method of a round differ in "
                                       "which parameters have one")
                if g is not None:
                    r.copy_(g, non_blocking=pin)
            if pin:
                torch.cuda.synchronize(self.device)
            self.ref_method = method
            self.rounds[-1][method] = 0.0
            return
        worst = torch.zeros((), dtype=torch.float32, device=self.device)
        for r, g in zip(self.ref, grads):
            if (r is None) != (g is None):
                self.rounds[-1][method] = float("inf")
                return
            if g is None:
                continue
            gf, rf = g.reshape(-1), r.reshape(-1)
            for s in range(0, gf.numel(), self._CHUNK):
                a = gf[s:s + self._CHUNK]
                b = rf[s:s + self._CHUNK].to(self.device, non_blocking=True)
                worst = torch.maximum(worst, (a.float() - b.float()).abs().max())
        self.rounds[-1][method] = worst.item()

    def result(self, method, reference="none"):
        """(max |g_method - g_reference| over all rounds, exact?)."""
        worst, exact = 0.0, True
        for rnd in self.rounds:
            if method not in rnd or reference not in rnd:
                continue
            d_m, d_ref = rnd[method], rnd[reference]
            if d_ref == 0.0 or method == reference:
                d = d_m if method != reference else 0.0
            else:
                d = d_m + d_ref
                exact = False
            worst = max(worst, d) if d == d else float("nan")
        return worst, exact


class _Runner:
    """One method's activation handling on the shared model; step(i) runs
    training step i (same batch and dropout seed for every method)."""

    def __init__(self, method, model, make_batch, device, batch, workdir, default_variant):
        self.method, self.model, self.make_batch = method, model, make_batch
        self.device, self.batch = device, batch
        self.enter, self.cache, self._cleanup = _method_context(method, model, device, workdir,
                                                                default_variant)
        self.origin = getattr(self.enter, "origin", None)
        self.times, self.fwd_times, self.peaks = [], [], []
        self.step_stats = []  # the cache's stats() after each timed step
        self.ssd_written = 0  # bytes the last step wrote to SSD files
        self.closed = False

    def _ssd_bytes_written(self):
        if self.cache is None:
            return 0
        return sum(t["bytes_written"] for t in self.cache.stats()["tiers"] if t["tier"] == "ssd")

    def step(self, i, measured):
        import torch

        from ebbtide.harness.memmeter import PeakMeter

        cuda = self.device.type == "cuda"
        gen = torch.Generator().manual_seed(1000 + i)
        inputs = self.make_batch(self.batch, gen)
        torch.manual_seed(i)  # dropout masks identical across methods
        self.model.zero_grad(set_to_none=True)
        written0 = self._ssd_bytes_written()
        if cuda:
            torch.cuda.synchronize(self.device)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        t0 = time.perf_counter()
        with PeakMeter(self.device, caches=[self.cache] if self.cache is not None else ()) as meter:
            with self.enter():
                if cuda:
                    ev[0].record()
                tf0 = time.perf_counter()
                loss = self.model(**inputs).loss
                tf1 = time.perf_counter()
                if cuda:
                    ev[1].record()
                meter.sample()
                loss.backward()
            if cuda:
                torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        fwd = ev[0].elapsed_time(ev[1]) / 1e3 if cuda else tf1 - tf0
        self.ssd_written = self._ssd_bytes_written() - written0
        if measured:
            self.times.append(dt)
            self.fwd_times.append(fwd)
            self.peaks.append(meter.peak_bytes)
            if self.cache is not None:
                self.step_stats.append(self.cache.stats())

    def close(self):
        if self.closed:
            return
        self.closed = True
        self._cleanup()

    def row(self):
        stats = self.step_stats[-1] if self.step_stats else {}
        return dict(method=self.method, status="ok", step_seconds=statistics.median(self.times),
                    step_seconds_per_step=list(self.times),
                    forward_seconds=statistics.median(self.fwd_times), peak_bytes=max(self.peaks),
                    stats=stats, ssd_bytes_written=self.ssd_written,
                    forward_seconds_per_step=list(self.fwd_times),
                    bytes_offloaded_per_step=[s["bytes_offloaded"] for s in self.step_stats] or None,
                    **({"origin": self.origin} if self.origin else {}))


def _error_text(e):
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return text if len(text) <= 200 else text[:197] + "..."


def run_methods(methods, model, make_batch, device, steps, warmup, batch, workdir, log=print,
                optimizer="adamw", default_variant="eager", progress=None):
    """Runs the methods' steps interleaved on one model (Note [One model for
    every method]): round i runs step i of every method, the order rotating
    each round, so drifting machine load and warm-up costs hit every method
    alike; then one optimizer step (optimizer "adamw" or "none").

    `progress` (an ebbtide._progress.Progress) is advanced once per round and
    names the step and method running; with it, the per-round log lines are
    left to the bar.

    Returns {method: row}; a row has status "ok" and the measurements, or
    "skipped: <reason>" for a method that cannot run here or failed (no
    offload failing is an error: it is the reference).
    """
    import torch

    if "none" not in methods:
        raise ValueError("the methods must include none (the reference)")
    runners, skipped = {}, {}
    opt = None
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif optimizer != "none":
        raise ValueError(f"--optimizer {optimizer!r} is not one of adamw, none")
    grads = _GradCompare(model.parameters(), device)
    try:
        for m in methods:
            try:
                runners[m] = _Runner(m, model, make_batch, device, batch, workdir, default_variant)
            except RuntimeError as e:
                if m == "none":
                    raise
                skipped[m] = f"skipped: {e}"
                log(f"[demo] {m}: {skipped[m]}")
        order = [m for m in methods if m in runners]
        for i in range(warmup + steps):
            what = f"step {i + 1}/{warmup + steps}{' (warm-up)' if i < warmup else ''}"
            if progress is None:
                log(f"[demo] {what}: {', '.join(order)}")
            grads.begin_round()
            for m in list(order):
                if progress is not None:
                    progress.describe(f"{what}: {m}")
                try:
                    runners[m].step(i, measured=i >= warmup)
                    grads.observe(m)
                except Exception as e:  # noqa: BLE001 - one method's failure is its row, not the run's end
                    if m == "none" or isinstance(e, KeyboardInterrupt):
                        raise
                    skipped[m] = f"skipped: failed in step {i + 1}: {_error_text(e)}"
                    log(f"[demo] {m}: {skipped[m]}")
                    order.remove(m)
                    model.zero_grad(set_to_none=True)
                    runners.pop(m).close()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                        torch.cuda.empty_cache()
            if opt is not None:
                opt.step()
            model.zero_grad(set_to_none=True)
            order = order[1:] + order[:1]
            if progress is not None:
                progress.update()
        rows = {}
        for m in methods:
            if m in skipped:
                rows[m] = dict(method=m, status=skipped[m])
                continue
            r = runners[m]
            rows[m] = r.row()
            r.close()
            rows[m]["max_grad_diff"], rows[m]["max_grad_diff_exact"] = grads.result(m)
        return rows
    finally:
        for r in runners.values():
            r.close()


def max_grad_diff(grads, ref):
    worst = 0.0
    for step_g, step_r in zip(grads, ref):
        for g, r in zip(step_g, step_r):
            if (g is None) != (r is None):
                return float("inf")
            if g is not None:
                worst = max(worst, (g.float() - r.float()).abs().max().item())
    return worst


def run_demo(model=DEFAULT_MODEL, methods=METHODS, steps=5, warmup=1, seq=None, batch=None,
             layers=None, hidden=None, heads=None, device=None, dtype="fp32", path=None,
             log=print, attn="eager", compile="none", optimizer="adamw", before_methods=None,
             progress=None):
    """Runs every method on one model; returns a dict with the config and one
    row per method (skipped methods have only method and status).

    Args:
        attn: "eager" or "sdpa" (build_model).
        compile: "none" or "block" (compile_blocks).
        optimizer: "adamw" (one step per round) or "none".
        before_methods: optional f(model, make_batch, device, size) called once
            the model is built, before any method runs; the dict it returns is
            merged into the result (bench/offload_bench.py measures there).
        progress: an ebbtide._progress.Progress advanced once per round
            (run_methods).
    """
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available to torch")
    size = resolve_size(dev, layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch)
    if steps <= 0:
        raise ValueError(f"--steps must be positive, got {steps}")
    valid = METHODS + EXTRA_METHODS
    bad = [m for m in methods if m not in valid]
    if bad:
        raise ValueError(f"--methods: {', '.join(bad)} not valid (valid: {', '.join(valid)})")
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    torch.manual_seed(0)
    net, make_batch = build_model(model, size["layers"], size["hidden"], size["heads"],
                                  size["seq"], torch_dtype, dev, attn=attn)
    variant = compile_blocks(net, compile, offload_variant="compiler-offload" in methods
                             and dev.type == "cuda" and bool(compiler_offload_options()))
    methods = ("none",) + tuple(m for m in methods if m != "none")  # the reference comes first
    extra = before_methods(net, make_batch, dev, size) if before_methods else {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="ebbtide-demo-", dir=path) as workdir:
        results = run_methods(methods, net, make_batch, dev, steps, warmup, size["batch"], workdir, log,
                              optimizer=optimizer, default_variant=variant, progress=progress)
        for method in methods:
            row = results[method]
            if row["status"] == "ok":
                row["bytes_written"] = row.pop("ssd_bytes_written")
                row["tokens_per_second"] = size["batch"] * size["seq"] / row["step_seconds"]
            rows.append(row)
    base_row = rows[0]
    for row in rows:
        if row["status"] != "ok":
            continue
        row["step_time_ratio"] = row["step_seconds"] / base_row["step_seconds"]
        row["peak_ratio"] = row["peak_bytes"] / base_row["peak_bytes"] if base_row["peak_bytes"] else None
        # Note [Step ratios per round]: rounds interleave the methods, so step
        # i of a method and of no offload ran under the same machine load; the
        # spread of their ratios is the run's own noise.
        row["step_time_ratios"] = [t / b for t, b in zip(row["step_seconds_per_step"],
                                                         base_row["step_seconds_per_step"])]
    del net
    result = dict(model=model, device=str(dev), dtype=dtype, steps=steps, warmup=warmup, attn=attn,
                  compile=compile, optimizer=optimizer, **size, **extra, rows=rows)
    for row in rows[1:]:
        if row["status"] == "ok":
            row["verdict"] = verdict(row, result["device"])
    return result


def verdict(row, device):
    """One line saying a method's result against no offload: how much less
    peak step memory at how much more step time, with the spread of the
    per-step time ratios; a spread that contains 1.0 says the time is within
    the run's noise."""
    ratios = row["step_time_ratios"]
    med = row["step_time_ratio"]  # the table's: median step time over no offload's
    lo, hi = min(ratios), max(ratios)
    if len(ratios) < 2:
        spread = "1 step: no spread measured"
    else:
        spread = f"per step {lo:.2f}-{hi:.2f}x over {len(ratios)} steps"
    if lo <= 1.0 <= hi and len(ratios) > 1:
        time_text = f"step time within this run's noise ({med:.2f}x; {spread})"
    else:
        time_text = f"{(med - 1) * 100:+.0f}% step time ({spread})"
    if row["peak_ratio"] is None:
        mem_text = "peak step memory not measured"
    elif not device.startswith("cuda") and row["method"] in _HOST_COPY_METHODS:
        mem_text = "no less memory on the CPU (its copies stay in host memory)"
    else:
        change = (1 - row["peak_ratio"]) * 100
        mem_text = f"{abs(change):.0f}% {'less' if change >= 0 else 'more'} peak step memory"
    return f"{row['method']}: {mem_text} at {time_text}"


def format_table(result):
    from ebbtide import _core

    fb = _core.format_bytes
    w = max([13] + [len(r["method"]) + 1 for r in result["rows"]])
    lines = [f"ebbtide demo: {result['model']} layers={result['layers']} hidden={result['hidden']} "
             f"heads={result['heads']} seq={result['seq']} batch={result['batch']} "
             f"{result['dtype']} attn={result.get('attn', 'eager')} compile={result.get('compile', 'none')} "
             f"on {result['device']}, {result['steps']} steps (+{result['warmup']} warm-up)",
             f"{'method':<{w}}{'step s':>9}{'ratio':>7}{'peak mem':>12}{'ratio':>7}"
             f"{'written':>12}{'max|dgrad|':>12}"]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['method']:<{w}}{r['status']}")
            continue
        peak_ratio = f"{r['peak_ratio']:.2f}" if r["peak_ratio"] is not None else "-"
        lines.append(f"{r['method']:<{w}}{r['step_seconds']:>9.3f}{r['step_time_ratio']:>7.2f}"
                     f"{fb(r['peak_bytes']):>12}{peak_ratio:>7}{fb(r['bytes_written']):>12}"
                     f"{r['max_grad_diff']:>12.3g}{'' if r.get('max_grad_diff_exact', True) else ' (bound)'}")
    for r in result["rows"]:
        s = r.get("stats")
        if s:
            lines.append(f"  {r['method']}: offloaded {s.get('tensors_offloaded', 0)} tensors "
                         f"({fb(s.get('bytes_offloaded', 0))}), kept {s.get('tensors_kept', 0)}, "
                         f"forwarded {s.get('tensors_forwarded', 0)}"
                         + (f" ({fb(s['bytes_discarded'])} written in vain)" if s.get('bytes_discarded') else "")
                         + f" of {fb(s.get('saved_bytes_total', 0))} saved, "
                         f"backward waited {s.get('stall_seconds', 0):.3f} s (last step)")
        if r.get("origin"):
            lines.append(f"  {r['method']}: OffloadActivations from {r['origin']}")
    lines.append("peak mem: the step's peak above its start (CUDA allocator on GPU; on CPU the process "
                 "heap plus ebbtide's host-tier copies): activations, temporaries and gradients.")
    copies = [r["method"] for r in result["rows"] if r["method"] in _HOST_COPY_METHODS]
    if not result["device"].startswith("cuda") and copies:
        lines.append(f"on CPU, {' and '.join(copies)} copy activations to host memory, where they "
                     "already live: they cannot lower it.")
    verdicts = [r["verdict"] for r in result["rows"] if r.get("verdict")]
    if verdicts:
        lines.append("result, against no offload:")
        lines += [f"  {v}" for v in verdicts]
    return "\n".join(lines)


def plot(result, png_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(result)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def figure(result):
    """The demo's plot: throughput against peak step memory, one marker per
    method. Methods are named in a legend beside the axes, not next to their
    points: on the CPU several methods share a point, and labels there would
    print over each other."""
    import matplotlib.pyplot as plt

    markers = "osD^vP*Xh<>"
    fig, ax = plt.subplots(figsize=(8.4, 4.4))
    for i, r in enumerate(r for r in result["rows"] if r["status"] == "ok"):
        ax.scatter([r["peak_bytes"] / 2**20], [r["tokens_per_second"]], s=60 - 6 * i,
                   marker=markers[i % len(markers)], label=r["method"], alpha=0.85)
    ax.set_xlabel("peak step memory (MiB)")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title(f"ebbtide demo: {result['model']} seq={result['seq']} batch={result['batch']} "
                 f"on {result['device']}", fontsize=10)
    ax.grid(True, alpha=0.3)
    # Room around the outermost points, which would otherwise sit on the frame.
    ax.set_xlim(0, ax.get_xlim()[1] * 1.08)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=9, borderaxespad=0)
    fig.tight_layout()
    return fig
