"""`ebbtide doctor`: what this machine gives ebbtide, checked the way ebbtide
uses it, in one report to run before anything else and to paste into a bug
report (like DeepSpeed's ds_report and torch.utils.collect_env).

Reports the build (io_uring, zstd, CUDA shim, the hooks module and the torch
it was built for), the running torch and CUDA, whether an io_uring ring can
be set up here, RLIMIT_MEMLOCK and what it lets the process page-lock, and
for a directory (--dir, default the temporary directory): its filesystem,
O_DIRECT, free space and a short measured write/read bandwidth; on a GPU the
pinned host <-> device copy bandwidth; then the recommended `target` and why.
Every check that does not pass says what to do. Exit 1 when a check fails
(status "fail"), else 0; warnings do not fail.
"""
import json
import mmap
import os
import platform
import resource
import shutil
import sys
import tempfile
import time

from ebbtide import _core

# Filesystems that keep their files in memory: offloading there moves
# activations from one place in RAM to another.
_MEMORY_FS = ("tmpfs", "ramfs")
# Filesystems whose O_DIRECT and speed are those of a local block device.
_LOCAL_FS = ("ext4", "xfs", "btrfs", "f2fs", "ext3", "ext2", "bcachefs", "zfs")
_LOW_FREE_BYTES = 16 << 30
_SLOW_WRITE_GBPS = 0.5  # GB/s: slower than a GPU's forward produces activations
_IO_STAGING_BYTES = 64 << 20  # the engine's staging, registered with io_uring (EngineOptions)
_CAP_IPC_LOCK = 14
_MEMLOCK_ADVICE = ("raise the memlock limit: `ulimit -l unlimited` (limits.conf: `* - memlock unlimited`), "
                   "LimitMEMLOCK=infinity in the systemd unit, or `docker run --ulimit memlock=-1`")
_LOCAL_NVME_ADVICE = "point path at a directory on an ext4 or xfs filesystem on a local NVMe SSD"


