#!/usr/bin/env python3
"""Checkpoint benchmark: a GPT-2 model state with AdamW moments saved to a
directory with ebbtide.checkpoint, compared with fio (same directory, same
run), torch.save/torch.load and torch.distributed.checkpoint (DCP with its
FileSystemWriter/Reader and with ebbtide's DCP storage plugin).

    python bench/ckpt_bench.py --dir /path/on/ssd --size 1.0 [--json out.json]
    python bench/ckpt_bench.py --safetensors --dir /path/on/ssd --size 1.0

--safetensors compares one safetensors file of model weights written and read
by ebbtide (checkpoint.save_safetensors / load_safetensors) with the
safetensors package (save_file + fsync / load_file, page cache dropped) and
fio on the same file; the first call in the process is reported apart, and
a model start (each loader in a fresh process after a pause, --fresh-rounds)
too.

Save times are until durable (fsync'd and committed); loads read from the
device (O_DIRECT for ebbtide, page cache dropped per file for torch.load).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from ebbtide import checkpoint as ckpt


def gpt2_state(size_gb):
    import transformers
    # params + exp_avg + exp_avg_sq in fp32: 12 bytes per parameter.
    target = size_gb * 1e9 / 12
    n_embd, n_layer = 768, 1
    while True:  # grow layers until the parameter count reaches the target
        cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=12, vocab_size=50257,
                                      n_positions=1024, bos_token_id=0, eos_token_id=0)
        n = 50257 * n_embd + 1024 * n_embd + n_layer * 12 * n_embd * n_embd
        if n >= target or n_layer >= 48:
            break
        n_layer += 1
    if n > target * 1.3 and n_layer == 1:  # small sizes: shrink the width
        n_embd = max(64, int((target / 50257) // 64 * 64))
        cfg = transformers.GPT2Config(n_layer=1, n_embd=n_embd, n_head=4, vocab_size=50257, n_positions=256,
                                      bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt, cfg


def state_bytes(sd):
    seen, total = set(), 0

    def walk(o):
        nonlocal total
        if isinstance(o, torch.Tensor):
            k = o.untyped_storage().data_ptr()
            if k not in seen:
                seen.add(k)
                total += o.untyped_storage().nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
    walk(sd)
    return total


def fio(directory, rw, size_bytes, filename="fio.dat", bs="1M", qd=16):
    """fio sequential write (to DIR/fio.dat, fsync at the end) or read: of
    `filename`, which for reads is the ebbtide shard itself (read-only), so
    both readers see the same file on the same part of the disk."""
    if shutil.which("fio") is None:
        return None
    cmd = ["fio", "--name=ckptbench", f"--directory={directory}", f"--rw={rw}", f"--bs={bs}", "--direct=1",
           "--ioengine=io_uring", f"--iodepth={qd}", f"--size={size_bytes}", "--output-format=json",
           f"--filename={filename}"]
    if rw == "write":
        cmd.append("--end_fsync=1")
    else:
        cmd.append("--readonly")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": r.stderr.strip()[-300:]}
    job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    runtime = side["runtime"] / 1e3 or 1e-9
    # job_runtime includes end_fsync for writes; bytes / that is durable bandwidth.
    jr = job.get("job_runtime", side["runtime"]) / 1e3 or runtime
    return {"GBps": side["io_bytes"] / jr / 1e9, "seconds": jr}


def dir_bytes(p):
    total = 0
    for root, _, files in os.walk(p):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def drop_file_cache(p):
    for root, _, files in os.walk(p) if os.path.isdir(p) else [(os.path.dirname(p), [], [os.path.basename(p)])]:
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fsync_tree(p):
    drop = []
    for root, _, files in os.walk(p) if os.path.isdir(p) else [(os.path.dirname(p), [], [os.path.basename(p)])]:
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            drop.append(f)
    fd = os.open(os.path.dirname(p.rstrip("/")) or ".", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def fault_in_seconds(nbytes):
    """Time to map `nbytes` of new anonymous memory and fault every page in
    (MADV_POPULATE_WRITE): what any load into new tensors pays on top of the
    reads. On a VM whose hypervisor reclaims freed guest memory (virtio-balloon
    free page reporting) this is far above a memset."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    t = time.perf_counter()
    rc = libc.madvise(addr, nbytes, 23)  # MADV_POPULATE_WRITE (Linux 5.14+)
    dt = time.perf_counter() - t
    m.close()
    return dt if rc == 0 else None


def touch_pages(tensors):
    """Reads one byte per 4 KiB page of every tensor: a loader that maps the
    file lazily pays its reads here, one that read eagerly pays almost nothing."""
    total = 0
    for t in tensors.values():
        b = t.reshape(-1).view(torch.uint8)
        total += int(b[::4096].sum()) if b.numel() else 0
    return total


