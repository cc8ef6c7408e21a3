"""The adaptive cache's SSD probe against the rates the steps' own writes and
reads see (docs/benchmarks.md, "The SSD probe against the steps' own rates").

    python bench/probe_bench.py --dir /work/tmp/probe [--rounds 4] [--json out.json]

Each round makes a fresh cache on a fresh directory (as a training run's
first profile meets it), probes the SSD tier with the adaptive cache's probe
size, then runs `--steps` steps of eight MLP blocks (Linear(1024, 4096) ->
GELU -> Linear(4096, 1024), batch 256) with every activation offloaded to the
SSD, and reads the store's meters over the steps after the first (the
steady state a plan is made for). It prints each round's probe and step
rates and the ratio probe / step, the planner's error on this disk.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _ssd(core) -> dict:
    return next(t for t in core.stats()["tiers"] if t["tier"] == "ssd")


def one_round(base: str, steps: int, probe_bytes: int) -> dict:
    import torch

    import ebbtide
    from ebbtide import _core

    d = tempfile.mkdtemp(prefix="probe-", dir=base)
    try:
        torch.manual_seed(0)
        blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                                           torch.nn.Linear(4096, 1024)) for _ in range(8)])
        x = torch.randn(256, 1024)
        cache = ebbtide.TensorCache(target="ssd", path=d, adaptive=False, min_bytes=1 << 16)
        try:
            w, r = cache._core.probe(_core.TIER_SSD, probe_bytes)
            cache.attach(blocks)
            before = None
            for step in range(steps):
                with cache.step():
                    blocks(x).sum().backward()
                if step == 0:
                    before = _ssd(cache._core)
            after = _ssd(cache._core)
        finally:
            cache.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    dw = after["bytes_written"] - before["bytes_written"]
    sw = after["write_seconds"] - before["write_seconds"]
    dr = after["bytes_read"] - before["bytes_read"]
    sr = after["read_seconds"] - before["read_seconds"]
    out = dict(probe_write_bps=probe_bytes / w, probe_read_bps=probe_bytes / r,
               step_write_bps=dw / sw if sw > 0 else 0.0, step_read_bps=dr / sr if sr > 0 else 0.0,
               step_bytes_written=dw, step_bytes_read=dr)
    out["write_ratio"] = out["probe_write_bps"] / out["step_write_bps"] if out["step_write_bps"] else None
    out["read_ratio"] = out["probe_read_bps"] / out["step_read_bps"] if out["step_read_bps"] else None
    return out


def main(argv=None) -> int:
    from ebbtide.cache import adaptive

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a directory on the SSD to test (rounds make fresh ones inside)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="steps a round (the first is not metered)")
    ap.add_argument("--json", help="write every round's figures here")
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.steps < 2:
        ap.error("--rounds must be >= 1 and --steps >= 2")
    os.makedirs(a.dir, exist_ok=True)
    probe_bytes = adaptive._PROBE_BYTES
    rounds = [one_round(a.dir, a.steps, probe_bytes) for _ in range(a.rounds)]
    print(f"SSD probe ({probe_bytes >> 20} MiB, the adaptive cache's) against the steps' own rates, {a.dir}")
    print(f"{'round':>5} {'probe w GB/s':>13} {'step w GB/s':>12} {'w ratio':>8} {'probe r GB/s':>13} "
          f"{'step r GB/s':>12} {'r ratio':>8}")
    for i, r in enumerate(rounds):
        print(f"{i:>5} {r['probe_write_bps'] / 1e9:>13.2f} {r['step_write_bps'] / 1e9:>12.2f} "
              f"{r['write_ratio']:>8.2f} {r['probe_read_bps'] / 1e9:>13.2f} {r['step_read_bps'] / 1e9:>12.2f} "
              f"{r['read_ratio']:>8.2f}")
    med_w = statistics.median(r["write_ratio"] for r in rounds)
    med_r = statistics.median(r["read_ratio"] for r in rounds)
    print(f"median probe / step: write {med_w:.2f}, read {med_r:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(dir=a.dir, probe_bytes=probe_bytes, steps=a.steps, rounds=rounds,
                           median_write_ratio=med_w, median_read_ratio=med_r,
                           loadavg=os.getloadavg()), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
