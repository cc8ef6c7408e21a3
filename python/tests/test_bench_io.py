"""A small run of `ebbtide bench io` is itself a test (numbers are not checked:
these machines are shared; targets live in docs/benchmarks.md)."""
import json
import shutil

import pytest


def test_bench_io_json(cli, tmp_path):
    proc = cli("bench", "io", "--dir", str(tmp_path), "--size", "16MiB", "--chunk", "256KiB",
               "--qd", "4", "--request", "4MiB", "--json")
    r = json.loads(proc.stdout)
    for key in ("write_gbps", "read_gbps", "backend", "direct", "verified"):
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
