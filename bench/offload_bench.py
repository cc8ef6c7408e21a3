#!/usr/bin/env python3
"""Training-step benchmark of activation offloading against its targets.

One model per run, shared by every method; the methods' steps are rotated
round by round (ebbtide.harness.demo, Note [One model for every method]).

Shapes (--shape; --layers/--hidden/... override any of their numbers):
  a  Llama style (--model llama), SDPA attention, 8 layers, hidden 4096, seq 2048, batch 2, bf16
  b  GPT-2 style, SDPA attention, hidden 8192, as many layers as fit (--layers auto:
     measured on the device with 1 and 2 blocks, Note [Layers that fit])
  c  4 layers, hidden 4096, seq 2048, batch 2, eager attention, bf16 (the GPU
     default when no shape is named)
--compile block compiles each transformer block (as torchtitan does) and
enables method compiler-offload (torch's own AOTAutograd offloading).

Columns, per method:
  step s, ratio   median step time (forward + backward), and over no offload's
  fwd s           median forward time (CUDA events on a GPU)
  act peak, ratio peak allocation above the step's start
                  (torch.cuda.max_memory_allocated on a GPU), and over none's
  offl frac       bytes ebbtide finished offloading in a step / eligible bytes
  offl/fwd GB/s   the same bytes / that method's forward time: what the cache
                  moved per second of forward (stores ending in backward count
                  too), not a link measurement
  cut/limit       (1 - peak ratio) / link limit
Per run: eligible bytes (the storages saved-tensor hooks see in one forward,
parameters and buffers excluded), the raw pinned copy GB/s each way (one copy
of up to 1 GiB on a side stream, timed with CUDA events; a host memcpy on the
CPU), and the link limit min(1, D2H GB/s * none's forward time / eligible
bytes): the largest share of the eligible bytes a link can move off the
device before backward begins; and the gradient floor: max|dgrad| between
runs without offloading (Note [Gradient floor]).

Targets (printed PASS/MISS, in the JSON):
  GPU --shape a: ebbtide step ratio <= 1.03 and cut/limit >= 0.8
  GPU --shape b: ebbtide peak ratio <= 0.5 at step ratio <= 1.03
  GPU a and b: where an ebbtide row's peak is at or below torchtune's, its
    step is faster than torchtune's
  GPU otherwise: ebbtide step ratio <= 1.03 and peak ratio < 1
  every run with --grad-check deterministic (the default): each method's
    max|dgrad| against no offload = 0 in the deterministic gradient round
    (below); where that round's no offload did not repeat itself bitwise, or
    with --grad-check floor: max|dgrad| of the timed rounds no larger than
    the gradient floor (twice it for a row whose difference is a bound; 0
    where the floor is 0)
  CPU: ssd step ratio <= 1.05, peak_resident <= 0.5x saved bytes

Gradients (--grad-check): the timed rounds run the model's own kernels, and
on a GPU SDPA's backward is not deterministic, so two runs without
offloading differ there and a floor measured from a few of them is exceeded
by chance (every method missed it on 2026-11-28, torchtune included).
"deterministic" (default) therefore adds one round after the timed ones,
with SDPA's math kernel and torch.use_deterministic_algorithms: no offload
twice (they must agree bitwise, or the round says it proves nothing), then
each method twice against it; offloading must give the same bits (Note
[Deterministic gradient round] in ebbtide/harness/demo.py). Its times and
peaks are not reported; the bytes each method offloaded in it are, so a
check that moved nothing shows as such. "floor" keeps the old floor target
alone; "off" sets no gradient target (the differences are still printed).

Trace (--trace FILE): the step trace `ebbtide plan --replay` reads (docs/
benchmarks.md, "Step traces"): one run per ebbtide row whose cache planned
(TensorCache.trace_run), no offload's (and full recompute's) on the same
profile, each with what this run measured: the step's median, the peak
above its start (the allocator's on a GPU; on the CPU the heap meter's,
said in peak_source), forward and backward medians, the cache's waits and
counters, per block the allocator's level at its forward start and end
and backward start and end (block_levels, from the bench's own module
hooks), and no offload's per-block forward and backward times
(blocks_off; CUDA events on a GPU, host clocks on the CPU).

Methods that cannot run here (no CUDA, torchtune missing, an error) appear as
"skipped: <reason>". Prints a table; --json FILE writes every number.
Exit code: 0 every target met, 3 a target missed (the table and JSON are
complete either way), anything else an error.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from bench_common import write_result, write_trace  # noqa: E402

SHAPES = {
    "a": dict(layers=8, hidden=4096, heads=32, seq=2048, batch=2, attn="sdpa", model="llama"),
    "b": dict(layers="auto", hidden=8192, heads=64, seq=2048, batch=2, attn="sdpa"),
    "c": dict(layers=4, hidden=4096, heads=32, seq=2048, batch=2, attn="eager"),
}
GPU_METHODS = "none,ebbtide-cpu,ebbtide-auto,ebbtide-ssd,torchtune,save_on_cpu,recompute"
CPU_METHODS = "none,ebbtide-ssd,ebbtide-cpu"
GiB = 1 << 30
TARGETS_MISSED = 3  # the exit code of a run that missed a target (0: all met; anything else: an error)


def layers_that_fit(points, budget):
    """The most blocks whose training step fits `budget` bytes.

    Args:
        points: {blocks: {phase: peak bytes}} for two block counts (1 and 2):
            each phase's peak is a line in the number of blocks through them.
        budget: bytes the step may take.

    Returns:
        (blocks, {phase: (fixed bytes, bytes per block)}); at least 1.
    """
    (n1, p1), (n2, p2) = sorted(points.items())
    lines, fits = {}, []
    for phase in p1:
        per = (p2[phase] - p1[phase]) / (n2 - n1)
        fixed = p1[phase] - per * n1
        lines[phase] = (fixed, per)
        if per > 0:
            fits.append(int((budget - fixed) // per))
    return max(1, min(fits, default=1)), lines


def auto_layers(device, model, hidden, heads, seq, batch, attn, dtype, optimizer):
    """How many blocks fit the device, measured (Note [Layers that fit]).

    Returns:
        (layers, the numbers behind it).
    """
    import torch

    from ebbtide.harness.models import build_model

    if device.type != "cuda":
        return 2, dict(reason="not a CUDA device: a small fixed number")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    start = torch.cuda.memory_allocated(device)
    points, saved = {}, {}
    for n in (1, 2):
        torch.manual_seed(0)
        net, make_batch = build_model(model, n, hidden, heads, seq, dtype, device, attn=attn)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4) if optimizer == "adamw" else None
        saved[n] = measure_eligible(net, make_batch, device, batch)["eligible_bytes"]
        peaks = dict(forward_backward=0, optimizer_step=0)
        for i in range(2):  # the first optimizer step makes AdamW's states; the second is the steady state
            inputs = make_batch(batch, torch.Generator().manual_seed(i))
            torch.cuda.reset_peak_memory_stats(device)
            net(**inputs).loss.backward()
            peaks["forward_backward"] = max(peaks["forward_backward"],
                                            torch.cuda.max_memory_allocated(device) - start)
            if opt is not None:
                torch.cuda.reset_peak_memory_stats(device)
                opt.step()
                peaks["optimizer_step"] = max(peaks["optimizer_step"],
                                              torch.cuda.max_memory_allocated(device) - start)
            net.zero_grad(set_to_none=True)
        points[n] = peaks
        del net, opt, make_batch, inputs
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    headroom = int(0.10 * free) + 2 * GiB  # allocator slack, the link probe, the gradient comparison, other methods
    layers, lines = layers_that_fit(points, free - headroom)
    return layers, dict(free_bytes=free, total_bytes=total, headroom_bytes=headroom, probe_peaks=points,
                        fixed_and_per_layer_bytes=lines, saved_bytes_per_layer=saved[2] - saved[1])


# Note [Layers that fit]
# --layers auto (shape b) sizes the model by measuring it, not by a formula:
# the same model with 1 and with 2 blocks runs two training steps on the
# device (forward and backward, then AdamW's step), and the peak allocation
# of each phase is read. Forward and backward peak with everything the
# model saves (whatever attention kernel and MLP it has) plus the gradients
# and the optimizer's states; the optimizer step peaks with the weights,
# gradients, states and the foreach implementation's temporaries (one
# state-sized tensor per parameter at once). Each phase's peak is a line in
# the number of blocks; the count chosen is the largest whose higher line
# stays below the free memory less 10% and 2 GiB. The saved bytes of one
# block (saved-tensor hooks, the eligible bytes of 2 blocks less 1) are
# reported with it. Measured, the count includes what a per-block formula
# (34*s*b*h bytes, Korthikanti et al.) leaves out: the attention kernel's
# own saves and workspace, the MLP's real saves, the logits and the
# optimizer's temporaries, so the no-offload row, the reference, fits.


def measure_grad_floor(model, make_batch, device, batch, runs=3):
    """How far apart the gradients of runs without offloading are: `runs`
    steps of no offload on the same weights, batch and seed (those of a
    round's first step), and max|g_r - g_0| over them (Note [Gradient floor]).

    Returns:
        dict(grad_floor=the largest difference, grad_floor_runs=runs).
    """
    import torch

    from ebbtide.harness.demo import _GradCompare

    compare = _GradCompare(model.parameters(), device)
    compare.begin_round()
    for r in range(runs):
        inputs = make_batch(batch, torch.Generator().manual_seed(1000))
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()
        compare.observe(f"none#{r}")
    model.zero_grad(set_to_none=True)
    floor = max(compare.result(f"none#{r}", "none#0")[0] for r in range(1, runs))
    del compare
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return dict(grad_floor=floor, grad_floor_runs=runs)


# Note [Gradient floor]
# A method's max|dgrad| is measured against no offload's gradients of the
# same round. On a GPU, SDPA's flash and memory-efficient backward kernels
# add their partial sums in a nondeterministic order, so two runs without
# offloading differ too, and "max|dgrad| = 0" would fail for every method
# whatever it did. So before the methods run, no offload runs `runs` times
# on one batch, and the largest difference between them is the floor: a
# method's difference must be no larger. Where every kernel is
# deterministic (eager attention, the CPU) the floor is 0 and the target is
# bitwise equality. A row whose difference is a bound (flagged, when the
# round's reference was another method: d(g, R) + d(g_none, R)) is held to
# twice the floor.


def measure_link(device, nbytes=GiB, repeat=3):
    """Raw copy bandwidth, GB/s (1e9 B/s), each way, best of `repeat`: on CUDA
    a copy_ between device memory and pinned host memory on a side stream,
    timed with CUDA events; on the CPU a host memcpy (there is no link)."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        nbytes = max(1 << 20, min(nbytes, free // 8))
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev.fill_(1)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        samples = {"d2h": [], "h2d": []}
        for _ in range(repeat + 1):  # the first of each is a warm-up
            for way, (dst, src) in (("d2h", (host, dev)), ("h2d", (dev, host))):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(side):
                    e0.record(side)
                    dst.copy_(src, non_blocking=True)
                    e1.record(side)
                e1.synchronize()
                samples[way].append(nbytes / (e0.elapsed_time(e1) / 1e3) / 1e9)
        kind = "device <-> pinned host copy_ on a side stream, CUDA events"
        del dev, host
        torch.cuda.empty_cache()
    else:
        nbytes = min(nbytes, 64 << 20)
        a = torch.ones(nbytes, dtype=torch.uint8)
        b = torch.empty_like(a)
        samples = {"d2h": [], "h2d": []}
        for _ in range(repeat + 1):
            for way, (dst, src) in (("d2h", (b, a)), ("h2d", (a, b))):
                t0 = time.perf_counter()
                dst.copy_(src)
                samples[way].append(nbytes / (time.perf_counter() - t0) / 1e9)
        kind = "host memcpy (no device link on the CPU)"
    samples = {k: v[1:] for k, v in samples.items()}
    return dict(kind=kind, bytes=nbytes, d2h_gbps=max(samples["d2h"]), h2d_gbps=max(samples["h2d"]),
                samples_gbps=samples)


def measure_eligible(model, make_batch, device, batch):
    """Bytes and count of the distinct storages saved-tensor hooks see in one
    forward (identity hooks), parameters and buffers excluded."""
    import torch

    fixed = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen = {}

    def pack(t):
        if isinstance(t, torch.nn.Parameter):
            return t
        st = t.untyped_storage()
        ptr = st.data_ptr()
        # The graph keeps every saved tensor alive until it is freed, so live
        # storages have distinct addresses.
        if ptr not in fixed and (t.device, ptr) not in seen:
            seen[(t.device, ptr)] = st.nbytes()
        return t

    inputs = make_batch(batch, torch.Generator().manual_seed(999))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**inputs).loss
    del loss
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return dict(eligible_bytes=sum(seen.values()), eligible_tensors=len(seen))