def register(subparsers):
    p = subparsers.add_parser(
        "doctor", help="check this machine for ebbtide (build, torch, io_uring, memlock, a "
                       "directory's filesystem and speed) and recommend a target")
    p.add_argument("--dir", default=None,
                   help="directory ebbtide would write to (default: the temporary directory, "
                        f"{tempfile.gettempdir()})")
    p.add_argument("--size", default="256MiB",
                   help="bytes written and read back to measure the directory (default 256MiB; 0 skips)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _check(name, status, summary, advice=None, **data):
    """One line of the report: status "ok", "warn", "fail" or "skip"."""
    out = dict(name=name, status=status, summary=summary, advice=advice)
    out.update(data)
    return out


def _fmt(n):
    return _core.format_bytes(float(n))


# ------------------------------------------------------------------ build
def _build_checks(cuda_visible):
    info = dict(_core.build_info)
    missing, advice = [], []
    if not info.get("liburing"):
        missing.append("liburing (the storage engine runs on its POSIX thread pool)")
        advice.append("install liburing-dev (Debian/Ubuntu) or liburing-devel (RHEL/Fedora)")
    if not info.get("zstd"):
        missing.append("zstd (checkpoints cannot be compressed)")
        advice.append("install libzstd-dev (Debian/Ubuntu) or libzstd-devel (RHEL/Fedora)")
    if not info.get("cuda_shim") and cuda_visible:
        missing.append("the CUDA shim (no offloading from GPUs)")
        advice.append("install the CUDA toolkit's headers (cuda.h)")
    built = ", ".join(k for k, v in info.items() if v) or "nothing optional"
    if missing:
        return info, _check("build", "warn", f"built without {'; '.join(missing)}",
                            f"{' and '.join(advice)}, then rebuild: pip install --no-build-isolation "
                            "--force-reinstall <ebbtide source>")
    return info, _check("build", "ok", f"built with {built}")


def _hooks_check(torch_version):
    try:
        from ebbtide import _torch
    except ImportError as e:
        text = " ".join(str(e).split())
        return dict(loaded=False, error=text), _check(
            "hooks", "fail", f"ebbtide._torch (the saved-tensor hooks TensorCache needs) does not load: {text}",
            "rebuild ebbtide against the installed torch: pip install --no-build-isolation --force-reinstall "
            "<ebbtide source>")
    built_for = getattr(_torch, "TORCH_VERSION", None)
    hooks = dict(loaded=True, built_for_torch=built_for)
    # The builds of one release share libtorch's interface (Note [Hooks for one torch]).
    if built_for is not None and torch_version is not None and \
            built_for.split("+")[0] != torch_version.split("+")[0]:
        return hooks, _check("hooks", "fail", f"ebbtide._torch was built for torch {built_for}, "
                                              f"torch {torch_version} runs",
                             "rebuild ebbtide against the installed torch: pip install --no-build-isolation "
                             "--force-reinstall <ebbtide source>")
    return hooks, _check("hooks", "ok", f"ebbtide._torch loads, built for torch {built_for}")


def _torch_info():
    try:
        import torch
    except ImportError as e:
        return dict(version=None, error=str(e)), _check(
            "torch", "fail", f"torch does not import: {e}", "install torch (pip install torch)")
    info = dict(version=torch.__version__, cuda_build=torch.version.cuda,
                cuda_available=torch.cuda.is_available(), devices=[])
    if info["cuda_available"]:
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info["ebbtide_cuda_driver"] = bool(_core.cuda_available())
    if not info["ebbtide_cuda_driver"]:
        info["ebbtide_cuda_reason"] = _core.cuda_unavailable_reason()
    where = (f"{len(info['devices'])} GPU(s): {', '.join(info['devices'])}" if info["devices"]
             else "no GPU")
    summary = f"torch {info['version']} (CUDA build {info['cuda_build'] or 'none'}), {where}"
    if info["cuda_available"] and not info["ebbtide_cuda_driver"]:
        return info, _check("torch", "fail", f"{summary}; ebbtide's CUDA shim cannot use the driver: "
                                             f"{info['ebbtide_cuda_reason']}",
                            "make libcuda.so.1 loadable (the NVIDIA driver; in a container, the NVIDIA "
                            "container toolkit) and leave EBBTIDE_CUDA unset")
    return info, _check("torch", "ok", summary)


# ------------------------------------------------------------------ io_uring
def _io_uring_check(built, probe_dir):
    kernel = platform.release()
    disabled = _read_int("/proc/sys/kernel/io_uring_disabled")
    data = dict(kernel=kernel, io_uring_disabled_sysctl=disabled)
    if not built:
        return _check("io_uring", "warn", "not built with liburing: I/O runs on the POSIX thread pool",
                      "install liburing-dev (Debian/Ubuntu) or liburing-devel (RHEL/Fedora) and rebuild ebbtide",
                      works=False, **data)
    try:
        with tempfile.TemporaryDirectory(prefix="ebbtide-doctor-", dir=probe_dir) as d:
            from ebbtide import io
            with io.Engine([d], backend="uring", capacity_bytes=4 << 20) as eng:
                describe = eng.describe()
                slot = eng.allocate(1 << 20)
                data_out = bytearray(os.urandom(1 << 20))
                eng.write(slot, data_out).wait()
                back = bytearray(1 << 20)
                eng.read(slot, back).wait()
                if back != data_out:
                    raise RuntimeError("1 MiB read back through io_uring differs from what was written")
    except Exception as e:  # noqa: BLE001 - any failure of the probe is the finding
        text = " ".join(str(e).split())
        blocked = any(w in text for w in ("EPERM", "errno 1)", "not permitted", "disabled", "seccomp"))
        why = ("io_uring is blocked here (a container's seccomp profile, Docker's default among them, or "
               "sysctl kernel.io_uring_disabled)") if blocked else "io_uring does not work here"
        return _check("io_uring", "fail", f"{why}: {text}",
                      "allow io_uring_setup, io_uring_enter and io_uring_register in the container's seccomp "
                      "profile (docker run --security-opt seccomp=<profile>) and set sysctl "
                      "kernel.io_uring_disabled=0; until then ebbtide falls back to its POSIX thread pool "
                      "(EBBTIDE_IO_BACKEND=posix says so explicitly)", works=False, **data)
    data["fixed_buffers"] = "fixed buffers" in describe
    if not data["fixed_buffers"]:
        return _check("io_uring", "warn", f"a ring works (kernel {kernel}), but its staging buffers could not "
                                          "be registered (RLIMIT_MEMLOCK): every transfer maps its pages anew",
                      _MEMLOCK_ADVICE, works=True, **data)
    return _check("io_uring", "ok", f"a ring works (kernel {kernel}), staging buffers registered", works=True,
                  **data)


def _read_int(path):
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _proc_status(key):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


# ------------------------------------------------------------------ memlock
def _memlock_check(gpu):
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    locked_kb = _proc_status("VmLck")
    locked = int(locked_kb.split()[0]) * 1024 if locked_kb else 0
    cap_eff = _proc_status("CapEff")
    exempt = bool(cap_eff) and bool(int(cap_eff, 16) >> _CAP_IPC_LOCK & 1)
    unlimited = soft == resource.RLIM_INFINITY
    allows = None if unlimited or exempt else max(0, soft - locked)
    data = dict(soft_bytes=None if unlimited else soft,
                hard_bytes=None if hard == resource.RLIM_INFINITY else hard,
                locked_bytes=locked, cap_ipc_lock=exempt, allows_bytes=allows)
    limit = "unlimited" if unlimited else _fmt(soft)
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else _fmt(hard)
    # Page-locked memory ebbtide asks for: io_uring's registered staging on
    # every machine; on a GPU also the pinned bounce buffers and host tier.
    need = _IO_STAGING_BYTES + ((1 << 30) if gpu else 0)
    uses = ("io_uring's registered staging buffers, 64 MiB a directory" +
            ("; pinned bounce buffers, EBBTIDE_STAGING_BYTES of 1 GiB; the pinned host tier" if gpu else ""))
    summary = f"RLIMIT_MEMLOCK {limit} (hard {hard_text})"
    if unlimited or soft >= need:
        return _check("memlock", "ok", f"{summary}: enough for {uses}", **data)
    if exempt:
        return _check("memlock", "warn", f"{summary}, below the {_fmt(need)} ebbtide page-locks ({uses}); this "
                                         "process is exempt (CAP_IPC_LOCK, e.g. root), one without that "
                                         "capability is not", _MEMLOCK_ADVICE, **data)
    effect = ("pinned copies fall back to unpinned ones that do not overlap compute" if gpu
              else "io_uring runs without registered buffers")
    return _check("memlock", "fail" if gpu else "warn",
                  f"{summary}: {_fmt(allows)} may be page-locked, below the {_fmt(need)} ebbtide page-locks "
                  f"({uses}): {effect}", _MEMLOCK_ADVICE, **data)


# ------------------------------------------------------------------ the directory
def _mount_of(path):
    """(mount point, filesystem type, source) of the mount holding `path`, from /proc/mounts."""
    real = os.path.realpath(path)
    best = ("/", None, None)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                source, mnt, fstype = (p.replace("\\040", " ") for p in parts[:3])
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[0]):
                    best = (mnt, fstype, source)
    except OSError:
        pass
    return best


