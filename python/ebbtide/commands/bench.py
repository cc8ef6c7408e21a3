"""`ebbtide bench io`: storage engine throughput, optionally against fio.

Writes --size bytes through the engine and reads them back (data verified),
then, with --vs-fio, runs fio with the equivalent settings (O_DIRECT, same
block size and queue depth, same directories and size) in the same run and
prints our/fio ratios.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from ebbtide import _core


def register(subparsers):
    p = subparsers.add_parser("bench", help="benchmarks (io)")
    sub = p.add_subparsers(dest="bench", metavar="BENCH")
    sub.required = True
    io = sub.add_parser("io", help="storage engine write/read throughput")
    io.add_argument("--dir", action="append", dest="dirs", metavar="DIR",
                    help="target directory (repeat to stripe); default: a temporary directory")
    io.add_argument("--size", default="1GiB", help="bytes to write and read (default 1GiB)")
    io.add_argument("--chunk", default="1MiB", help="I/O chunk and stripe unit (default 1MiB)")
    io.add_argument("--qd", type=int, default=16, help="queue depth per device (default 16)")
    io.add_argument("--request", default="64MiB", help="bytes per engine request (default 64MiB)")
    io.add_argument("--backend", default="auto", choices=["auto", "uring", "posix"])
    io.add_argument("--checksum", action="store_true", help="crc32c per chunk")
    io.add_argument("--no-device", action="store_true", help="skip GPU transfers")
    io.add_argument("--vs-fio", action="store_true", help="also run fio with equivalent settings")
    io.add_argument("--repeat", type=int, default=1,
                    help="runs of each (ebbtide and fio alternating); medians are reported")
    io.add_argument("--json", action="store_true", help="print JSON instead of a table")
    io.set_defaults(func=run_io)


def _fio_job_args(dirs, size, chunk, qd, rw, backend):
    engine = "io_uring" if backend in ("auto", "uring") else "psync"
    per_dir = size // len(dirs)
    args = ["--output-format=json", "--group_reporting"]
    for i, d in enumerate(dirs):
        args += [f"--name=ebbtide-fio-{i}", f"--directory={d}", f"--rw={rw}", f"--bs={chunk}",
                 f"--iodepth={qd}", f"--ioengine={engine}", "--direct=1", f"--size={per_dir}",
                 "--numjobs=1", "--end_fsync=1" if rw == "write" else "--invalidate=1"]
        if engine == "io_uring":
            args += ["--fixedbufs=1", "--registerfiles=1"]
    return args


def run_fio(dirs, size, chunk, qd, backend):
    """Sequential write then read with fio; returns (write_gbps, read_gbps)."""
    fio = shutil.which("fio")
    if fio is None:
        raise RuntimeError("--vs-fio: fio is not installed (apt-get install fio)")
    out = {}
    try:
        for rw in ("write", "read"):
            proc = subprocess.run([fio] + _fio_job_args(dirs, size, chunk, qd, rw, backend),
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"fio {rw} failed: {proc.stderr.strip() or proc.stdout[-500:]}")
            text = proc.stdout[proc.stdout.find("{"):]
            job = json.loads(text)["jobs"][0]
            side = job["write" if rw == "write" else "read"]
            out[rw] = side["io_bytes"] / (side["runtime"] / 1e3) / 1e9 if side["runtime"] else 0.0
    finally:
        for i, d in enumerate(dirs):
            for name in os.listdir(d):
                if name.startswith(f"ebbtide-fio-{i}."):
                    os.unlink(os.path.join(d, name))
    return out["write"], out["read"]


def run_io(args):
    size = _core.parse_bytes(args.size, "--size")
    chunk = _core.parse_bytes(args.chunk, "--chunk")
    request = _core.parse_bytes(args.request, "--request")
    if size <= 0:
        raise ValueError("--size must be positive")
    if args.qd <= 0:
        raise ValueError(f"--qd must be positive, got {args.qd}")
    tmp = None
    dirs = args.dirs
    if not dirs:
        tmp = tempfile.mkdtemp(prefix="ebbtide-bench-", dir=os.environ.get("TMPDIR", "/var/tmp"))
        dirs = [tmp]
    if args.repeat <= 0:
        raise ValueError(f"--repeat must be positive, got {args.repeat}")
    try:
        runs, fio_runs = [], []
        # Alternate ours and fio so slow drifts of a shared disk hit both alike.
        for _ in range(args.repeat):
            runs.append(dict(_core.bench_io(dirs=dirs, size=size, chunk=chunk, qd=args.qd,
                                            backend=args.backend, request=request,
                                            checksum=args.checksum,
                                            device=not args.no_device)))
            if args.vs_fio:
                fio_runs.append(run_fio(dirs, size, chunk, args.qd, args.backend))
        result = dict(runs[-1])
        for key in ("write_gbps", "read_gbps", "device_write_gbps", "device_read_gbps"):
            result[key] = statistics.median(r[key] for r in runs)
        result["verified"] = all(r["verified"] for r in runs)
        result.update(dirs=dirs, size=size, chunk=chunk, qd=args.qd, repeat=args.repeat)
        if args.repeat > 1:
            result["runs"] = [{k: r[k] for k in ("write_gbps", "read_gbps")} for r in runs]
        if args.vs_fio:
            fw = statistics.median(f[0] for f in fio_runs)
            fr = statistics.median(f[1] for f in fio_runs)
            result.update(fio_write_gbps=fw, fio_read_gbps=fr,
                          write_vs_fio=result["write_gbps"] / fw if fw else None,
                          read_vs_fio=result["read_gbps"] / fr if fr else None)
            if args.repeat > 1:
                result["fio_runs"] = [dict(write_gbps=w, read_gbps=r) for w, r in fio_runs]
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print_table(result)
    return 0


def print_table(r):
    print(f"ebbtide bench io: {r['describe']}")
    print(f"  dirs={','.join(r['dirs'])} size={_core.format_bytes(r['size'])} "
          f"chunk={_core.format_bytes(r['chunk'])} qd={r['qd']} O_DIRECT={r['direct']}"
          + (f" (median of {r['repeat']} runs each)" if r["repeat"] > 1 else ""))
    rows = [("host write", r["write_gbps"], r.get("fio_write_gbps")),
            ("host read", r["read_gbps"], r.get("fio_read_gbps"))]
    if r.get("device_measured"):
        rows += [("device->file", r["device_write_gbps"], None),
                 ("file->device", r["device_read_gbps"], None)]
    has_fio = "fio_write_gbps" in r
    head = f"  {'transfer':<14}{'ebbtide GB/s':>14}"
    if has_fio:
        head += f"{'fio GB/s':>12}{'ratio':>8}"
    print(head)
    for name, ours, fio in rows:
        line = f"  {name:<14}{ours:>14.3f}"
        if has_fio and fio is not None:
            line += f"{fio:>12.3f}{(ours / fio if fio else float('nan')):>8.3f}"
        print(line)
    if not r.get("verified", True):
        print("  WARNING: read-back data did not match")
