"""bench/ckpt_bench.py --device-loads: checkpoint loads into device tensors
(CUDA on a GPU), kept apart from ckpt_bench.py for its length; the CLI,
the helpers and the JSON are ckpt_bench.py's."""
import os

import torch

from ebbtide import checkpoint as ckpt


def device_loads_bench(args, work, res):
    """--device-loads: loads into `args.device` tensors (CUDA on a GPU; the CPU
    elsewhere, which checks the bench itself): a safetensors file of weights
    with ebbtide (load_safetensors(device=), and into existing device
    tensors) against safetensors' load_file + .to(device) and
    load_file(device=); a DCP checkpoint of the same tensors into device
    targets with EbbtideReader against FileSystemReader. Page cache dropped
    before each load; who goes first rotates per round; round 0 (the first
    call of each, paying its buffers) is reported apart."""
    import statistics
    import warnings

    import safetensors.torch as sft
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from ckpt_bench import drop_file_cache, fsync_tree, timed, weights_like
    from ebbtide.dcp import EbbtideReader, EbbtideWriter
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    dev = args.device
    if dev != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"ckpt_bench.py --device-loads --device {dev}: torch sees no CUDA device")
    sync = torch.cuda.synchronize if dev != "cpu" else (lambda: None)
    tensors = {k: v.cpu() for k, v in weights_like(args.size, dev).items()}
    nbytes = sum(t.nbytes for t in tensors.values())
    res.update(mode="device_loads", device=dev, state_bytes=nbytes, tensors=len(tensors))
    st, de, df = os.path.join(work, "w.safetensors"), os.path.join(work, "dcp-ebb"), os.path.join(work, "dcp-fs")
    ckpt.save_safetensors(tensors, st)
    dcp.save(tensors, storage_writer=EbbtideWriter(de))
    dcp.save(tensors, storage_writer=FileSystemWriter(df))
    fsync_tree(df)
    targets = {k: torch.empty_like(v, device=dev) for k, v in tensors.items()}  # a model's parameters

    def check(got):
        bad = [k for k, v in tensors.items() if not torch.equal(got[k].cpu().view(torch.uint8), v.view(torch.uint8))]
        assert not bad, f"{bad[0]} loaded wrong"

    def load(path, fn):
        drop_file_cache(path)
        out = fn()
        sync()
        return out
    loads = {
        "ebbtide load_safetensors(device=)": lambda: load(st, lambda: ckpt.load_safetensors(st, device=dev)),
        "ebbtide load_safetensors(into=device tensors)": lambda: load(st, lambda: ckpt.load_safetensors(
            st, into=targets)),
        "safetensors load_file + .to(device)": lambda: load(st, lambda: {k: v.to(dev) for k, v in
                                                                         sft.load_file(st).items()}),
        "safetensors load_file(device=)": lambda: load(st, lambda: sft.load_file(st, device=dev)),
        "DCP load into device targets, EbbtideReader": lambda: load(de, lambda: dcp.load(
            targets, storage_reader=EbbtideReader(de))),
        "DCP load into device targets, FileSystemReader": lambda: load(df, lambda: dcp.load(
            targets, storage_reader=FileSystemReader(df))),
    }
    names = list(loads)
    rounds = {k: [] for k in names}
    for rnd in range(max(1, args.repeat) + 1):
        k = rnd % len(names)
        for name in names[k:] + names[:k]:
            t, got = timed(loads[name])
            rounds[name].append(t)
            if rnd == 0:
                check(targets if got is None or "into" in name else got)
            del got
    res["rounds"] = rounds
    res["first_s"] = {k: v[0] for k, v in rounds.items()}
    res["median_s"] = {k: statistics.median(v[1:]) for k, v in rounds.items()}
    res["load_average"] = os.getloadavg()
    gb = nbytes / 1e9
    med = res["median_s"]
    print(f"\nloads into {dev} tensors: {len(tensors)} tensors, {gb:.3f} GB; dir {work}; medians of "
          f"{max(1, args.repeat)} round(s) after the first; load average {res['load_average'][0]:.2f}")
    print(f"{'load':<50} {'first s':>8} {'s':>8} {'GB/s':>7}  note")
    ref = {"ebbtide load_safetensors(device=)": "safetensors load_file + .to(device)",
           "ebbtide load_safetensors(into=device tensors)": "safetensors load_file + .to(device)",
           "DCP load into device targets, EbbtideReader": "DCP load into device targets, FileSystemReader"}
    for name in names:
        note = f"{med[ref[name]] / med[name]:.2f}x {ref[name]}" if name in ref else ""
        print(f"{name:<50} {res['first_s'][name]:8.3f} {med[name]:8.3f} {gb / med[name]:7.2f}  {note}")
