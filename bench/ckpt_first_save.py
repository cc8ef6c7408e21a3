"""First and later checkpoint saves in one fresh process: the synchronous
A/B of Note [Save ring] (docs/benchmarks-journal.md, session 14), and what an async
save blocks its caller for (issue 31 §2).

    python bench/ckpt_first_save.py --mode native --dir /var/tmp/ckb/ab [--json out.json]
    python bench/ckpt_first_save.py --mode dcp --dir /var/tmp/ckb/ab
    python bench/ckpt_first_save.py --mode async --dir /var/tmp/ckb/as --size 1.3 [--json out.json]

native / dcp: one JSON line: the first synchronous save's seconds, the later
ones', the CPU seconds of each, the growth of the process's RSS and the
writer's buffers.

async: for ebbtide.checkpoint.save and for dcp.async_save through
EbbtideWriter, each way of copying in a fresh process of its own (the
default copy; snapshot="none" / staging="none", which copy nothing): the
first async save's blocking time, every later one's against one memory copy
of the state timed right before it (the floor of a save that copies), and
the median synchronous save of the same state in the same process, with
the ratios; a table, and with --json every time measured and the load
average. --device cuda puts the state on the GPU (the copy is then D2H).

async-ab: the later calls of the three copying async paths (native, DCP
with a flat state dict, DCP with the state under one key) in ONE process,
round after round in a rotating order, each round beside one copy of the
state: the ratios between paths, free of the process-to-process spread of
a shared machine (one process's memory copies ran 1.5x another's).

    python bench/ckpt_first_save.py --mode async-ab --dir /var/tmp/ckb/ab --size 1.4 --saves 12
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


def sync_saves(args):
    import torch.distributed.checkpoint as dcp

    from ckpt_bench import weights_like
    from ebbtide import checkpoint
    from ebbtide.dcp import EbbtideWriter

    state = weights_like(args.size)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    target = os.path.join(args.dir, "c")
    rss0 = rss_bytes()
    if args.mode == "native":
        writer = checkpoint.Writer()
        native = writer._native
        save = lambda: writer.save(state, target)  # noqa: E731
    else:
        writer = EbbtideWriter(target)
        native = writer._native
        save = lambda: dcp.save(state, storage_writer=writer)  # noqa: E731
    wall, cpu = [], []
    for _ in range(args.saves):
        c0, t0 = time.process_time(), time.perf_counter()
        save()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        writer.join()
    return {"mode": args.mode, "state_bytes": sum(t.nbytes for t in state.values()),
            "first_s": round(wall[0], 3), "later_s": [round(t, 3) for t in wall[1:]],
            "cpu_s": [round(c, 3) for c in cpu], "rss_growth_mb": round((rss_bytes() - rss0) / 2**20),
            "writer_buffers_mb": native.snapshot_capacity >> 20}


def copy_reference(state, device):
    """A function timing one memory copy of `state` (the floor of a save
    that snapshots): host state by a checkpoint writer's stage() into memory
    faulted in beforehand (its threads, streaming stores: what a snapshot
    does), CUDA state by torch's copy into page-locked host tensors (a D2H
    copy); (seconds, CPU seconds of the process)."""
    import torch

    from ebbtide import _core
    if device == "cpu":
        w = _core.CkptWriter()
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        for v in dst.values():
            v.view(-1).view(torch.uint8).fill_(1)  # faulted in: a steady save's arena is
        copies = [(dst[k].data_ptr(), v.data_ptr(), v.nbytes, False, 0) for k, v in state.items()]

        def run(keep=dst):  # the destination lives as long as the function
            t0, c0 = time.perf_counter(), time.process_time()
            w.stage(copies)
            return time.perf_counter() - t0, time.process_time() - c0
    else:
        dst = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}

        def run():
            torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            for k, v in state.items():
                dst[k].copy_(v, non_blocking=True)
            torch.cuda.synchronize()
            return time.perf_counter() - t0, time.process_time() - c0
    run()
    return run


def dcp_state(path, state):
    """What the DCP path `path` passes to dcp.(async_)save: "dcp-wrapped",
    the state under one key, as torchtitan and HF's trainers pass a model's
    or optimizer's; torch's async_save wraps each top-level value in a logged
    call of its own (two DEBUG records each), so a flat dict of N tensors
    ("dcp") pays that N times."""
    return {"model": state} if path == "dcp-wrapped" else state


def async_run(path, copy, size, directory, saves, device="cpu"):
    """In this (fresh) process: the first async save, `saves` - 1 later ones,
    then `saves` synchronous ones, all of one state to one path. Each async
    save is waited for and the writer joined before the next (the gap a
    training loop leaves between saves); one memory copy of the state is
    timed right before each later one. copy=None: the synchronous saves
    only (the first one in a fresh process)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpt_bench import weights_like
    from ebbtide import checkpoint
    from ebbtide.dcp import EbbtideWriter

    state = weights_like(size, device)
    if device != "cpu":
        torch.cuda.synchronize()
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    target = os.path.join(directory, "c")
    if path == "native":
        w = checkpoint.Writer()
        snapshot = "blocking" if copy else "none"

        def asave():
            return w.save(state, target, async_=True, snapshot=snapshot)

        def finish(h):
            h.wait()

        def ssave():
            w.save(state, target)
    else:
        w = EbbtideWriter(target, staging="copy" if copy else "none")
        dstate = dcp_state(path, state)

        def asave():
            return dcp.async_save(dstate, storage_writer=w)

        def finish(f):
            f.result()

        def ssave():
            dcp.save(dstate, storage_writer=w)
    blocked, cpu, total, joined, copies, copies_cpu = [], [], [], [], [], []
    ref = None
    for i in range(saves if copy is not None else 0):
        if i:
            # Made after the first call, which then meets the machine as the first
            # sync save of its own process does (faulting in a state's worth of
            # memory for the reference before it slowed it by 6-11%).
            ref = ref or copy_reference(state, device)
            c = ref()
            copies.append(c[0])
            copies_cpu.append(c[1])
        t0, c0 = time.perf_counter(), time.process_time()
        h = asave()
        blocked.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        finish(h)
        total.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        w.join()
        joined.append(time.perf_counter() - t1)
    sync = []
    for _ in range(saves):
        t0 = time.perf_counter()
        ssave()
        sync.append(time.perf_counter() - t0)
        w.join()
    if copy is None:
        return {"path": path, "sync_s": sync, "loadavg": os.getloadavg()}
    return {"path": path, "copy": copy, "device": device, "state_bytes": sum(t.nbytes for t in state.values()),
            "first_blocked_s": blocked[0], "later_blocked_s": blocked[1:], "copy_s": copies,
            "later_vs_copy": [b / c for b, c in zip(blocked[1:], copies)], "later_cpu_s": cpu[1:],
            "copy_cpu_s": copies_cpu, "later_cpu_vs_copy": [b / max(c, 1e-9) for b, c in zip(cpu[1:], copies_cpu)],
            "async_total_s": total,
            "join_s": joined, "sync_s": sync, "loadavg": os.getloadavg()}


