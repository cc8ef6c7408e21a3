"""`ebbtide bench io`: storage engine throughput, optionally against fio.

Writes --size bytes through the engine and reads them back (data verified),
then, with --vs-fio, runs fio with the equivalent settings (O_DIRECT, same
block size, same queue depth per block device, same directories and size,
buffers on the same kind of pages) in the same run and prints our/fio ratios.
Both sides flush the written data (untimed) before reading it back.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from ebbtide import _core
from ebbtide._progress import progress, wanted


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
    io.add_argument("--small-pages", action="store_true",
                    help="buffers on 4 KiB pages instead of transparent huge pages (for both ebbtide and fio)")
    io.add_argument("--vs-fio", action="store_true", help="also run fio with equivalent settings")
    io.add_argument("--repeat", type=int, default=1,
                    help="runs of each (ebbtide and fio alternating); medians are reported")
    io.add_argument("--json", action="store_true", help="print JSON instead of a table")
    io.set_defaults(func=run_io)


# fio's buffers come from glibc's malloc; this tunable makes malloc advise
# MADV_HUGEPAGE on them, the same memory as the engine's bench buffers
# (Note [Bench buffers] in cpp/src/io/bench.cpp).
_FIO_HUGE_PAGES_ENV = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def _fio_job_args(dirs, size, chunk, qd, rw, backend, huge_pages=True, devices=None):
    """fio arguments for one pass (rw "write" or "read") matching the engine's.

    Args:
        dirs: target directories, one fio job each.
        size: total bytes, split evenly over the directories.
        chunk: block size.
        qd: queue depth per block device, as the engine's; directories on one
            device share it.
        rw: "write" or "read".
        backend: the engine backend ("auto", "uring" or "posix").
        huge_pages: align the buffers to 2 MiB so that huge pages back them.
        devices: st_dev of each directory (default: os.stat of each).

    Returns:
        The argument list, without the fio executable.
    """
    engine = "io_uring" if backend in ("auto", "uring") else "psync"
    per_dir = size // len(dirs)
    if devices is None:
        devices = [os.stat(d).st_dev for d in dirs]
    args = ["--output-format=json", "--group_reporting"]
    for i, d in enumerate(dirs):
        depth = max(1, qd // devices.count(devices[i]))
        args += [f"--name=ebbtide-fio-{i}", f"--directory={d}", f"--rw={rw}", f"--bs={chunk}",
                 f"--iodepth={depth}", f"--ioengine={engine}", "--direct=1", f"--size={per_dir}",
                 "--numjobs=1", "--end_fsync=0" if rw == "write" else "--invalidate=1"]
        if engine == "io_uring":
            args += ["--fixedbufs=1", "--registerfiles=1"]
        if huge_pages:
            args += ["--iomem=malloc", "--iomem_align=2M"]
    return args


def _fio_files(dirs):
    for i, d in enumerate(dirs):
        for name in os.listdir(d):
            if name.startswith(f"ebbtide-fio-{i}."):
                yield os.path.join(d, name)


def _flush(paths):
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def run_fio(dirs, size, chunk, qd, backend, huge_pages=True):
    """Sequential write, an untimed fsync, a read and an untimed second read
    with fio; returns (write_gbps, read_gbps)."""
    fio = shutil.which("fio")
    if fio is None:
        raise RuntimeError("--vs-fio: fio is not installed (apt-get install fio)")
    env = dict(os.environ, **_FIO_HUGE_PAGES_ENV) if huge_pages else None
    out = {}
    try:
        # "verify" is an untimed second read standing for the engine's
        # verifying read, so that each side's write follows as much of the
        # other side's I/O (a host's write-back of the last write can take
        # seconds and slows whatever comes next).
        for name, rw in (("write", "write"), ("read", "read"), ("verify", "read")):
            if name == "read":
                _flush(_fio_files(dirs))
            proc = subprocess.run([fio] + _fio_job_args(dirs, size, chunk, qd, rw, backend, huge_pages),
                                  capture_output=True, text=True, check=False, env=env)
            if proc.returncode != 0:
                raise RuntimeError(f"fio {name} failed: {proc.stderr.strip() or proc.stdout[-500:]}")
            text = proc.stdout[proc.stdout.find("{"):]
            side = json.loads(text)["jobs"][0][rw]
            out[name] = side["io_bytes"] / (side["runtime"] / 1e3) / 1e9 if side["runtime"] else 0.0
    finally:
        for path in list(_fio_files(dirs)):
            os.unlink(path)
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
    bar = progress(total=args.repeat * (2 if args.vs_fio else 1), desc="ebbtide bench io",
                   shown=wanted(args.json), tick_s=0.5)
    try:
        runs, fio_runs = [], []
        what = f"write + read {_core.format_bytes(size)}"
        # Alternate ours and fio so slow drifts of a shared disk hit both alike.
        for i in range(args.repeat):
            run_no = f" (run {i + 1}/{args.repeat})" if args.repeat > 1 else ""
            bar.describe(f"ebbtide {what}{run_no}")
            runs.append(dict(_core.bench_io(dirs=dirs, size=size, chunk=chunk, qd=args.qd,
                                            backend=args.backend, request=request,
                                            checksum=args.checksum,
                                            device=not args.no_device,
                                            huge_pages=not args.small_pages)))
            bar.update()
            if args.vs_fio:
                bar.describe(f"fio {what}{run_no}")
                fio_runs.append(run_fio(dirs, size, chunk, args.qd, args.backend,
                                        huge_pages=not args.small_pages))
                bar.update()
        result = dict(runs[-1])
        for key in ("write_gbps", "read_gbps", "device_write_gbps", "device_read_gbps"):
            result[key] = statistics.median(r[key] for r in runs)
        result["verified"] = all(r["verified"] for r in runs)
        result["huge_pages"] = all(r["huge_pages"] for r in runs)
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
        bar.close()
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
          f"chunk={_core.format_bytes(r['chunk'])} qd={r['qd']} O_DIRECT={r['direct']} "
          f"huge_pages={r['huge_pages']}"
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