def derive(result):
    """Adds the link limit and the per-row derived columns."""
    rows = {r["method"]: r for r in result["rows"]}
    none = rows["none"]
    eligible = result["eligible_bytes"]
    fwd = none["forward_seconds"]
    link = result["link"]["d2h_gbps"] * 1e9
    result["link_limit"] = min(1.0, link * fwd / eligible) if eligible else None
    for r in result["rows"]:
        if r["status"] != "ok":
            continue
        per_step = r.get("bytes_offloaded_per_step")
        if per_step:
            r["offloaded_fraction"] = statistics.median(per_step) / eligible if eligible else None
            r["offloaded_bytes_per_forward_second"] = statistics.median(
                b / f for b, f in zip(per_step, r["forward_seconds_per_step"]) if f > 0)
        else:
            r["offloaded_fraction"] = r["offloaded_bytes_per_forward_second"] = None
        pr, lim = r.get("peak_ratio"), result["link_limit"]
        r["peak_cut_vs_link_limit"] = (1 - pr) / lim if pr is not None and lim else None


def targets(result, shape, gpu):
    """[(name, value, limit, op)] for this run, and lines of comparisons that
    did not apply."""
    rows = {r["method"]: r for r in result["rows"] if r["status"] == "ok"}
    ebb = [m for m in ("ebbtide-auto", "ebbtide-cpu") if m in rows]
    checks, notes = [], []
    if not gpu:
        r = rows.get("ebbtide-ssd")
        if r:
            checks.append(("step time ebbtide-ssd / none <= 1.05", r["step_time_ratio"], 1.05, "<="))
            s = r["stats"]
            ratio = s["peak_resident_bytes"] / s["saved_bytes_total"] if s["saved_bytes_total"] else 0
            checks.append(("peak_resident / no-offload activation peak <= 0.5", ratio, 0.5, "<="))
        return checks, notes
    if shape in ("a", "b"):
        for m in ebb:
            r = rows[m]
            checks.append((f"step time {m} / none <= 1.03", r["step_time_ratio"], 1.03, "<="))
            if shape == "a" and r["peak_cut_vs_link_limit"] is not None:
                checks.append((f"peak cut {m} / link limit >= 0.8", r["peak_cut_vs_link_limit"], 0.8, ">="))
            if shape == "b" and r["peak_ratio"] is not None:
                checks.append((f"activation peak {m} / none <= 0.5", r["peak_ratio"], 0.5, "<="))
        tt = rows.get("torchtune")
        for m in ebb:
            if tt is None:
                notes.append(f"{m} vs torchtune: torchtune did not run")
            elif rows[m]["peak_bytes"] <= tt["peak_bytes"] * 1.02:
                checks.append((f"step {m} / torchtune < 1 (peak <= torchtune's)",
                               rows[m]["step_seconds"] / tt["step_seconds"], 1.0, "<"))
            else:
                notes.append(f"{m} vs torchtune: peak {rows[m]['peak_bytes'] / tt['peak_bytes']:.2f}x "
                             "torchtune's, not comparable at equal peak")
    else:
        for m in ebb:
            r = rows[m]
            checks.append((f"step time {m} / none <= 1.03", r["step_time_ratio"], 1.03, "<="))
            if r["peak_ratio"] is not None:  # a ratio that only holds because nothing moved is no result
                checks.append((f"peak memory {m} / none < 1", r["peak_ratio"], 1.0, "<"))
        for m in ("ebbtide-cpu", "ebbtide-auto", "ebbtide-ssd"):
            s = rows[m]["stats"] if m in rows else None
            if s:
                frac = s["bytes_offloaded"] / s["saved_bytes_total"] if s["saved_bytes_total"] else 0.0
                checks.append((f"{m}: bytes_offloaded / saved_bytes_total > 0", frac, 0.0, ">"))
    grad = result.get("grad_check", "floor")
    det = (rows["none"].get("grad_check") or {}) if grad == "deterministic" else {}
    if grad == "off":
        notes.append("gradients: no target (--grad-check off)")
        return checks, notes
    if det.get("reference_bitwise"):
        for m, r in rows.items():
            g = r.get("grad_check") or {}
            if m == "none":
                continue
            if "error" in g:
                checks.append((f"max|dgrad| {m}, deterministic round (failed: {g['error'][:40]})",
                               float("inf"), 0.0, "<="))
                continue
            checks.append((f"max|dgrad| {m}, deterministic round = 0", g["max_grad_diff"], 0.0, "<="))
            if r.get("stats") is not None and not any(g.get("bytes_offloaded") or ()):
                notes.append(f"{m}: nothing offloaded in the deterministic round, its check tests no offload")
        return checks, notes
    if det:
        why = f"failed ({det['error']})" if "error" in det else \
            "did not repeat itself bitwise (math SDPA, deterministic algorithms)"
        notes.append(f"deterministic round: no offload {why}; the floor target stands instead")
    floor = result.get("grad_floor") or 0.0
    if floor == 0.0:
        worst = max((r["max_grad_diff"] for r in rows.values()), default=0.0)
        checks.append(("max|dgrad| of every method that ran = 0", worst, 0.0, "<="))
    else:  # Note [Gradient floor]
        for m, r in rows.items():
            if m == "none":
                continue
            exact = r.get("max_grad_diff_exact", True)
            checks.append((f"max|dgrad| {m} <= no-offload floor{'' if exact else ' x2 (bound)'}",
                           r["max_grad_diff"], floor if exact else 2 * floor, "<="))
    return checks, notes