ROWS = (("native", True, "checkpoint.save(async_=True)"),
        ("native", False, "checkpoint.save(async_=True, snapshot='none')"),
        ("dcp", True, "dcp.async_save, EbbtideWriter()"),
        ("dcp", False, "dcp.async_save, EbbtideWriter(staging='none')"),
        ("dcp-wrapped", True, "dcp.async_save({'model': state}), EbbtideWriter()"))


def child(args, path, copy, tag):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{path},{tag}", "--size", str(args.size),
           "--dir", os.path.join(args.dir, f"{path}-{tag}"), "--saves", str(args.saves), "--device", args.device]
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"ckpt_first_save: the {path} run ({tag}) failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def async_bench(args):
    runs, first_sync = [], {}
    for path, copy, name in ROWS:
        if args.only and path.split("-")[0] != args.only:
            continue
        if path not in first_sync:  # the first synchronous save in a fresh process, for comparison
            first_sync[path] = child(args, path, None, "sync")["sync_s"][0]
        r = child(args, path, copy, int(copy))
        sync = statistics.median(r["sync_s"])
        later = r["later_blocked_s"]
        r.update(name=name, sync_median_s=sync, first_sync_s=first_sync[path],
                 first_ratio=r["first_blocked_s"] / sync, first_vs_first_sync=r["first_blocked_s"] / first_sync[path],
                 later_ratio=[b / sync for b in later], later_max_ratio=max(later) / sync if later else float("nan"),
                 later_vs_copy_max=max(r["later_vs_copy"]) if later else float("nan"))
        runs.append(r)
    print(f"{'async save':<46} {'sync s':>6} {'1st sync':>8} {'first blocked (/sync, /1st sync)':>33}  "
          "later calls blocked: s (/ one copy of the state timed before it; CPU s / the copy's CPU s)")
    for r in runs:
        later = "  ".join(f"{b:.3f} ({q:.2f}x; {c:.2f}x)" for b, q, c in zip(r["later_blocked_s"], r["later_vs_copy"],
                                                                             r["later_cpu_vs_copy"]))
        print(f"{r['name']:<46} {r['sync_median_s']:6.3f} {r['first_sync_s']:8.3f} {r['first_blocked_s']:9.3f} s "
              f"{r['first_ratio']:7.1%} {r['first_vs_first_sync']:7.1%}  {later}")
    pairs = {(r["path"], r["copy"]): r for r in runs}
    firsts = {}
    if args.first_rounds > 1:
        # The first call against the first sync save, each in fresh processes that
        # alternate, `first_rounds` of each: one pair moves with the disk's mood.
        quick = argparse.Namespace(**{**vars(args), "saves": 2})
        for (path, copy), r in pairs.items():
            if not copy:
                continue
            a, f = [r["first_blocked_s"]], [r["first_sync_s"]]
            for _ in range(args.first_rounds - 1):
                f.append(child(quick, path, None, "sync")["sync_s"][0])
                a.append(child(quick, path, copy, int(copy))["first_blocked_s"])
            # Each round's two processes ran one after the other: their ratio
            # leaves out the load's drift between rounds.
            pairs_r = [x / y for x, y in zip(a, f)]
            firsts[path] = {"first_blocked_s": a, "first_sync_s": f,
                            "ratio_of_medians": statistics.median(a) / statistics.median(f),
                            "pair_ratios": pairs_r, "median_pair_ratio": statistics.median(pairs_r)}
            print(f"first call, {r['name']}: {args.first_rounds} fresh processes each, alternating: blocked "
                  f"{', '.join(f'{x:.3f}' for x in a)} s; 1st sync {', '.join(f'{x:.3f}' for x in f)} s; "
                  f"medians {statistics.median(a) / statistics.median(f):.1%}; median of the rounds' ratios "
                  f"{statistics.median(pairs_r):.1%}")
    for dpath in ("dcp", "dcp-wrapped"):
        if ("native", True) not in pairs or (dpath, True) not in pairs:
            continue
        n, d = pairs[("native", True)], pairs[(dpath, True)]
        # Each later call against the copy timed right before it, in its own process: the
        # two processes run at different moments of a shared machine.
        print(f"later {dpath} calls / later native calls (each over its copy): worst DCP {d['later_vs_copy_max']:.2f}x "
              f"vs native median {statistics.median(n['later_vs_copy']):.2f}x -> "
              f"{d['later_vs_copy_max'] / statistics.median(n['later_vs_copy']):.2f}; worst native "
              f"{n['later_vs_copy_max']:.2f}x; in CPU seconds: worst DCP {max(d['later_cpu_vs_copy']):.2f}x, "
              f"native median {statistics.median(n['later_cpu_vs_copy']):.2f}x")
    gb = runs[0]["state_bytes"] / 1e9 if runs else 0
    print(f"state {gb:.3f} GB on {args.device}, {args.saves} async and {args.saves} sync saves per fresh process "
          "('sync s': their median; '1st sync': the first sync save in a fresh process of its own; each async "
          "save waited for and the writer joined before the next); targets: first <= 100% of the 1st sync save, "
          "later <= 1.2x one copy of the state, DCP <= 1.1x native")
    return {"size_gb": gb, "device": args.device, "saves": args.saves, "first_sync_s": first_sync, "runs": runs,
            "first_rounds": firsts}


