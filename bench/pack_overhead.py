#!/usr/bin/env python3
"""Per-saved-tensor cost of saved-tensor hooks on the training thread.

Workload: a chain of OPS matmuls x = x @ w_i of SIZE x SIZE fp32 tensors
(x0 and every w_i require grad, so each matmul saves its two inputs: 2 x OPS
saved tensors of SIZE*SIZE*4 bytes, 16 KiB at the default size), forward and
backward. The weights are nn.Parameters, as in a model: a cache passes them
through unchanged (it never offloads parameters), so half of the saved
tensors reach the cache. --weights tensor makes them plain tensors held by the
caller, so every saved tensor takes the cache's full path (and, offloaded,
is answered at unpack from the caller's tensor instead of a reload).

Methods:
  none                 no hooks
  identity             saved_tensors_hooks(lambda t: t, lambda t: t)
  save_on_cpu          torch.autograd.graph.save_on_cpu; on cuda with pin_memory=True
                       (copies to pinned memory), on cpu its default, which
                       copies nothing (tensor.cpu() of a host tensor is itself)
  save_on_cpu-copy     cpu only: save_on_cpu(pin_memory=True), which on a
                       machine without CUDA copies each tensor once, at pack
                       (the like-for-like comparison for ebbtide-cpu, which
                       copies at pack and again at unpack)
  ebbtide-kept         long-lived TensorCache(target="cpu"), min_bytes above
                       every tensor: nothing offloaded, the hooks' own cost
  ebbtide-cpu          long-lived TensorCache(target="cpu", min_bytes=0)
  ebbtide-ssd          long-lived TensorCache(target="ssd", min_bytes=0) in a
                       temporary directory
  ebbtide-offload-ctx  `with ebbtide.offload(None, target="cpu", min_bytes=0)`
                       per step (construction and close included); separately,
                       the cost of entering and leaving that context with
                       nothing saved (5 samples per repeat)

On cpu torch runs one intra-op thread unless --threads says otherwise (the
cache's store threads get the other cores). Each repeat runs every method
once, the order rotating by one per repeat so drift on a shared machine hits
all alike; one untimed warm-up repeat first.
Reported: median step seconds (wall; on cuda synchronized), the training
thread's CPU seconds (time.thread_time, insensitive to other processes), the
overhead per saved tensor over `none` from the medians, its ratio to the
identity hooks' overhead, and max |grad - grad(none)| (must be 0: the hooks
must not change a bit).

Targets: ebbtide-kept overhead <= 2x identity's; ebbtide-cpu overhead below
save_on_cpu's; offload() enter + leave under 1 ms after the first step.
Prints a table; --json FILE writes every number. No target is checked in
tests: timings depend on the machine.
"""
import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from bench_common import write_result  # noqa: E402

ALL_METHODS = ("none", "identity", "save_on_cpu", "save_on_cpu-copy", "ebbtide-kept", "ebbtide-cpu", "ebbtide-ssd",
               "ebbtide-offload-ctx")
CTX_SAMPLES = 5  # empty offload() contexts timed per repeat


def make_workload(ops, size, device, weights="parameter", seed=0):
    """x0 and OPS weights (nn.Parameter or plain tensors); orthogonal weights
    keep the chain's values (and gradients) finite however long it is."""
    import torch

    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(ops, size, size, generator=g))
    ws = [w.contiguous().to(device).requires_grad_() for w in q.unbind(0)]
    if weights == "parameter":
        ws = [torch.nn.Parameter(w.detach()) for w in ws]
    x0 = torch.randn(size, size, generator=g).to(device).requires_grad_()
    return x0, ws


def forward_backward(x0, ws):
    x = x0
    for w in ws:
        x = x @ w
    x.sum().backward()


def flat_grads(x0, ws):
    import torch

    return torch.cat([x0.grad.flatten()] + [w.grad.flatten() for w in ws]).cpu()