def trace_label(args, cfg):
    """The runs' names in the trace: "shape a ...", as replays of older runs name them."""
    label = f"shape {args.shape}" if args.shape else f"{args.model} h={cfg['hidden']}"
    return label + (" compiled" if args.compile == "block" else "")


def format_table(result):
    from ebbtide import _core

    fb = _core.format_bytes

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    link = result["link"]
    w = max(len(r["method"]) for r in result["rows"]) + 1
    lines = [f"offload_bench: {result['model']} layers={result['layers']} hidden={result['hidden']} "
             f"heads={result['heads']} seq={result['seq']} batch={result['batch']} {result['dtype']} "
             f"attn={result['attn']} compile={result['compile']} optimizer={result['optimizer']} "
             f"on {result['device']}, {result['steps']} steps (+{result['warmup']} warm-up)"
             + (f", shape {result['shape']}" if result.get("shape") else ""),
             f"link ({link['kind']}, {fb(link['bytes'])}): D2H {link['d2h_gbps']:.1f} GB/s, "
             f"H2D {link['h2d_gbps']:.1f} GB/s; eligible {fb(result['eligible_bytes'])} in "
             f"{result['eligible_tensors']} storages; link limit {num(result['link_limit'], '.3f')}",
             f"gradient floor (max|dgrad| between {result['grad_floor_runs']} runs without offloading): "
             f"{result['grad_floor']:.3g}" + (" (deterministic: bitwise)" if result["grad_floor"] == 0 else ""),
             f"{'method':<{w}}{'step s':>8}{'ratio':>7}{'fwd s':>8}{'act peak':>11}{'ratio':>7}"
             f"{'offl frac':>10}{'offl/fwd GB/s':>14}{'cut/limit':>10}{'max|dgrad|':>12}"]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['method']:<{w}}{r['status']}")
            continue
        gbps = r["offloaded_bytes_per_forward_second"]
        lines.append(f"{r['method']:<{w}}{r['step_seconds']:>8.3f}{r['step_time_ratio']:>7.2f}"
                     f"{r['forward_seconds']:>8.3f}{fb(r['peak_bytes']):>11}{num(r['peak_ratio'], '.2f'):>7}"
                     f"{num(r['offloaded_fraction'], '.1%'):>10}{num(gbps and gbps / 1e9, '.3g'):>14}"
                     f"{num(r['peak_cut_vs_link_limit'], '.2f'):>10}{r['max_grad_diff']:>12.3g}"
                     + ("" if r.get("max_grad_diff_exact", True) else " (bound)"))
    for r in result["rows"]:
        s = r.get("stats")
        if s:
            lines.append(f"  {r['method']}: last step offloaded {fb(s.get('bytes_offloaded', 0))} "
                         f"({s.get('tensors_offloaded', 0)} tensors), kept {s.get('tensors_kept', 0)}, "
                         f"forwarded {s.get('tensors_forwarded', 0)}, saved {fb(s.get('saved_bytes_total', 0))}, "
                         f"stall {s.get('stall_seconds', 0):.3f} s")
        if r.get("origin"):
            lines.append(f"  {r['method']}: OffloadActivations from {r['origin']}")
    det = next((r.get("grad_check") for r in result["rows"] if r["method"] == "none" and r.get("grad_check")), None)
    if det:
        lines.append(f"deterministic gradient round ({det['mode']}): no offload "
                     + (f"failed: {det['error']}" if "error" in det else "repeats itself bitwise"
                        if det["reference_bitwise"] else "does NOT repeat itself bitwise (the round proves nothing)"))
        for r in result["rows"]:
            g = r.get("grad_check")
            if r["method"] == "none" or not g:
                continue
            moved = ", ".join(fb(b) for b in g.get("bytes_offloaded") or () if b is not None)
            lines.append(f"  {r['method']}: " + (f"failed: {g['error']}" if "error" in g else
                         f"max|dgrad| {g['max_grad_diff']:.3g}" + (f", offloaded {moved} in its two steps"
                                                                   if moved else "")))
    if result.get("compiler_offload_options"):
        lines.append("  compiler-offload: torch._functorch.config "
                     + ", ".join(f"{k}=True" for k in result["compiler_offload_options"]))
    return "\n".join(lines)