def weights_like(size_gb, device="cpu"):
    """A decoder's weights of about `size_gb` GB: bf16 matrices of a 2048-wide
    model plus fp32 norms, random values (incompressible, like trained ones),
    made on `device` (on a GPU in a fraction of the time)."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)
    out, total, i = {}, 0, 0
    vocab = min(32000, max(256, int(size_gb * 1e9 / 4 / 2 / 2048)))  # small sizes: a smaller vocabulary
    out["embed_tokens.weight"] = randn(vocab, 2048).bfloat16()
    total += out["embed_tokens.weight"].nbytes
    while total < size_gb * 1e9:
        if size_gb < 0.2:  # small sizes (the benchmark's own test): small layers
            out[f"layers.{i}.weight"] = randn(512, 2048).bfloat16()
            total += 512 * 2048 * 2
            i += 1
            continue
        for name, shape in (("q_proj", (2048, 2048)), ("k_proj", (512, 2048)), ("v_proj", (512, 2048)),
                            ("o_proj", (2048, 2048)), ("gate_proj", (5632, 2048)), ("up_proj", (5632, 2048)),
                            ("down_proj", (2048, 5632))):
            t = randn(*shape).bfloat16()
            out[f"layers.{i}.{name}.weight"] = t
            total += t.nbytes
        for name in ("input_layernorm", "post_attention_layernorm"):
            out[f"layers.{i}.{name}.weight"] = randn(2048)
            total += 2048 * 4
        i += 1
    return out


_FRESH_LOAD = r"""
import sys, time
sys.path[:0] = sys.argv[3:]
import torch
import ckpt_bench as cb
path, who = sys.argv[1], sys.argv[2]
cb.drop_file_cache(path)
t = time.perf_counter()
if who == "ebbtide":
    from ebbtide import checkpoint
    d = checkpoint.load_safetensors(path)
else:
    import safetensors.torch
    d = safetensors.torch.load_file(path)
cb.touch_pages(d)
print(time.perf_counter() - t)
"""


def fresh_process_loads(path, rounds, pause):
    """A model start: each load in a process of its own, after `pause`
    seconds (on a VM whose hypervisor takes back freed memory, so that
    neither loader gets pages another one just freed), ebbtide and
    safetensors alternating, who goes first rotating per round. The time
    covers the load and touching every page, not the interpreter's start."""
    out = {"ebbtide": [], "safetensors": []}
    here = os.path.dirname(os.path.abspath(__file__))
    for rnd in range(rounds):
        for who in (("ebbtide", "safetensors") if rnd % 2 == 0 else ("safetensors", "ebbtide")):
            time.sleep(pause)
            r = subprocess.run([sys.executable, "-c", _FRESH_LOAD, path, who, here] + [p for p in sys.path if p],
                               capture_output=True, text=True, check=True)
            out[who].append(float(r.stdout.strip().splitlines()[-1]))
    return out


