"""`ebbtide ckpt inspect PATH`: lists a checkpoint's tensors, sizes and
compression, checks it as load() does, with load()'s own validator (Note [One
validator] in ebbtide/checkpoint/checks.py), and verifies every chunk's checksum
and the data load() checks (`--no-verify`: no tensor data is read).
Exit 1 when a shard would be refused by load() (one `BAD SHARD: why` line
each, load()'s message) or a chunk is bad (one `BAD CHUNK: ...` line each,
naming the tensor and the file offset); exit 2, with one line, when the index
itself is unusable.

PATH may also be a safetensors file, an HF model.safetensors.index.json or a
directory holding either: its tensors are listed (name, dtype, shape, bytes)
and each validation error is one `BAD FILE: FILE: why` line (exit 1). Or a
torch.distributed.checkpoint directory (one with a `.metadata`, written by
ebbtide.dcp or torch's FileSystemWriter, or one `__<rank>.metadata` per rank
from a save without collectives, each shown in turn): its entries and data files are
listed, the metadata checked as the loader does, the byte ranges against the
files and, for ebbtide's files, every chunk's checksum (one `BAD FILE:` line
each, exit 1)."""
import json
import os
import sys


def register(sub):
    p = sub.add_parser("ckpt", help="inspect ebbtide checkpoints")
    s = p.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND")
    s.required = True
    i = s.add_parser("inspect", help="list tensors and verify checksums")
    i.add_argument("path")
    i.add_argument("--no-verify", action="store_true", help="skip reading the data")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=_inspect)


# Checks that end within this many seconds show no progress bar: only a
# large checkpoint's verification takes longer.
_PROGRESS_DELAY_S = 1.0


def _verify_progress(args):
    """A byte-counting progress bar for verifying a checkpoint (shown only on a
    terminal, without --json, when verifying, and after _PROGRESS_DELAY_S)."""
    from ebbtide._progress import progress, wanted
    return progress(desc="ebbtide ckpt inspect: verifying", shown=wanted(args.json) and not args.no_verify,
                    unit="B", unit_scale=True, delay=_PROGRESS_DELAY_S, tick_s=0.5)


def _fmt(n):
    from ebbtide import _core
    return _core.format_bytes(float(n))


def _one_line(text):
    return " ".join(str(text).split())


def _inspect(args):
    from ebbtide import checkpoint
    from ebbtide.checkpoint import safetensors as _safetensors
    if _safetensors.looks_like_safetensors(args.path):
        return _inspect_safetensors(args)
    if os.path.isdir(args.path):
        if os.path.lexists(os.path.join(args.path, ".metadata")):
            return _inspect_dcp(args)
        from ebbtide import dcp
        ranks = dcp.rank_metadata_ranks(args.path)
        if ranks:  # saved without collectives: one metadata per rank
            return max(_inspect_dcp(args, rank) for rank in ranks)
    if os.path.isdir(args.path) and not os.path.lexists(os.path.join(args.path, checkpoint.INDEX_NAME)):
        print(f"ebbtide ckpt inspect: error: {args.path} is not a checkpoint in a format this reads: it has no "
              f"{checkpoint.INDEX_NAME} (ebbtide.checkpoint), .metadata or __<rank>.metadata "
              "(torch.distributed.checkpoint), model.safetensors or model.safetensors.index.json (safetensors)",
              file=sys.stderr)
        return 2
    try:
        with _verify_progress(args) as bar:
            info = checkpoint.inspect(args.path, verify=not args.no_verify, progress=bar.set)
    except (OSError, ValueError, NotImplementedError) as e:
        print(f"ebbtide ckpt inspect: error: {_one_line(e)}", file=sys.stderr)
        return 2
    refused = sum(1 for s in info["shards"] if "error" in s)
    bad = sum(len(s.get("problems", [])) for s in info["shards"])
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 1 if bad or refused else 0
    idx = info["index"]
    print(f"{info['path']}: format version {idx['format_version']}, world size {idx['world_size']}, "
          f"compression {idx.get('compress', 'none')}" + (f", delta against {idx['delta']['base']}" if idx.get("delta") else ""))
    for s in info["shards"]:
        if "error" in s and not s["tensors"]:  # refused before its tables could be listed
            print(f"BAD SHARD: {_one_line(s['error'])}", file=sys.stderr)
            continue
        ratio = s["raw_bytes"] / s["stored_bytes"] if s["stored_bytes"] else 1.0
        print(f"\n{s['file']}: {_fmt(s['file_bytes'])} on disk, {_fmt(s['raw_bytes'])} of storages, "
              f"{_fmt(s['stored_bytes'])} stored (ratio {ratio:.2f})")
        print(f"  {'tensor':<56} {'dtype':<14} {'shape':<18} {'bytes':>10} {'stored':>10} {'codec':<12} offset")
        for t in s["tensors"]:
            shape = "x".join(map(str, t["shape"])) or "()"
            note = " (shares storage)" if t["shared"] else ""
            print(f"  {t['path'][:56]:<56} {t['dtype']!s:<14} {shape:<18} {_fmt(t['nbytes']):>10} "
                  f"{_fmt(t['stored_bytes']):>10} {t['codec']:<12} {t['offset']}{note}")
        le = s.get("lossy_error")
        try:
            o = le["overall"]
            print(f"  lossy error: max abs {float(o['max_abs']):.3g}, relative L2 {float(o['rel_l2']):.3g} "
                  f"over {int(o['tensors'])} tensors")
        except (TypeError, KeyError, ValueError):
            pass  # none recorded (lossless), or not in the form the writer records it
        chain = s.get("chain", [])
        if len(chain) > 1:
            _print_chain(chain, verified=not args.no_verify)
        for link in chain or [{"file": s["file"], "problems": s.get("problems", [])}]:
            for name, off, msg in link["problems"]:
                print(f"BAD CHUNK: {link['file']}: tensor '{name}' at file offset {off}: {_one_line(msg)}",
                      file=sys.stderr)
        if "error" in s:  # refused for its data (sparse indices, lossy codes): found when verifying
            print(f"BAD SHARD: {_one_line(s['error'])}", file=sys.stderr)
    if refused:
        print(f"\n{refused} shard(s) would be refused by load()", file=sys.stderr)
    if args.no_verify:
        print("\nchecksums not verified (--no-verify)")
    elif bad:
        print(f"\n{bad} bad chunk(s)", file=sys.stderr)
    elif not refused:
        print("\nall chunk checksums OK")
    return 1 if bad or refused else 0