def _rotational(source):
    """True / False for a block device source (/dev/sda1, /dev/nvme0n1p2), else
    None. Only a hint: virtual disks (virtio) often report rotational whatever
    backs them, so the measured bandwidth judges the speed."""
    if not source or not source.startswith("/dev/"):
        return None
    name = os.path.basename(os.path.realpath(source))
    for q in (f"/sys/class/block/{name}/queue/rotational", f"/sys/class/block/{name}/../queue/rotational"):
        v = _read_int(q)
        if v is not None:
            return bool(v)
    return None


def _probe_o_direct(directory):
    """Opens a new file in `directory` with O_DIRECT and writes one aligned
    4 KiB block. Returns None when that works, else the error (OSError)."""
    fd = None
    path = None
    buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
    try:
        buf.write(b"\xeb" * 4096)
        fd_tmp, path = tempfile.mkstemp(prefix="ebbtide-doctor-", dir=directory)
        os.close(fd_tmp)
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        if os.write(fd, buf) != 4096:
            return OSError(0, "short O_DIRECT write")
        return None
    except OSError as e:
        return e
    finally:
        if fd is not None:
            os.close(fd)
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass
        buf.close()


def _dir_checks(directory, size):
    checks = []
    info = dict(path=os.path.abspath(directory))
    if os.path.exists(directory) and not os.path.isdir(directory):
        checks.append(_check("directory", "fail", f"{directory} is a file, not a directory",
                             f"name the directory ebbtide should write in (--dir), e.g. "
                             f"{os.path.dirname(os.path.abspath(directory))}, or {_LOCAL_NVME_ADVICE}"))
        return info, checks
    if not os.path.isdir(directory):
        checks.append(_check("directory", "fail", f"{directory} is not a directory",
                             f"create it (mkdir -p {directory}) or {_LOCAL_NVME_ADVICE}"))
        return info, checks
    if not os.access(directory, os.W_OK | os.X_OK):
        checks.append(_check("directory", "fail", f"{directory} is not writable by this user",
                             f"make it writable (chown or chmod) or {_LOCAL_NVME_ADVICE}"))
        return info, checks

    mnt, fstype, source = _mount_of(directory)
    rot = _rotational(source)
    info.update(mount=mnt, filesystem=fstype, source=source, rotational=rot)
    where = f"{info['path']} is on {fstype or 'an unknown filesystem'} (mounted at {mnt}" + \
        (f" from {source}" if source and source.startswith("/") else "") + \
        (", reported rotational" if rot else "") + ")"
    if fstype in _MEMORY_FS:
        checks.append(_check("filesystem", "fail", f"{where}: its files live in host memory, so offloading "
                                                   "there saves none",
                             f"{_LOCAL_NVME_ADVICE}; to offload to host memory use target='cpu' (no files)"))
    elif fstype == "overlay":
        checks.append(_check("filesystem", "warn", f"{where}: a container's writable layer",
                             "mount a host NVMe directory into the container (docker run -v /nvme/ebbtide:/ebbtide) "
                             "and point path there"))
    elif fstype not in _LOCAL_FS:
        checks.append(_check("filesystem", "warn", f"{where}: not a local block-device filesystem ebbtide "
                                                   "knows (network and FUSE filesystems are slow for this)",
                             _LOCAL_NVME_ADVICE))
    else:
        checks.append(_check("filesystem", "ok", where))

    err = _probe_o_direct(directory)
    info["o_direct"] = err is None
    if err is None:
        checks.append(_check("o_direct", "ok", f"O_DIRECT works on {fstype}"))
    else:
        text = os.strerror(err.errno) if err.errno else str(err)
        checks.append(_check("o_direct", "fail",
                             f"O_DIRECT unsupported on {fstype or info['path']} ({text}): ebbtide falls back "
                             "to buffered I/O through the page cache (an extra copy, memory pressure)",
                             f"O_DIRECT unsupported on {fstype}: {_LOCAL_NVME_ADVICE}"))

    usage = shutil.disk_usage(directory)
    info.update(free_bytes=usage.free, total_bytes=usage.total)
    free = f"{_fmt(usage.free)} free of {_fmt(usage.total)}"
    if usage.free < _LOW_FREE_BYTES:
        checks.append(_check("free_space", "warn", f"{free}: a step's offloaded activations (up to all it "
                                                   "saves) need room there",
                             f"free space there or {_LOCAL_NVME_ADVICE} with more room"))
    else:
        checks.append(_check("free_space", "ok", free))

    if size <= 0:
        checks.append(_check("bandwidth", "skip", "not measured (--size 0)"))
        return info, checks
    if size + (64 << 20) > usage.free:
        checks.append(_check("bandwidth", "skip", f"not measured: {_fmt(size)} does not fit in {free}",
                             "measure with a smaller --size or free space"))
        return info, checks
    try:
        with tempfile.TemporaryDirectory(prefix="ebbtide-doctor-", dir=directory) as d:
            from ebbtide import io
            r = io.bench_io([d], size, device=False)
    except (OSError, RuntimeError, ValueError) as e:
        checks.append(_check("bandwidth", "fail", f"writing {_fmt(size)} failed: {' '.join(str(e).split())}",
                             _LOCAL_NVME_ADVICE))
        return info, checks
    info.update(write_gbps=r["write_gbps"], read_gbps=r["read_gbps"], backend=r["backend"],
                engine_direct=r["direct"], measured_bytes=size)
    summary = (f"write {r['write_gbps']:.2f} GB/s, read {r['read_gbps']:.2f} GB/s ({_fmt(size)} through the "
               f"engine: {r['backend']}, {'O_DIRECT' if r['direct'] else 'buffered'})")
    if fstype in _MEMORY_FS:
        checks.append(_check("bandwidth", "skip", summary + ": memory speed, not a disk's"))
    elif r["write_gbps"] < _SLOW_WRITE_GBPS:
        checks.append(_check("bandwidth", "warn", summary + f": below {_SLOW_WRITE_GBPS} GB/s, too slow "
                                                            "to hide much offloading",
                             f"{_LOCAL_NVME_ADVICE}, or several (path=[dir1, dir2] stripes)"))
    else:
        checks.append(_check("bandwidth", "ok", summary))
    return info, checks