def safetensors_bench(args, work, res):
    import statistics

    import safetensors.torch as sft
    tensors = weights_like(args.size)
    nbytes = sum(t.nbytes for t in tensors.values())
    gb = nbytes / 1e9
    res.update(mode="safetensors", state_bytes=nbytes, tensors=len(tensors))
    ebb, ref = os.path.join(work, "ebb.safetensors"), os.path.join(work, "ref.safetensors")

    def ref_save():
        sft.save_file(tensors, ref)
        fsync_tree(ref)

    def ref_load():
        drop_file_cache(ref)
        d = sft.load_file(ref)
        touch_pages(d)
        return d

    def ebb_load():
        d = ckpt.load_safetensors(ebb)
        touch_pages(d)
        return d
    dst = {k: v.clone() for k, v in tensors.items()}  # a model's weights: allocated and written once

    def ebb_load_into():
        ckpt.load_safetensors(ebb, into=dst)

    def ebb_load_device():  # --device cuda: pinned staging (or cuFile) into device memory
        d = ckpt.load_safetensors(ebb, device=args.device)
        torch.cuda.synchronize()
        return d

    def ref_load_device():
        drop_file_cache(ref)
        d = sft.load_file(ref, device=args.device)
        torch.cuda.synchronize()
        return d
    on_device = args.device != "cpu"
    if on_device and not torch.cuda.is_available():
        raise SystemExit(f"ckpt_bench.py --device {args.device}: torch sees no CUDA device")
    res["ebbtide_save_first_s"], info = timed(lambda: ckpt.save_safetensors(tensors, ebb))
    res["ebbtide_backend"] = info["backend"]
    res["ebbtide_load_first_s"], first = timed(ebb_load)
    assert all(torch.equal(first[k].view(torch.uint8), tensors[k].view(torch.uint8)) for k in tensors)
    del first
    if on_device:
        first = ebb_load_device()
        assert all(torch.equal(first[k].cpu().view(torch.uint8), tensors[k].view(torch.uint8)) for k in tensors)
        del first
    res["safetensors_save_first_s"] = timed(ref_save)[0]
    res["safetensors_load_first_s"] = timed(ref_load)[0]
    rounds = {k: [] for k in ("ebbtide_save_s", "ebbtide_load_s", "ebbtide_load_into_s", "safetensors_save_s",
                              "safetensors_load_s") + (("ebbtide_load_device_s", "safetensors_load_device_s")
                                                       if on_device else ())}
    fws, frs = [], []
    for rnd in range(max(1, args.repeat)):
        steps = [("ebbtide_save_s", lambda: ckpt.save_safetensors(tensors, ebb)), ("safetensors_save_s", ref_save)]
        if not args.no_fio:
            steps.append(("fio_write", None))
        loads = [("ebbtide_load_s", ebb_load), ("ebbtide_load_into_s", ebb_load_into), ("safetensors_load_s", ref_load)]
        if on_device:
            loads += [("ebbtide_load_device_s", ebb_load_device), ("safetensors_load_device_s", ref_load_device)]
        if not args.no_fio:
            loads.append(("fio_read", None))
        for seq in (steps, loads):  # who goes first rotates per round
            k = rnd % len(seq)
            for name, fn in seq[k:] + seq[:k]:
                if name == "fio_write":
                    fws.append(fio(work, "write", os.path.getsize(ebb)))
                    os.unlink(os.path.join(work, "fio.dat"))
                elif name == "fio_read":
                    frs.append(min((fio(work, "read", os.path.getsize(ebb), os.path.basename(ebb), bs=bs, qd=qd)
                                    for bs, qd in (("1M", 16), ("4M", 8))),
                                   key=lambda r: r.get("seconds", float("inf")) if r else float("inf")))
                else:
                    rounds[name].append(timed(fn)[0])
    med = {k: statistics.median(v) for k, v in rounds.items()}
    res.update(med)
    res["rounds"] = rounds

    def med_fio(runs):
        ok = [r for r in runs if r and "GBps" in r]
        if not ok:
            return runs[0] if runs else None
        secs = statistics.median(r["seconds"] for r in ok)
        return {"GBps": os.path.getsize(ebb) / secs / 1e9, "seconds": secs}
    if not args.no_fio:
        res["fio_write"], res["fio_read"] = med_fio(fws), med_fio(frs)
    if args.fresh_rounds > 0:
        fresh = fresh_process_loads(ebb, args.fresh_rounds, args.fresh_pause)
        res["fresh_process_rounds"] = fresh
        res["ebbtide_load_fresh_s"] = statistics.median(fresh["ebbtide"])
        res["safetensors_load_fresh_s"] = statistics.median(fresh["safetensors"])
    res["load_average"] = os.getloadavg()
    res["fault_in_s"] = fault_in_seconds(nbytes)
    fw, fr = res.get("fio_write"), res.get("fio_read")
    rows = []

    def row(name, secs, note=""):
        rows.append((name, f"{secs:.3f}", f"{gb / secs:.2f}", note))
    if fw and "GBps" in fw:
        rows.append(("fio seq write (1M, qd16, direct, fsync)", f"{fw['seconds']:.3f}", f"{fw['GBps']:.2f}", ""))
    row("ebbtide save_safetensors (first call)", res["ebbtide_save_first_s"])
    row("ebbtide save_safetensors (durable)", med["ebbtide_save_s"],
        f"{(gb / med['ebbtide_save_s']) / fw['GBps']:.0%} of fio write" if fw and "GBps" in fw else "")
    row("safetensors save_file + fsync (first call)", res["safetensors_save_first_s"])
    row("safetensors save_file + fsync", med["safetensors_save_s"],
        f"ebbtide {med['safetensors_save_s'] / med['ebbtide_save_s']:.2f}x faster")
    if fr and "GBps" in fr:
        rows.append(("fio seq read of the file (direct, best of 1Mx16/4Mx8)", f"{fr['seconds']:.3f}",
                     f"{fr['GBps']:.2f}", ""))
    row("ebbtide load_safetensors (first call)", res["ebbtide_load_first_s"])
    row("ebbtide load_safetensors", med["ebbtide_load_s"],
        f"{(gb / med['ebbtide_load_s']) / fr['GBps']:.0%} of fio read" if fr and "GBps" in fr else "")
    row("ebbtide load_safetensors(into=existing tensors)", med["ebbtide_load_into_s"],
        f"{(gb / med['ebbtide_load_into_s']) / fr['GBps']:.0%} of fio read" if fr and "GBps" in fr else "")
    if res["fault_in_s"] is not None:
        row("new host memory: map + fault in (no I/O)", res["fault_in_s"], "part of any load into new tensors")
    row("safetensors load_file (first call, cache dropped)", res["safetensors_load_first_s"])
    row("safetensors load_file (cache dropped)", med["safetensors_load_s"],
        f"ebbtide {med['safetensors_load_s'] / med['ebbtide_load_s']:.2f}x faster")
    if args.fresh_rounds > 0:
        n = args.fresh_rounds
        row(f"ebbtide load_safetensors, fresh process (x{n})", res["ebbtide_load_fresh_s"],
            f"{(gb / res['ebbtide_load_fresh_s']) / fr['GBps']:.0%} of fio read" if fr and "GBps" in fr else "")
        row(f"safetensors load_file, fresh process (x{n})", res["safetensors_load_fresh_s"],
            f"ebbtide {res['safetensors_load_fresh_s'] / res['ebbtide_load_fresh_s']:.2f}x faster")
    if on_device:
        row(f"ebbtide load_safetensors(device={args.device!r})", med["ebbtide_load_device_s"],
            f"{(gb / med['ebbtide_load_device_s']) / fr['GBps']:.0%} of fio read" if fr and "GBps" in fr else "")
        row(f"safetensors load_file(device={args.device!r}, cache dropped)", med["safetensors_load_device_s"],
            f"ebbtide {med['safetensors_load_device_s'] / med['ebbtide_load_device_s']:.2f}x faster")
    print(f"\nsafetensors file: {len(tensors)} tensors, {gb:.3f} GB of weights; dir {work}; "
          f"backend {res['ebbtide_backend']}")
    print(f"medians of {max(1, args.repeat)} round(s) after the first calls; load average "
          f"{res['load_average'][0]:.2f} {res['load_average'][1]:.2f} {res['load_average'][2]:.2f}")
    print(f"{'operation':<52} {'seconds':>9} {'GB/s':>7}  note")
    for name, s_, g, note in rows:
        print(f"{name:<52} {s_:>9} {g:>7}  {note}")