def main():
    from ebbtide.harness.models import MODELS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a preset shape (see above)")
    ap.add_argument("--model", default=None, choices=MODELS,
                    help="the demo's random-init HF model (default: llama for --shape a, else gpt2, the "
                         "recorded results)")
    ap.add_argument("--layers", help="a number, or auto: as many as fit the device")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--dtype", default=None, choices=["fp32", "bf16"])
    ap.add_argument("--attn", default=None, choices=["eager", "sdpa"])
    ap.add_argument("--compile", default="none", choices=["none", "block"],
                    help="block: torch.compile each transformer block")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "none"],
                    help="one AdamW step per round on the shared model (default), or none")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--methods", default=None)
    ap.add_argument("--link-bytes", type=int, default=GiB, help="size of the raw copy probe (default 1 GiB)")
    ap.add_argument("--path", default=None, help="directory for SSD files")
    ap.add_argument("--json", default=None, help="write results to this file")
    ap.add_argument("--trace", default=None, help="write the step trace (ebbtide plan --replay) to this file")
    ap.add_argument("--grad-check", default="deterministic", choices=["deterministic", "floor", "off"],
                    help="the gradient target (see above; default deterministic)")
    args = ap.parse_args()
    if args.model is None:
        args.model = SHAPES[args.shape].get("model", "gpt2") if args.shape else "gpt2"

    import torch

    from ebbtide.harness.demo import run_demo

    from ebbtide.harness.methods import compiler_offload_options

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = dev.type == "cuda"
    if gpu and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available to torch")
    if args.shape:
        defaults = {k: v for k, v in SHAPES[args.shape].items() if k != "model"}
        defaults["dtype"] = "bf16"
    elif gpu:
        defaults = dict(SHAPES["c"], dtype="bf16")
    else:
        defaults = dict(layers=6, hidden=256, heads=8, seq=512, batch=4, attn="eager", dtype="fp32")
    defaults["methods"] = GPU_METHODS if gpu else CPU_METHODS
    if args.compile == "block" and gpu:
        defaults["methods"] += ",compiler-offload"
    cfg = {k: getattr(args, k) if getattr(args, k, None) is not None else v for k, v in defaults.items()}
    layers_estimate = None
    if str(cfg["layers"]) == "auto":
        cfg["layers"], layers_estimate = auto_layers(dev, args.model, cfg["hidden"], cfg["heads"], cfg["seq"],
                                                     cfg["batch"], cfg["attn"],
                                                     {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg["dtype"]],
                                                     args.optimizer)
        print(f"[bench] --layers auto: {cfg['layers']} ({layers_estimate})", file=sys.stderr)
    else:
        try:
            cfg["layers"] = int(cfg["layers"])
        except ValueError:
            ap.error(f"--layers {cfg['layers']!r}: a number or auto")

    def before_methods(model, make_batch, device, size):
        out = dict(link=measure_link(device, args.link_bytes))
        out.update(measure_eligible(model, make_batch, device, size["batch"]))
        out.update(measure_grad_floor(model, make_batch, device, size["batch"]))
        return out

    methods = tuple(m.strip() for m in cfg["methods"].split(",") if m.strip())
    result = run_demo(model=args.model, methods=methods, steps=args.steps, warmup=args.warmup,
                      seq=cfg["seq"], batch=cfg["batch"], layers=cfg["layers"], hidden=cfg["hidden"],
                      heads=cfg["heads"], device=str(dev), dtype=cfg["dtype"], path=args.path,
                      attn=cfg["attn"], compile=args.compile, optimizer=args.optimizer,
                      before_methods=before_methods, log=lambda m: print(m, file=sys.stderr),
                      probe_blocks=True, trace_name=trace_label(args, cfg) if args.trace else None,
                      grad_check="deterministic" if args.grad_check == "deterministic" else "off")
    result["shape"] = args.shape
    result["layers_auto"] = layers_estimate
    result["grad_check"] = args.grad_check
    if "compiler-offload" in methods:
        result["compiler_offload_options"] = sorted(k for k in compiler_offload_options() if k != "joint_custom_pass")
    derive(result)
    print(format_table(result))
    checks, notes = targets(result, args.shape if gpu else None, gpu)
    ops = {"<=": lambda v, lim: v <= lim, "<": lambda v, lim: v < lim, ">": lambda v, lim: v > lim,
           ">=": lambda v, lim: v >= lim}
    print("targets:")
    for name, value, limit, op in checks:
        print(f"  {name:<56} {value:7.3f}  {'PASS' if ops[op](value, limit) else 'MISS'}")
    for n in notes:
        print(f"  ({n})")
    result["targets"] = [dict(name=n, value=v, limit=lim, op=op, met=ops[op](v, lim)) for n, v, lim, op in checks]
    result["target_notes"] = notes
    missed = [t["name"] for t in result["targets"] if not t["met"]]
    result["exit_code"] = TARGETS_MISSED if missed else 0
    if args.trace:
        from ebbtide.harness.step_trace import offload_runs

        runs, left_out = offload_runs(result, trace_label(args, cfg))
        result["trace"] = os.path.basename(args.trace)
        write_trace(args.trace, runs, bench="offload_bench", device=result["device"], shape=args.shape,
                    left_out=left_out)
        print(f"trace: {args.trace} ({len(runs)} runs" + (f"; left out: {left_out}" if left_out else "") + ")")
    write_result(result, args.json)
    print(f"targets: {len(missed)} of {len(checks)} missed (exit {TARGETS_MISSED})" if missed
          else f"targets: all {len(checks)} met")
    return result["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