# ------------------------------------------------------------------ GPU copies
def _gpu_copy_check(torch_info, nbytes=256 << 20, repeats=5):
    if not torch_info.get("cuda_available"):
        reason = torch_info.get("ebbtide_cuda_reason") or "torch.cuda.is_available() is False"
        return _check("gpu_copies", "skip", f"no CUDA device ({reason})")
    import torch

    try:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        rates = {}
        for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
            dst.copy_(src, non_blocking=True)  # warm up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            rates[name] = nbytes * repeats / (start.elapsed_time(end) / 1e3) / 1e9
        del host, dev
    except RuntimeError as e:
        return _check("gpu_copies", "fail", f"pinned copies failed: {' '.join(str(e).split())}",
                      f"check the GPU and its driver (nvidia-smi); {_MEMLOCK_ADVICE}")
    summary = (f"pinned host -> {torch.cuda.get_device_name()} {rates['h2d']:.1f} GB/s, back "
               f"{rates['d2h']:.1f} GB/s")
    if min(rates.values()) < 5.0:
        return _check("gpu_copies", "warn", summary + ": below a PCIe 3 x16 link",
                      "check the GPU's PCIe link (nvidia-smi -q | grep -A3 'Link Width') and that the process "
                      "runs on the GPU's NUMA node (numactl --cpunodebind)", h2d_gbps=rates["h2d"],
                      d2h_gbps=rates["d2h"])
    return _check("gpu_copies", "ok", summary, h2d_gbps=rates["h2d"], d2h_gbps=rates["d2h"])