def _print_chain(chain, verified):
    """The delta chain from this checkpoint down to its full base. Each delta
    decodes against its base as loaded, so the error of the loaded state is
    the top link's alone: errors do not add up along the chain."""
    print(f"  delta chain ({len(chain)} checkpoints, this one first; each link checked by id"
          f"{' and checksums' if verified else ''}):")
    for k, link in enumerate(chain):
        le = link.get("lossy_error")
        err = (f"max abs {float(le['max_abs']):.3g}, rel L2 {float(le['rel_l2']):.3g}"
               if isinstance(le, dict) and "max_abs" in le else "exact")
        state = f"{len(link['problems'])} BAD CHUNK(S)" if link["problems"] else "ok" if verified else ""
        print(f"    [{k}] {link['file']}  id {link['id'][:12]}  {link['compress']:<8} "
              f"{_fmt(link['stored_bytes']):>10}  error vs exact: {err}  {state}")
    top = chain[0].get("lossy_error")
    if isinstance(top, dict) and "rel_l2" in top:
        print(f"  error bound of the loaded state: max abs {float(top['max_abs']):.3g}, "
              f"rel L2 {float(top['rel_l2']):.3g} (the top link's: bases decode exactly as they were encoded against)")


def _inspect_safetensors(args):
    from ebbtide.checkpoint import safetensors as _safetensors
    try:
        info = _safetensors.inspect(args.path)
    except (OSError, ValueError, NotImplementedError) as e:
        print(f"ebbtide ckpt inspect: error: {_one_line(e)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 1 if info["errors"] else 0
    files = info["files"]
    print(f"{info['path']}: safetensors" + (f", index of {len(files)} file(s)" if info["index"] else ""))
    for f in files:
        if "error" in f:
            continue
        total = sum(t["nbytes"] for t in f["tensors"])
        print(f"\n{f['file']}: {_fmt(f['file_bytes'])} on disk, {len(f['tensors'])} tensors, {_fmt(total)}"
              + (f", metadata {json.dumps(f['metadata'])[:200]}" if f["metadata"] else ""))
        print(f"  {'tensor':<56} {'dtype':<12} {'shape':<18} {'bytes':>10}")
        for t in f["tensors"]:
            shape = "x".join(map(str, t["shape"])) or "()"
            print(f"  {_one_line(t['name'])[:56]:<56} {t['dtype']:<12} {shape:<18} {_fmt(t['nbytes']):>10}")
    for e in info["errors"]:
        print(f"BAD FILE: {_one_line(e)}", file=sys.stderr)
    if info["errors"]:
        print(f"\n{len(info['errors'])} problem(s)", file=sys.stderr)
        return 1
    print("\nheaders valid")
    return 0


def _inspect_dcp(args, rank=None):
    from ebbtide import dcp
    try:
        with _verify_progress(args) as bar:
            info = dcp.inspect(args.path, verify=not args.no_verify, rank=rank, progress=bar.set)
    except (OSError, ValueError) as e:
        print(f"ebbtide ckpt inspect: error: {_one_line(e)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 1 if info["errors"] else 0
    whose = "" if rank is None else f" (rank {rank}'s, saved without collectives)"
    print(f"{info['path']}: torch.distributed.checkpoint{whose}, {len(info['items'])} entries, "
          f"{len(info['files'])} data file(s)")
    print(f"\n  {'entry':<56} {'dtype':<12} {'shape':<18} {'bytes':>10} chunks")
    for it in info["items"]:
        shape = "x".join(map(str, it["size"])) if it["size"] is not None else "-"
        nbytes = _fmt(it["bytes"]) if it["bytes"] is not None else "(pickled)"
        print(f"  {_one_line(it['fqn'])[:56]:<56} {it['dtype'] or 'bytes':<12} {shape or '()':<18} {nbytes:>10} "
              f"{it['chunks']}")
    print()
    for f in info["files"]:
        where = f"{_fmt(f['file_bytes'])} on disk" if "file_bytes" in f else "unreadable"
        print(f"{f['file']}: {f.get('writer', '?')}, {where}, {f['items']} items, {_fmt(f['bytes'])}, "
              f"codecs {','.join(f.get('codecs', ['?']))}")
        for sf in f.get("stripe_files", []):
            print(f"  stripe file {sf}")
    for e in info["errors"]:
        print(f"BAD FILE: {_one_line(e)}", file=sys.stderr)
    if info["errors"]:
        print(f"\n{len(info['errors'])} problem(s)", file=sys.stderr)
        return 1
    print("\nmetadata valid" + ("" if args.no_verify else ", all chunk checksums and ranges OK"))
    return 0