def count_saved(x0, ws):
    """How many tensors autograd saves in one step (counted by a pack hook)."""
    import torch

    n = [0]

    def pack(t):
        n[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward_backward(x0, ws)
    return n[0]


class Runner:
    """Runs one step of a method; long-lived caches persist across repeats."""

    def __init__(self, device, tensor_bytes, workdir):
        import ebbtide

        self.device = device
        self.caches = {}
        self.tensor_bytes = tensor_bytes
        self.workdir = workdir
        self.ebbtide = ebbtide
        self.last_stats = {}
        self.ctx_seconds = []
        self.ctx_thread_cpu_seconds = []

    def cache(self, method):
        if method not in self.caches:
            TC = self.ebbtide.TensorCache
            if method == "ebbtide-kept":
                c = TC(target="cpu", min_bytes=2 * self.tensor_bytes, device=self.device)
            elif method == "ebbtide-cpu":
                c = TC(target="cpu", min_bytes=0, device=self.device)
            else:
                c = TC(target="ssd", path=self.workdir, min_bytes=0, device=self.device)
            self.caches[method] = c
        return self.caches[method]

    def time_empty_ctx(self):
        for _ in range(CTX_SAMPLES):
            t0, c0 = time.perf_counter(), time.thread_time()
            with self.ebbtide.offload(None, target="cpu", min_bytes=0, device=self.device):
                pass
            self.ctx_seconds.append(time.perf_counter() - t0)
            self.ctx_thread_cpu_seconds.append(time.thread_time() - c0)

    def step(self, method, x0, ws, sync):
        """One forward + backward; returns (wall seconds, training-thread CPU seconds)."""
        import torch

        if method == "ebbtide-offload-ctx":
            self.time_empty_ctx()
        if method in ("ebbtide-kept", "ebbtide-cpu", "ebbtide-ssd"):
            cache = self.cache(method)
        x0.grad = None
        for w in ws:
            w.grad = None
        gc.collect()
        sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        if method == "none":
            forward_backward(x0, ws)
        elif method == "identity":
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                forward_backward(x0, ws)
        elif method in ("save_on_cpu", "save_on_cpu-copy"):
            pin = self.device.startswith("cuda") or method == "save_on_cpu-copy"
            with torch.autograd.graph.save_on_cpu(pin_memory=pin):
                forward_backward(x0, ws)
        elif method == "ebbtide-offload-ctx":
            with self.ebbtide.offload(None, target="cpu", min_bytes=0, device=self.device) as c:
                forward_backward(x0, ws)
        else:
            with cache.step():
                forward_backward(x0, ws)
            c = cache
        sync()
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        if method.startswith("ebbtide"):
            self.last_stats[method] = c.stats()
        return dt, dc

    def close(self):
        for c in self.caches.values():
            c.close()


STAT_KEYS = ("tensors_saved", "tensors_offloaded", "tensors_kept", "tensors_forwarded",
             "tensors_reloaded", "tensors_reused", "bytes_offloaded", "bytes_reloaded",
             "saved_bytes_total", "peak_resident_bytes", "stall_seconds")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    ap.add_argument("--ops", type=int, default=4000, help="matmuls in the chain (default 4000)")
    ap.add_argument("--size", type=int, default=64,
                    help="tensors are SIZE x SIZE fp32 (default 64: 16 KiB)")
    ap.add_argument("--weights", default="parameter", choices=["parameter", "tensor"],
                    help="nn.Parameter weights (default; the cache passes them through) "
                    "or plain tensors")
    ap.add_argument("--repeats", type=int, default=9, help="timed steps per method (default 9)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repeats first (default 1)")
    ap.add_argument("--methods", default=",".join(ALL_METHODS), help="comma-separated, from: " +
                    ", ".join(ALL_METHODS))
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: 1 on cpu, torch's own on cuda; "
                    "0: torch's own)")
    ap.add_argument("--path", default=None,
                    help="directory for ebbtide-ssd (default: a temporary one)")
    ap.add_argument("--json", default=None, help="write every number to this file")
    args = ap.parse_args()

    import torch

    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in ALL_METHODS]
    if bad or not methods:
        ap.error(f"--methods: unknown {bad} (valid: {', '.join(ALL_METHODS)})")
    if "none" not in methods:
        methods.insert(0, "none")  # the baseline every number is relative to
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    dev = args.device
    if dev.startswith("cuda") and "save_on_cpu-copy" in methods:
        methods.remove("save_on_cpu-copy")  # on cuda save_on_cpu itself copies (pinned)
    threads = args.threads if args.threads is not None else (0 if dev.startswith("cuda") else 1)
    if threads:
        # OpenMP workers spin-wait for each other: on a busy machine a
        # descheduled one stalls every small matmul, which would swamp the
        # hooks' cost. The hooks run on the calling thread in any case.
        torch.set_num_threads(threads)
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)

    x0, ws = make_workload(args.ops, args.size, dev, args.weights)
    tensor_bytes = args.size * args.size * 4
    saved = count_saved(x0, ws)
    tmp = tempfile.TemporaryDirectory(prefix="ebbtide-pack-") if args.path is None else None
    runner = Runner(dev, tensor_bytes, args.path or tmp.name)
    for t in [x0] + ws:
        t.grad = None
    forward_backward(x0, ws)
    ref = flat_grads(x0, ws)  # what every method's gradients must equal, bit for bit
    times = {m: [] for m in methods}
    cpu_times = {m: [] for m in methods}
    grad_diff = {m: 0.0 for m in methods}
    try:
        for r in range(args.warmup + args.repeats):
            k = r % len(methods)
            for m in methods[k:] + methods[:k]:
                dt, dc = runner.step(m, x0, ws, sync)
                grad_diff[m] = max(grad_diff[m], (flat_grads(x0, ws) - ref).abs().max().item())
                if r >= args.warmup:
                    times[m].append(dt)
                    cpu_times[m].append(dc)
    finally:
        runner.close()
        if tmp is not None:
            tmp.cleanup()

    med = {m: statistics.median(times[m]) for m in methods}
    cmed = {m: statistics.median(cpu_times[m]) for m in methods}
    us = {m: (med[m] - med["none"]) / saved * 1e6 for m in methods}
    cus = {m: (cmed[m] - cmed["none"]) / saved * 1e6 for m in methods}
    ident = us.get("identity")

    def vs_identity(m):
        return us[m] / ident if ident is not None and ident > 0 else None

    rows = []
    for m in methods:
        row = dict(method=m, median_step_seconds=med[m], step_seconds=times[m],
                   median_thread_cpu_seconds=cmed[m], thread_cpu_seconds=cpu_times[m],
                   us_per_tensor=us[m], thread_cpu_us_per_tensor=cus[m],
                   ratio_to_identity=vs_identity(m), max_grad_diff=grad_diff[m])
        s = runner.last_stats.get(m)
        if s is not None:
            row["stats"] = {k: s[k] for k in STAT_KEYS if k in s}
        rows.append(row)

    ctx = None
    if "ebbtide-offload-ctx" in methods:
        later = runner.ctx_seconds[1:]
        later_cpu = runner.ctx_thread_cpu_seconds[1:]
        ctx = dict(samples_seconds=runner.ctx_seconds, first_seconds=runner.ctx_seconds[0],
                   median_seconds=statistics.median(later) if later else None,
                   max_seconds=max(later) if later else None,
                   thread_cpu_seconds=runner.ctx_thread_cpu_seconds,
                   median_thread_cpu_seconds=statistics.median(later_cpu) if later_cpu else None)

    checks = []
    if "ebbtide-kept" in methods and "identity" in methods:
        checks.append(("ebbtide-kept us/tensor / identity us/tensor <= 2",
                       vs_identity("ebbtide-kept"), 2.0, "<="))
    if "ebbtide-cpu" in methods and "save_on_cpu" in methods:
        v = us["ebbtide-cpu"] / us["save_on_cpu"] if us["save_on_cpu"] > 0 else None
        checks.append(("ebbtide-cpu us/tensor / save_on_cpu us/tensor < 1", v, 1.0, "<"))
    if "ebbtide-cpu" in methods and "save_on_cpu-copy" in methods:
        v = us["ebbtide-cpu"] / us["save_on_cpu-copy"] if us["save_on_cpu-copy"] > 0 else None
        checks.append(("ebbtide-cpu us/tensor / save_on_cpu-copy us/tensor < 1", v, 1.0, "<"))
    if ctx is not None and ctx["median_seconds"] is not None:
        checks.append(("offload() enter+leave, median after the first (ms) < 1",
                       ctx["median_seconds"] * 1e3, 1.0, "<"))
        checks.append(("offload() enter+leave, max after the first (ms) < 1",
                       ctx["max_seconds"] * 1e3, 1.0, "<"))
    ops = {"<=": lambda v, lim: v <= lim, "<": lambda v, lim: v < lim}

    load = os.getloadavg()
    print(f"chain of {args.ops} matmuls {args.size}x{args.size} fp32 on {dev}, {args.weights} "
          f"weights: {saved} saved tensors of {tensor_bytes / 1024:g} KiB per step; "
          f"{args.repeats} repeats (+{args.warmup} warm-up), medians; torch threads "
          f"{torch.get_num_threads()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'method':<20} {'step s':>8} {'us/tensor':>10} {'x identity':>10} "
          f"{'cpu us/tensor':>13} "
          f"{'to cache':>8} {'offloaded':>9} {'kept':>6} {'fwd':>5} {'max|grad diff|':>14}")
    for row in rows:
        s = row.get("stats", {})
        ratio = row["ratio_to_identity"]
        print(f"{row['method']:<20} {row['median_step_seconds']:8.3f} {row['us_per_tensor']:10.1f} "
              f"{'' if ratio is None else f'{ratio:.2f}':>10} "
              f"{row['thread_cpu_us_per_tensor']:13.1f} "
              f"{s.get('tensors_saved', ''):>8} {s.get('tensors_offloaded', ''):>9} "
              f"{s.get('tensors_kept', ''):>6} {s.get('tensors_forwarded', ''):>5} "
              f"{row['max_grad_diff']:14.3g}")
    if ctx is not None:
        later = ("" if ctx["median_seconds"] is None else
                 f"; after it: median {ctx['median_seconds'] * 1e3:.3f} ms, "
                 f"max {ctx['max_seconds'] * 1e3:.3f} ms (training thread's CPU: median "
                 f"{ctx['median_thread_cpu_seconds'] * 1e3:.3f} ms)")
        print(f"offload() enter+leave, nothing saved ({len(ctx['samples_seconds'])} samples): "
              f"first "
              f"{ctx['first_seconds'] * 1e3:.3f} ms{later}")
    print("targets:")
    targets = []
    for name, value, limit, op in checks:
        met = None if value is None else ops[op](value, limit)
        verdict = "n/a (identity overhead <= 0)" if value is None else ("PASS" if met else "MISS")
        print(f"  {name:<58} {'' if value is None else f'{value:8.3f}':>8}  {verdict}")
        targets.append(dict(name=name, value=value, limit=limit, op=op, met=met))

    result = dict(device=dev, ops=args.ops, size=args.size, dtype="fp32", weights=args.weights,
                  repeats=args.repeats,
                  warmup=args.warmup, threads=torch.get_num_threads(), load_average=list(load),
                  tensors_saved=saved, tensor_bytes=tensor_bytes, methods=methods, rows=rows,
                  offload_ctx=ctx, targets=targets, command=" ".join(sys.argv))
    write_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