# ------------------------------------------------------------------ the verdict
def _recommend(gpu, checks_by_name, dir_info):
    disk_ok = (all(checks_by_name.get(n, {}).get("status") in ("ok", "warn", "skip", None)
                   for n in ("directory", "filesystem", "bandwidth"))
               and dir_info.get("filesystem") not in _MEMORY_FS and "mount" in dir_info)
    speed = (f" ({dir_info['write_gbps']:.2f} GB/s write measured)" if "write_gbps" in dir_info else "")
    if gpu:
        if disk_ok:
            return dict(target="auto", reason="a GPU with a usable disk: auto offloads to pinned host memory "
                                              "first (EBBTIDE_HOST_BUDGET, a quarter of free memory) and spills "
                                              f"to files under {dir_info['path']}{speed}, per block as much as "
                                              "the links hide")
        return dict(target="cpu", reason=f"a GPU, but {dir_info['path']} is no disk to offload to: host memory "
                                         "is the tier that works here")
    if disk_ok:
        return dict(target="auto", reason="CPU training: activations live in host memory already, so only SSD "
                                          "files can lower it; auto (on the CPU: SSD files, planned) offloads "
                                          f"under {dir_info['path']}{speed} what the disk can hide "
                                          "(target='ssd' offloads every block)")
    return dict(target=None, reason=f"CPU training and {dir_info['path']} is no disk to offload to: activations "
                                    "live in host memory already (target='cpu' cannot lower it), so no target "
                                    f"saves memory here; {_LOCAL_NVME_ADVICE}")


def collect(directory=None, size=256 << 20):
    """The doctor's report as a dict (what `ebbtide doctor --json` prints)."""
    directory = directory or tempfile.gettempdir()
    torch_info, torch_check = _torch_info()
    gpu = bool(torch_info.get("cuda_available"))
    build, build_check = _build_checks(gpu)
    hooks, hooks_check = _hooks_check(torch_info.get("version"))
    probe_dir = directory if os.path.isdir(directory) and os.access(directory, os.W_OK) else None
    checks = [build_check, hooks_check, torch_check, _io_uring_check(build.get("liburing"), probe_dir),
              _memlock_check(gpu)]
    dir_info, dir_checks = _dir_checks(directory, size)
    checks += dir_checks
    checks.append(_gpu_copy_check(torch_info))
    by_name = {c["name"]: c for c in checks}
    from ebbtide import __version__ as version
    return dict(ebbtide=dict(version=version, build=build, hooks=hooks),
                system=dict(kernel=platform.release(), machine=platform.machine(),
                            python=platform.python_version(), cpus=os.cpu_count()),
                torch=torch_info, dir=dir_info, checks=checks,
                recommended_target=_recommend(gpu, by_name, dir_info),
                ok=not any(c["status"] == "fail" for c in checks))


def run(args):
    size = _core.parse_bytes(args.size, "--size")
    if size < 0:
        raise ValueError("--size must not be negative")
    report = collect(args.dir, size)
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        print()
    else:
        print_report(report)
    return 0 if report["ok"] else 1


def print_report(r):
    e, t, s = r["ebbtide"], r["torch"], r["system"]
    built = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in e["build"].items())
    print(f"ebbtide {e['version']} ({built}); python {s['python']}, kernel {s['kernel']}, {s['cpus']} CPUs")
    for c in r["checks"]:
        print(f"  [{c['status']:<4}] {c['name']:<11} {c['summary']}")
        if c["advice"] and c["status"] != "ok":
            print(f"  {'':<18}-> {c['advice']}")
    rec = r["recommended_target"]
    target = f"target={rec['target']!r}" if rec["target"] else "no target"
    print(f"recommended: {target}: {rec['reason']}")
