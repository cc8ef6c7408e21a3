"""A small run of `ebbtide bench io` is itself a test (numbers are not checked:
these machines are shared; targets live in docs/benchmarks.md)."""
import json
import shutil

import pytest


def test_bench_io_json(cli, tmp_path):
    proc = cli("bench", "io", "--dir", str(tmp_path), "--size", "16MiB", "--chunk", "256KiB",
               "--qd", "4", "--request", "4MiB", "--json")
    r = json.loads(proc.stdout)
    for key in ("write_gbps", "read_gbps", "backend", "direct", "verified", "huge_pages"):
        assert key in r
    assert r["write_gbps"] > 0 and r["read_gbps"] > 0
    assert r["verified"] is True
    assert list(tmp_path.iterdir()) == []  # slab files are unlinked


def test_bench_io_striped_table(cli, tmp_path):
    dirs = []
    for i in range(3):
        d = tmp_path / f"d{i}"
        d.mkdir()
        dirs += ["--dir", str(d)]
    proc = cli("bench", "io", *dirs, "--size", "12MiB", "--chunk", "1MiB", "--request", "3MiB",
               "--backend", "posix")
    assert "host write" in proc.stdout and "host read" in proc.stdout


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed")
def test_bench_io_vs_fio(cli, tmp_path):
    proc = cli("bench", "io", "--dir", str(tmp_path), "--size", "16MiB", "--qd", "4",
               "--vs-fio", "--json")
    r = json.loads(proc.stdout)
    assert r["fio_write_gbps"] > 0 and r["fio_read_gbps"] > 0
    assert r["write_vs_fio"] > 0
    assert list(tmp_path.iterdir()) == []  # fio's files are removed too


def test_bench_io_bad_input(cli, tmp_path):
    proc = cli("bench", "io", "--dir", str(tmp_path / "missing"), "--size", "1MiB", check=False)
    assert proc.returncode != 0
    assert "missing" in proc.stderr
    proc = cli("bench", "io", "--dir", str(tmp_path), "--size", "lots", check=False)
    assert proc.returncode != 0 and "--size" in proc.stderr


def _opts(args):
    """fio arguments of each job, as {name: {option: value}}."""
    jobs, job = {}, None
    for a in args:
        key, _, value = a.lstrip("-").partition("=")
        if key == "name":
            job = jobs.setdefault(value, {})
        elif job is not None:
            job[key] = value
    return jobs


def test_fio_job_matches_the_engine():
    """fio is given what the engine does: O_DIRECT, the chunk as block size,
    no fsync inside the timed write (both sides flush untimed before reading),
    2 MiB aligned malloc buffers with huge pages, none with --small-pages."""
    from ebbtide.commands.bench import _FIO_HUGE_PAGES_ENV, _fio_job_args

    for rw in ("write", "read"):
        job = _opts(_fio_job_args(["/a"], 1 << 30, 1 << 20, 16, rw, "auto", devices=[1]))["ebbtide-fio-0"]
        assert job["rw"] == rw and job["direct"] == "1" and job["bs"] == str(1 << 20)
        assert job["iodepth"] == "16" and job["ioengine"] == "io_uring" and job["size"] == str(1 << 30)
        assert job["iomem"] == "malloc" and job["iomem_align"] == "2M"
        assert job.get("end_fsync", "0") == "0"
    assert _FIO_HUGE_PAGES_ENV == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    small = _opts(_fio_job_args(["/a"], 1 << 30, 1 << 20, 16, "read", "posix", huge_pages=False, devices=[1]))
    assert "iomem_align" not in small["ebbtide-fio-0"] and small["ebbtide-fio-0"]["ioengine"] == "psync"


def test_fio_queue_depth_is_per_device():
    """The engine keeps qd requests in flight per block device, so directories
    on one device share it in fio too; a directory alone on its device has all of it."""
    from ebbtide.commands.bench import _fio_job_args

    jobs = _opts(_fio_job_args(["/a", "/b", "/c"], 3 << 30, 1 << 20, 16, "read", "auto", devices=[7, 7, 9]))
    assert [jobs[f"ebbtide-fio-{i}"]["iodepth"] for i in range(3)] == ["8", "8", "16"]
    assert all(j["size"] == str(1 << 30) for j in jobs.values())