AB_PATHS = (("native", "checkpoint.save(async_=True)"),
            ("dcp", "dcp.async_save(state), EbbtideWriter()"),
            ("dcp-wrapped", "dcp.async_save({'model': state}), EbbtideWriter()"))


def async_ab(args):
    """Later async calls of the copying paths alternated in one process
    (--mode async-ab); the first call of each is made and left out."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpt_bench import weights_like
    from ebbtide import checkpoint
    from ebbtide.dcp import EbbtideWriter

    state = weights_like(args.size, args.device)
    if args.device != "cpu":
        torch.cuda.synchronize()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    native = checkpoint.Writer()
    writers = {"dcp": EbbtideWriter(os.path.join(args.dir, "d")),
               "dcp-wrapped": EbbtideWriter(os.path.join(args.dir, "w"))}

    def call(path):
        """(blocked s, CPU s) of one async save, waited for and joined after."""
        t0, c0 = time.perf_counter(), time.process_time()
        if path == "native":
            h = native.save(state, os.path.join(args.dir, "n"), async_=True)
        else:
            h = dcp.async_save(dcp_state(path, state), storage_writer=writers[path])
        out = (time.perf_counter() - t0, time.process_time() - c0)
        h.wait() if path == "native" else h.result()
        (native if path == "native" else writers[path]).join()
        return out

    for path, _ in AB_PATHS:
        call(path)  # the first calls: write-through, not measured here
    ref = copy_reference(state, args.device)
    blocked = {p: [] for p, _ in AB_PATHS}
    cpu = {p: [] for p, _ in AB_PATHS}
    copies = []
    for i in range(args.saves):
        copies.append(ref()[0])
        order = [p for p, _ in AB_PATHS]
        order = order[i % len(order):] + order[:i % len(order)]
        for p in order:
            b, c = call(p)
            blocked[p].append(b)
            cpu[p].append(c)
    med = {p: statistics.median(v) for p, v in blocked.items()}
    med_cpu = {p: statistics.median(v) for p, v in cpu.items()}
    copy = statistics.median(copies)
    print(f"{'later async calls, one process':<52} {'median s':>8} {'/ copy':>7} {'/ native':>8} "
          f"{'CPU / native':>12}  every call, s")
    for p, name in AB_PATHS:
        print(f"{name:<52} {med[p]:8.4f} {med[p] / copy:6.2f}x {med[p] / med['native']:7.3f}x "
              f"{med_cpu[p] / med_cpu['native']:11.3f}x  {' '.join(f'{x:.4f}' for x in blocked[p])}")
    gb = sum(t.nbytes for t in state.values()) / 1e9
    print(f"state {gb:.3f} GB on {args.device}, {len(state)} tensors; {args.saves} rounds in a rotating order, "
          f"one copy of the state per round (median {copy:.4f} s); target: DCP <= 1.1x native")
    return {"mode": "async-ab", "size_gb": gb, "tensors": len(state), "device": args.device, "rounds": args.saves,
            "copy_s": copies, "blocked_s": blocked, "cpu_s": cpu, "median_s": med,
            "vs_native": {p: med[p] / med["native"] for p in med},
            "cpu_vs_native": {p: med_cpu[p] / med_cpu["native"] for p in med_cpu}, "loadavg": os.getloadavg()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("native", "dcp", "async", "async-ab"), default="native")
    ap.add_argument("--dir", required=True, help="scratch directory (emptied first)")
    ap.add_argument("--size", type=float, default=1.0, help="state size in GB")
    ap.add_argument("--saves", type=int, default=4, help="saves of each kind per process")
    ap.add_argument("--device", default="cpu", help="--mode async: where the state lives (cuda: the staging copy is a D2H copy)")
    ap.add_argument("--only", choices=("native", "dcp"), help="--mode async: one of the two paths (dcp: both state shapes)")
    ap.add_argument("--first-rounds", type=int, default=1,
                    help="--mode async: fresh processes for the first call and for the first sync save, each "
                         "(alternating; medians compared)")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # PATH,COPY: one async run, in this process
    args = ap.parse_args()
    if args.saves < 2:
        ap.error("--saves must be at least 2 (a first save and a later one)")
    if args.child:
        path, copy = args.child.split(",")
        print(json.dumps(async_run(path, None if copy == "sync" else copy == "1", args.size, args.dir, args.saves,
                                   args.device)))
        return
    if args.mode == "async":
        out = async_bench(args)
    elif args.mode == "async-ab":
        out = async_ab(args)
    else:
        out = sync_saves(args)
        print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
