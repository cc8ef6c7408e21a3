"""`ebbtide doctor` (issue 30, part 4): the report, and what it says to do
for a directory on tmpfs, a directory refusing O_DIRECT and a low memlock
limit."""
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from ebbtide import _core
from ebbtide.commands import doctor

pytest.importorskip("torch")

CHECKS = ["build", "hooks", "torch", "io_uring", "memlock", "filesystem", "o_direct", "free_space",
          "bandwidth", "gpu_copies"]
NVME_ADVICE = "ext4 or xfs filesystem on a local NVMe SSD"


def doctor_json(*args, prefix=(), check_rc=True):
    p = subprocess.run([*prefix, sys.executable, "-m", "ebbtide", "doctor", "--json", *args],
                       capture_output=True, text=True, timeout=300)
    report = json.loads(p.stdout)
    if check_rc:  # exit 1 exactly when a check fails
        assert p.returncode == (0 if report["ok"] else 1), (p.returncode, p.stderr)
    return report


def by_name(report):
    return {c["name"]: c for c in report["checks"]}


def cuda():
    import torch
    return torch.cuda.is_available()


@pytest.fixture
def tmpfs_dir():
    if doctor._mount_of("/dev/shm")[1] != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    d = tempfile.mkdtemp(prefix="ebbtide-doctor-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_doctor_json_on_the_temp_dir():
    r = doctor_json("--size", "16MiB")
    assert r["ebbtide"]["build"] == dict(_core.build_info)
    assert r["ebbtide"]["hooks"]["loaded"]
    import torch
    assert r["ebbtide"]["hooks"]["built_for_torch"] == torch.__version__ == r["torch"]["version"]
    assert [c["name"] for c in r["checks"]] == CHECKS
    for c in r["checks"]:
        assert c["status"] in ("ok", "warn", "fail", "skip"), c
        if c["status"] in ("warn", "fail"):
            assert c["advice"], c  # every check that does not pass says what to do
    assert r["dir"]["path"] == os.path.abspath(tempfile.gettempdir())
    assert r["dir"]["filesystem"] and r["dir"]["free_bytes"] > 0
    if r["dir"]["filesystem"] not in ("tmpfs", "ramfs"):
        assert r["dir"]["write_gbps"] > 0 and r["dir"]["read_gbps"] > 0
        assert r["dir"]["measured_bytes"] == 16 << 20
    checks = by_name(r)
    if _core.build_info.get("liburing") and checks["io_uring"]["works"]:
        assert r["dir"]["backend"] == "uring"
    if not cuda():
        assert checks["gpu_copies"]["status"] == "skip" and "no CUDA device" in checks["gpu_copies"]["summary"]
    rec = r["recommended_target"]
    assert rec["target"] in ("auto", "ssd", "cpu", None) and rec["reason"]


def test_doctor_tmpfs_dir(tmpfs_dir):
    r = doctor_json("--dir", tmpfs_dir, "--size", "0")
    checks = by_name(r)
    assert r["dir"]["filesystem"] == "tmpfs"
    fs = checks["filesystem"]
    assert fs["status"] == "fail" and "host memory" in fs["summary"] and NVME_ADVICE in fs["advice"]
    # tmpfs takes O_DIRECT since Linux 6.6; where it does not, the check says what to do.
    od = checks["o_direct"]
    assert (od["status"] == "ok") == r["dir"]["o_direct"]
    if not r["dir"]["o_direct"]:
        assert od["status"] == "fail" and od["advice"].startswith("O_DIRECT unsupported on tmpfs: ")
    assert not r["ok"]
    assert r["recommended_target"]["target"] == ("cpu" if cuda() else None)


def test_doctor_text_names_the_fix(tmpfs_dir):
    p = subprocess.run([sys.executable, "-m", "ebbtide", "doctor", "--dir", tmpfs_dir, "--size", "0"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr
    lines = p.stdout.splitlines()
    i = next(i for i, line in enumerate(lines) if "[fail] filesystem" in line)
    assert lines[i + 1].strip().startswith("->") and NVME_ADVICE in lines[i + 1]
    assert lines[-1].startswith("recommended: ")


def test_doctor_o_direct_refused(monkeypatch, tmp_path):
    """A filesystem refusing O_DIRECT (EINVAL at open, as tmpfs before Linux 6.6)."""
    real_open = os.open

    def refuse_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_direct)
    r = doctor.collect(str(tmp_path), size=0)
    od = by_name(r)["o_direct"]
    fstype = r["dir"]["filesystem"]
    assert not r["dir"]["o_direct"] and od["status"] == "fail" and not r["ok"]
    assert "Invalid argument" in od["summary"]
    assert od["advice"] == f"O_DIRECT unsupported on {fstype}: point path at a directory on an {NVME_ADVICE}"
    assert os.listdir(tmp_path) == []  # the probe's file is gone


def test_doctor_build_and_hooks_advice(monkeypatch, tmp_path):
    import ebbtide

    monkeypatch.setattr(_core, "build_info", dict(_core.build_info, liburing=False, zstd=False))
    monkeypatch.delattr(ebbtide, "_torch", raising=False)
    monkeypatch.setitem(sys.modules, "ebbtide._torch", None)  # import fails
    checks = by_name(doctor.collect(str(tmp_path), size=0))
    build = checks["build"]
    assert build["status"] == "warn" and "liburing" in build["summary"] and "zstd" in build["summary"]
    for pkg in ("liburing-dev", "liburing-devel", "libzstd-dev", "libzstd-devel", "--no-build-isolation"):
        assert pkg in build["advice"]
    assert checks["io_uring"]["status"] == "warn" and not checks["io_uring"]["works"]
    hooks = checks["hooks"]
    assert hooks["status"] == "fail" and "--no-build-isolation" in hooks["advice"]


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="util-linux prlimit is not installed")
def test_doctor_low_memlock():
    prefix = ["prlimit", "--memlock=65536:65536"]
    r = doctor_json("--size", "0", prefix=prefix, check_rc=False)
    m = by_name(r)["memlock"]
    assert m["soft_bytes"] == 65536 and m["hard_bytes"] == 65536
    assert m["status"] in ("warn", "fail") and "64.0 KiB" in m["summary"]
    assert "ulimit -l unlimited" in m["advice"] and "LimitMEMLOCK=infinity" in m["advice"]
    if not m["cap_ipc_lock"]:
        assert m["allows_bytes"] <= 65536
        return
    # Root (CAP_IPC_LOCK) is exempt from the limit: the report says so. Without
    # the capability, the limit binds: io_uring cannot register its buffers.
    assert m["allows_bytes"] is None and "exempt" in m["summary"]
    if shutil.which("setpriv") is None:
        return
    r = doctor_json("--size", "0", prefix=[*prefix, "setpriv", "--bounding-set", "-ipc_lock"], check_rc=False)
    checks = by_name(r)
    m = checks["memlock"]
    assert not m["cap_ipc_lock"] and m["allows_bytes"] <= 65536 and "ulimit -l unlimited" in m["advice"]
    ring = checks["io_uring"]
    if ring["works"]:
        assert not ring["fixed_buffers"] and ring["status"] == "warn" and "ulimit -l" in ring["advice"]


def test_doctor_recommendation_and_gpu_memlock(monkeypatch):
    """The verdict's branches, and a GPU's memlock need (no GPU needed: the inputs are given)."""
    disk = dict(path="/nvme/ebb", mount="/nvme", filesystem="xfs", write_gbps=3.2)
    ram = dict(path="/dev/shm/x", mount="/dev/shm", filesystem="tmpfs")
    ok = {"filesystem": dict(status="ok"), "bandwidth": dict(status="ok")}
    failed = {"filesystem": dict(status="fail")}
    assert doctor._recommend(True, ok, disk)["target"] == "auto"
    assert doctor._recommend(True, failed, ram)["target"] == "cpu"
    rec = doctor._recommend(False, ok, disk)
    assert rec["target"] == "auto" and "3.20 GB/s" in rec["reason"]
    rec = doctor._recommend(False, failed, ram)
    assert rec["target"] is None and NVME_ADVICE in rec["reason"]

    import resource
    monkeypatch.setattr(resource, "getrlimit", lambda what: (64 << 20, 64 << 20))
    monkeypatch.setattr(doctor, "_proc_status", lambda key: {"VmLck": "0 kB", "CapEff": "0"}.get(key))
    assert doctor._memlock_check(gpu=False)["status"] == "ok"  # io_uring's 64 MiB fit
    m = doctor._memlock_check(gpu=True)  # pinned staging and host tier do not
    assert m["status"] == "fail" and m["allows_bytes"] == 64 << 20 and "LimitMEMLOCK" in m["advice"]
