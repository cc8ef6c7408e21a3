#!/usr/bin/env python3
"""Unpacks a gpu_check.tgz that the device tool returned (scripts/gpu_check.sh
packs its logs, JSON and step traces into it) into
bench/gpu-runs/<date>-<machine>/, where python/tests/test_replay.py replays
every run kept and CI holds the step model to it.

    python scripts/unpack_gpu_check.py PATH/gpu_check.tgz [--name 2026-12-01-h200]

The date and machine come from the archive's env.txt (its first line, and
nvidia-smi's GPU name: "NVIDIA H200" -> h200; "cpu" where there was none);
a folder of that name that exists already gets -2, -3, ... Files over
--max-bytes (default 2 MB) stay out, named. A README.md lists the summary
and the environment; write what the run showed into it. Then:

    python -m ebbtide plan --replay bench/gpu-runs/<folder>

Exit code 0, or 2 with one line naming the problem (not a tar archive, no
env.txt).
"""
import argparse
import io
import os
import re
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = os.path.join(HERE, "..", "bench", "gpu-runs")


def folder_name(env_text):
    """<date>-<machine> from gpu_check.sh's env.txt."""
    lines = env_text.splitlines()
    m = re.match(r"(\d{4}-\d{2}-\d{2})", lines[0].strip()) if lines else None
    if not m:
        raise ValueError(f"env.txt's first line {lines[0] if lines else ''!r} is not gpu_check.sh's date")
    machine = "cpu"
    for line in lines[1:]:
        g = re.match(r"NVIDIA ([^,]+),", line.strip())
        if g:
            machine = g.group(1).split()[0].lower()
            break
    return f"{m.group(1)}-{machine}"


def unpack(tgz, runs_dir=RUNS, name=None, max_bytes=2 << 20):
    """Returns (the folder written, [(member, why) left out])."""
    try:
        tar = tarfile.open(tgz, "r:gz")
    except (OSError, tarfile.TarError) as e:
        raise ValueError(f"{tgz}: not a gzipped tar archive ({e})") from None
    with tar:
        members = {os.path.normpath(m.name): m for m in tar.getmembers()}
        env = members.get("env.txt")
        if env is None:
            raise ValueError(f"{tgz}: no env.txt (not an archive of scripts/gpu_check.sh)")
        env_text = tar.extractfile(env).read().decode(errors="replace")
        base = name or folder_name(env_text)
        dest, n = os.path.join(runs_dir, base), 1
        while os.path.exists(dest):
            n += 1
            dest = os.path.join(runs_dir, f"{base}-{n}")
        os.makedirs(dest)
        left_out = []
        for path, m in sorted(members.items()):
            if path in (".", "") or m.isdir():
                continue
            if not m.isfile() or "/" in path or path.startswith(".."):
                left_out.append((path, "not a plain file at the top"))
            elif m.size > max_bytes:
                left_out.append((path, f"{m.size} bytes > {max_bytes}"))
            else:
                with open(os.path.join(dest, path), "wb") as f:
                    f.write(tar.extractfile(m).read())
    summary = ""
    if os.path.exists(os.path.join(dest, "summary.txt")):
        with open(os.path.join(dest, "summary.txt")) as f:
            summary = f.read()
    out = io.StringIO()
    out.write(f"# GPU run {os.path.basename(dest)} (scripts/gpu_check.sh)\n\n")
    out.write("What it showed: (to write)\n\nSummary:\n\n```\n" + summary + "```\n\nEnvironment:\n\n```\n"
              + env_text + "```\n")
    if left_out:
        out.write("\nLeft out of this folder: " + "; ".join(f"{p} ({why})" for p, why in left_out) + "\n")
    with open(os.path.join(dest, "README.md"), "w") as f:
        f.write(out.getvalue())
    return dest, left_out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tgz", help="the gpu_check.tgz the device tool returned")
    ap.add_argument("--name", help="the folder's name (default: <date>-<machine> from its env.txt)")
    ap.add_argument("--runs-dir", default=RUNS, help="where the run folders live (default bench/gpu-runs)")
    ap.add_argument("--max-bytes", type=int, default=2 << 20, help="larger files stay out (default 2 MB)")
    args = ap.parse_args()
    try:
        dest, left_out = unpack(args.tgz, args.runs_dir, args.name, args.max_bytes)
    except ValueError as e:
        print(f"unpack_gpu_check.py: {e}", file=sys.stderr)
        return 2
    here = os.path.relpath(dest)
    dest = dest if here.startswith("..") else here
    print(f"unpacked into {dest}" + (f"; left out: {left_out}" if left_out else ""))
    print(f"replay: python -m ebbtide plan --replay {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