def timed(fn):
    t = time.perf_counter()
    r = fn()
    return time.perf_counter() - t, r


def dcp_plugin_rounds(flat, work, repeat):
    """DCP with ebbtide's storage plugin (ebbtide.dcp) against DCP's own
    FileSystemWriter/Reader, same state, same directory: saves until durable
    (FileSystemWriter fsyncs its files; the directory is fsynced after it, the
    plugin commits by rename), loads into the existing state with the page
    cache dropped, async_save's blocking time. The first save of each writer
    object (buffers allocated, staging copy made) is reported apart."""
    import statistics
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from ebbtide.dcp import EbbtideReader, EbbtideWriter
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    fpath, epath = os.path.join(work, "dcp-fs"), os.path.join(work, "dcp-ebb")
    r = {k: [] for k in ("fs_save_s", "ebb_save_s", "fs_load_s", "ebb_load_s", "ebb_async_blocked_s",
                         "ebb_async_total_s", "ebb_astage_blocked_s", "ebb_astage_staged_s", "ebb_astage_total_s")}

    def fs_save():
        dcp.save(flat, storage_writer=FileSystemWriter(fpath))
        fsync_tree(fpath)
    w = EbbtideWriter(epath)
    out = {"dcp_fs_save_first_s": timed(fs_save)[0],
           "dcp_ebb_save_first_s": timed(lambda: dcp.save(flat, storage_writer=w))[0]}
    wa = EbbtideWriter(epath)
    t0 = time.perf_counter()
    fut = dcp.async_save(flat, storage_writer=wa)
    out["dcp_ebb_async_blocked_first_s"] = time.perf_counter() - t0
    fut.result()
    # async_staging=True (Note [Async staging] in ebbtide/checkpoint/dcp_staging.py): async_save returns before the
    # staging copy; a training loop waits for staging_completion at its next optimizer step.
    ws = EbbtideWriter(epath, async_staging=True)

    def staged_save():
        t0 = time.perf_counter()
        resp = dcp.async_save(flat, storage_writer=ws)
        blocked = time.perf_counter() - t0
        resp.staging_completion.result()
        staged = time.perf_counter() - t0
        resp.upload_completion.result()
        return blocked, staged, time.perf_counter() - t0
    out["dcp_ebb_astage_blocked_first_s"], out["dcp_ebb_astage_staged_first_s"], _ = staged_save()
    for _ in range(max(1, repeat)):
        shutil.rmtree(fpath, ignore_errors=True)
        r["fs_save_s"].append(timed(fs_save)[0])
        r["ebb_save_s"].append(timed(lambda: dcp.save(flat, storage_writer=w))[0])
        for p, reader, key in ((fpath, FileSystemReader, "fs_load_s"), (epath, EbbtideReader, "ebb_load_s")):
            drop_file_cache(p)
            r[key].append(timed(lambda: dcp.load(flat, storage_reader=reader(p)))[0])
        t0 = time.perf_counter()
        fut = dcp.async_save(flat, storage_writer=wa)
        r["ebb_async_blocked_s"].append(time.perf_counter() - t0)
        fut.result()
        r["ebb_async_total_s"].append(time.perf_counter() - t0)
        for k, v in zip(("ebb_astage_blocked_s", "ebb_astage_staged_s", "ebb_astage_total_s"), staged_save()):
            r[k].append(v)
    ws.close()
    out.update({f"dcp_{k}": statistics.median(v) for k, v in r.items()})
    out["dcp_rounds"] = r
    shutil.rmtree(fpath, ignore_errors=True)
    shutil.rmtree(epath, ignore_errors=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="target directory (default: a temporary one under .)")
    ap.add_argument("--size", type=float, default=1.0, help="state size in GB (params + 2 AdamW moments, fp32)")
    ap.add_argument("--json", default=None, help="write results as JSON to this file")
    ap.add_argument("--no-fio", action="store_true")
    ap.add_argument("--device", default="cpu",
                    help="with --safetensors: also load into this device (cuda) with ebbtide and with safetensors")
    ap.add_argument("--no-torch", action="store_true", help="skip torch.save / torch.load / DCP")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of (fio write, ebbtide save, fio read / load / load into in turns, async save, "
                         "background save beside a training step); medians are reported")
    ap.add_argument("--fresh-rounds", type=int, default=3,
                    help="--safetensors: rounds of model-start loads, each loader in a fresh process (0: none)")
    ap.add_argument("--fresh-pause", type=float, default=5.0,
                    help="--safetensors: seconds before each fresh-process load (freed memory goes back to the host)")
    ap.add_argument("--safetensors", action="store_true",
                    help="compare safetensors save/load (ebbtide, the safetensors package, fio) instead")
    ap.add_argument("--device-loads", action="store_true",
                    help="loads into --device tensors only: safetensors (ebbtide vs load_file) and DCP (EbbtideReader "
                         "vs FileSystemReader)")
    ap.add_argument("--no-dcp-plugin", action="store_true",
                    help="skip DCP with ebbtide's storage plugin vs FileSystemWriter/Reader")
    ap.add_argument("--stripe-dirs", nargs="*", default=None,
                    help="also time a save/load striped over --dir plus these directories")
    args = ap.parse_args(argv)
    if args.device != "cpu" and not (args.safetensors or args.device_loads):
        ap.error("--device is for --safetensors and --device-loads runs")

    base = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-", dir=".")
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="run-", dir=base)
    res = {"size_arg_gb": args.size, "dir": os.path.abspath(work)}
    try:
        if args.safetensors or args.device_loads:
            if args.device_loads:
                from ckpt_device_loads import device_loads_bench
                device_loads_bench(args, work, res)
            else:
                safetensors_bench(args, work, res)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(res, f, indent=1)
            return 0
        model, opt, cfg = gpt2_state(args.size)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}
        nbytes = state_bytes(state)
        res.update(state_bytes=nbytes, n_layer=cfg.n_layer, n_embd=cfg.n_embd)
        gb = nbytes / 1e9
        rows = []

        import statistics
        w = ckpt.Writer()
        path = os.path.join(work, "ebb")
        t_first, info = timed(lambda: w.save(state, path))        # allocates the snapshot buffers
        res["ebbtide_save_first_s"] = t_first
        res["ebbtide_backend"] = info["backend"]
        # The first load pays for memory the process never touched (on a VM the
        # hypervisor backs it then: seconds per GB); report it apart, like the first save.
        res["ebbtide_load_first_s"] = timed(lambda: ckpt.load(path))[0]
        rounds = {k: [] for k in ("save_s", "load_s", "load_into_s", "blocked_s", "async_total_s",
                                  "bg_call_s", "bg_step_wait_s", "bg_blocked_s", "bg_staged_s", "bg_total_s",
                                  "train_step_s")}
        shard = os.path.join(path, "rank0.ebt")
        fws, frs, frs4 = [], [], []
        ids = torch.randint(0, cfg.vocab_size, (1, 128))

        def train_step():  # what runs between a background save and the optimizer step it must precede
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        for rnd in range(max(1, args.repeat)):
            if not args.no_fio:
                fws.append(fio(work, "write", nbytes))
                try:
                    os.unlink(os.path.join(work, "fio.dat"))
                except OSError:
                    pass
            rounds["save_s"].append(timed(lambda: w.save(state, path))[0])   # warm: buffers reused
            w.join()  # the replaced checkpoint's removal is not part of the next measurement
            # The three readers of the same file take turns at going first: on a VM a
            # second read of a file just read can come from the host's cache.
            readers = {
                "fio": lambda: frs.append(fio(os.path.dirname(shard), "read", os.path.getsize(shard),
                                              os.path.basename(shard))),
                "fio4M": lambda: frs4.append(fio(os.path.dirname(shard), "read", os.path.getsize(shard),
                                                 os.path.basename(shard), bs="4M", qd=8)),
                "load": lambda: rounds["load_s"].append(timed(lambda: ckpt.load(path))[0]),
                "into": lambda: rounds["load_into_s"].append(timed(lambda: ckpt.load(path, into=state))[0]),
            }
            f = fault_in_seconds(nbytes)
            if f is not None:
                rounds.setdefault("fault_in_s", []).append(f)
            order = ["fio", "load", "fio4M", "into"]
            for name in order[rnd % 4:] + order[:rnd % 4]:
                if not name.startswith("fio") or not args.no_fio:
                    readers[name]()
            t0 = time.perf_counter()
            h = w.save(state, path, async_=True)
            rounds["blocked_s"].append(time.perf_counter() - t0)
            h.wait()
            rounds["async_total_s"].append(time.perf_counter() - t0)
            w.join()
            rounds["train_step_s"].append(timed(train_step)[0])
            t0 = time.perf_counter()
            h = w.save(state, path, async_=True, snapshot="background")
            call = time.perf_counter() - t0
            train_step()  # opt.step() waits for the snapshot (Note [Background snapshot])
            h.wait()
            rounds["bg_staged_s"].append(h.snapshot_seconds)
            rounds["bg_total_s"].append(time.perf_counter() - t0)
            rounds["bg_call_s"].append(call)
            rounds["bg_step_wait_s"].append(h.snapshot_wait_seconds)
            rounds["bg_blocked_s"].append(call + h.snapshot_wait_seconds)
            w.join()
        med = {k: statistics.median(v) for k, v in rounds.items() if v}

        def med_fio(runs):
            ok = [r for r in runs if r and "GBps" in r]
            if not ok:
                return runs[0] if runs else None
            secs = statistics.median(r["seconds"] for r in ok)
            return {"GBps": nbytes / secs / 1e9, "seconds": secs, "rounds_s": [r["seconds"] for r in ok]}
        if not args.no_fio:
            res["fio_write"] = med_fio(fws)
            # The reference read is fio's faster setting: 1 MiB x 16 or ebbtide's own 4 MiB x 8.
            res["fio_read_1M_qd16"], res["fio_read_4M_qd8"] = med_fio(frs), med_fio(frs4)
            res["fio_read"] = min((r for r in (res["fio_read_1M_qd16"], res["fio_read_4M_qd8"]) if r and "GBps" in r),
                                  key=lambda r: r["seconds"], default=res["fio_read_1M_qd16"])
        res["rounds"] = rounds
        res["load_average"] = os.getloadavg()
        t_sync, t_load = med["save_s"], med["load_s"]
        t_block, t_async_total = med["blocked_s"], med["async_total_s"]
        res["ebbtide_save_s"] = t_sync
        res["ebbtide_load_s"] = t_load
        res["ebbtide_load_into_s"] = med["load_into_s"]
        res["fault_in_s"] = med.get("fault_in_s")
        res.update(async_blocked_s=t_block, async_total_s=t_async_total, async_blocked_fraction=t_block / t_sync,
                   background_blocked_s=med["bg_blocked_s"], background_call_s=med["bg_call_s"],
                   background_step_wait_s=med["bg_step_wait_s"], background_staged_s=med["bg_staged_s"],
                   background_total_s=med["bg_total_s"], train_step_s=med["train_step_s"],
                   background_blocked_fraction=med["bg_blocked_s"] / t_sync)

        if args.stripe_dirs:
            sdirs = [tempfile.mkdtemp(prefix="stripe-", dir=d) for d in args.stripe_dirs]
            spath = os.path.join(work, "ebb-striped")
            w.save(state, spath, stripe_dirs=sdirs)
            t_ss, sinfo = timed(lambda: w.save(state, spath, stripe_dirs=sdirs))
            t_sl, _ = timed(lambda: ckpt.load(spath))
            res.update(striped_save_s=t_ss, striped_load_s=t_sl, striped_files=len(sinfo["files"]))
            shutil.rmtree(spath, ignore_errors=True)
            for d in sdirs:
                shutil.rmtree(d, ignore_errors=True)

        # Lossless compression: full fp32 state and bf16 weights.
        lpath = os.path.join(work, "ebb-lossless")
        t_l, linfo = timed(lambda: w.save(state, lpath, compress="lossless"))
        res.update(lossless_fp32_state_ratio=linfo["ratio"], lossless_fp32_state_GBps=gb / t_l)
        bf = {k: v.detach().bfloat16() for k, v in model.state_dict().items()}
        bpath = os.path.join(work, "ebb-bf16")
        t_b, binfo = timed(lambda: w.save(bf, bpath, compress="lossless"))
        res.update(lossless_bf16_weights_ratio=binfo["ratio"],
                   lossless_bf16_weights_GBps=binfo["raw_bytes"] / 1e9 / t_b)
        shutil.rmtree(lpath, ignore_errors=True)
        shutil.rmtree(bpath, ignore_errors=True)

        if not args.no_torch:
            tpath = os.path.join(work, "torch.pt")

            def tsave():
                torch.save(state, tpath)
                fsync_tree(tpath)
            t_ts, _ = timed(tsave)
            drop_file_cache(tpath)
            t_tl, _ = timed(lambda: torch.load(tpath, weights_only=True))
            res.update(torch_save_s=t_ts, torch_load_s=t_tl)
            os.unlink(tpath)
            try:
                import torch.distributed.checkpoint as dcp
                dpath = os.path.join(work, "dcp")
                flat = {"model": model.state_dict(), "optimizer": opt.state_dict()}

                def dsave():
                    dcp.save(flat, checkpoint_id=dpath)
                    fsync_tree(dpath)
                t_d, _ = timed(dsave)
                res["dcp_save_s"] = t_d
                shutil.rmtree(dpath, ignore_errors=True)
                try:
                    t0 = time.perf_counter()
                    fut = dcp.async_save(flat, checkpoint_id=dpath + "-async")
                    t_db = time.perf_counter() - t0
                    fut.result()
                    fsync_tree(dpath + "-async")
                    res.update(dcp_async_blocked_s=t_db, dcp_async_total_s=time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    res["dcp_async_error"] = f"{type(e).__name__}: {e}"[:200]
                shutil.rmtree(dpath + "-async", ignore_errors=True)
            except Exception as e:  # noqa: BLE001
                res["dcp_error"] = f"{type(e).__name__}: {e}"[:200]

        if not args.no_dcp_plugin:
            res.update(dcp_plugin_rounds({"model": model.state_dict(), "optimizer": opt.state_dict()}, work,
                                         args.repeat))

        def row(name, secs, note=""):
            rows.append((name, f"{secs:.3f}" if secs is not None else "-",
                         f"{gb / secs:.2f}" if secs else "-", note))
        fw, fr = res.get("fio_write"), res.get("fio_read")
        if fw and "GBps" in fw:
            rows.append(("fio seq write (1M, qd16, direct, fsync)", f"{fw['seconds']:.3f}", f"{fw['GBps']:.2f}", ""))
        row("ebbtide save (first, allocates buffers)", t_first)
        row("ebbtide load (first, fresh process memory)", res["ebbtide_load_first_s"])
        if "striped_save_s" in res:
            row(f"ebbtide save striped over {res['striped_files']} dirs", res["striped_save_s"])
            row(f"ebbtide load striped over {res['striped_files']} dirs", res["striped_load_s"])
        row("ebbtide save (durable, committed)", t_sync,
            f"{(gb / t_sync) / fw['GBps']:.0%} of fio write" if fw and "GBps" in fw else "")
        row("ebbtide async save: caller blocked", t_block, f"{t_block / t_sync:.1%} of sync save")
        row("ebbtide async save: until committed", t_async_total)
        row("training step (fwd+bwd+AdamW, seq 128)", res["train_step_s"])
        row("ebbtide background save: blocked", res["background_blocked_s"],
            f"{res['background_blocked_s'] / t_sync:.1%} of sync save (call {res['background_call_s'] * 1e3:.1f} ms "
            f"+ opt.step wait {res['background_step_wait_s'] * 1e3:.1f} ms)")
        row("ebbtide background save: snapshot taken after", res["background_staged_s"],
            "beside the training step")
        row("ebbtide background save: until committed", res["background_total_s"], "waited after the step")
        if "torch_save_s" in res:
            row("torch.save + fsync", res["torch_save_s"], f"ebbtide {res['torch_save_s'] / t_sync:.2f}x faster")
        if "dcp_save_s" in res:
            row("torch.distributed.checkpoint.save + fsync", res["dcp_save_s"])
        if "dcp_async_blocked_s" in res:
            row("dcp.async_save: caller blocked", res["dcp_async_blocked_s"])
            row("dcp.async_save: until done", res["dcp_async_total_s"])
        if "dcp_ebb_save_s" in res:
            fio_note = (lambda t: f"{(gb / t) / fw['GBps']:.0%} of fio write") if fw and "GBps" in fw \
                else (lambda t: "")
            row("DCP save, FileSystemWriter (first)", res["dcp_fs_save_first_s"])
            row("DCP save, FileSystemWriter", res["dcp_fs_save_s"], fio_note(res["dcp_fs_save_s"]))
            row("DCP save, ebbtide plugin (first)", res["dcp_ebb_save_first_s"])
            row("DCP save, ebbtide plugin", res["dcp_ebb_save_s"],
                f"{fio_note(res['dcp_ebb_save_s'])}; {res['dcp_fs_save_s'] / res['dcp_ebb_save_s']:.2f}x "
                "FileSystemWriter")
            row("DCP async_save, plugin: blocked (first)", res["dcp_ebb_async_blocked_first_s"])
            row("DCP async_save, plugin: blocked", res["dcp_ebb_async_blocked_s"],
                f"{res['dcp_ebb_async_blocked_s'] / res['dcp_ebb_save_s']:.1%} of sync plugin save")
            row("DCP async_save, plugin: until committed", res["dcp_ebb_async_total_s"])
            row("DCP async_save, async_staging: blocked (first)", res["dcp_ebb_astage_blocked_first_s"],
                f"staged after {res['dcp_ebb_astage_staged_first_s']:.3f} s")
            row("DCP async_save, async_staging: blocked", res["dcp_ebb_astage_blocked_s"],
                f"{res['dcp_ebb_astage_blocked_s'] / res['dcp_ebb_save_s']:.1%} of sync plugin save")
            row("DCP async_save, async_staging: staged after", res["dcp_ebb_astage_staged_s"],
                "the next optimizer step waits for this")
            row("DCP async_save, async_staging: until committed", res["dcp_ebb_astage_total_s"])
            row("DCP load, FileSystemReader (cache dropped)", res["dcp_fs_load_s"])
            row("DCP load, ebbtide plugin (cache dropped)", res["dcp_ebb_load_s"],
                f"{res['dcp_fs_load_s'] / res['dcp_ebb_load_s']:.2f}x FileSystemReader")
        for key, label in (("fio_read_1M_qd16", "1M, qd16"), ("fio_read_4M_qd8", "4M, qd8")):
            r = res.get(key)
            if r and "GBps" in r:
                rows.append((f"fio seq read of the shard ({label}, direct)", f"{r['seconds']:.3f}", f"{r['GBps']:.2f}",
                             "reference" if r is fr else ""))
        row("ebbtide load (new tensors)", t_load,
            f"{(gb / t_load) / fr['GBps']:.0%} of fio read" if fr and "GBps" in fr else "")
        row("ebbtide load into the existing state", res["ebbtide_load_into_s"],
            f"{(gb / res['ebbtide_load_into_s']) / fr['GBps']:.0%} of fio read" if fr and "GBps" in fr else "")
        if res["fault_in_s"] is not None:
            row("new host memory: map + fault in (no I/O)", res["fault_in_s"], "part of any load into new tensors")
        if "torch_load_s" in res:
            row("torch.load (page cache dropped)", res["torch_load_s"], f"ebbtide {res['torch_load_s'] / t_load:.2f}x faster")
        rows.append(("lossless, fp32 state + moments", f"{t_l:.3f}", f"{gb / t_l:.2f}",
                     f"ratio {linfo['ratio']:.3f}"))
        rows.append(("lossless, bf16 weights", f"{t_b:.3f}", f"{binfo['raw_bytes'] / 1e9 / t_b:.2f}",
                     f"ratio {binfo['ratio']:.3f}"))
        print(f"\nstate: GPT-2 n_layer={cfg.n_layer} n_embd={cfg.n_embd}, params + AdamW moments = "
              f"{gb:.3f} GB; dir {work}; backend {res['ebbtide_backend']}")
        print(f"medians of {max(1, args.repeat)} round(s); load average {res['load_average'][0]:.2f} "
              f"{res['load_average'][1]:.2f} {res['load_average'][2]:.2f}")
        print(f"{'operation':<46} {'seconds':>9} {'GB/s':>7}  note")
        for name, s, g, note in rows:
            print(f"{name:<46} {s:>9} {g:>7}  {note}")
        if "dcp_async_error" in res:
            print(f"dcp.async_save did not run: {res['dcp_async_error']}")
        if "dcp_error" in res:
            print(f"dcp did not run: {res['dcp_error']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
