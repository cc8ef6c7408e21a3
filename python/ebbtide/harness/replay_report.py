"""`ebbtide plan --replay TRACE_OR_BENCH_JSON [--json]` (ebbtide/commands/plan.py): a recorded GPU run
through the planner's step model (docs/model.md, "Replays"): for the plan
that ran, the predicted and measured step time and allocator peak; for the
plan the planner chooses now, the predicted ones; and issue 40's targets on
it. A folder replays every run file in it."""
import json
import os
import sys


def _files(path):
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith(".json"))
        return [os.path.join(path, n) for n in names]
    return [path]


def replay_path(path):
    """{"sources": [...], "skipped": [(file, why)], "within", "targets_met"} for a file or a folder."""
    from ebbtide.harness import gpu_runs
    from ebbtide.plan import replay

    sources, skipped = [], []
    files = _files(path)
    if not files:
        raise ValueError(f"--replay {path}: no JSON files there")
    for f in files:
        try:
            loaded = gpu_runs.load(f)
        except ValueError as e:
            if len(files) == 1:
                raise
            skipped.append(dict(file=f, why=str(e)))
            continue
        result = replay.replay(loaded["runs"], f)
        result.update(format=loaded["format"], assumptions=loaded["assumptions"])
        sources.append(result)
    return dict(path=path, sources=sources, skipped=skipped, within=all(s["within"] for s in sources),
                targets_met=all(t["met"] for s in sources for t in s["targets"]))


def _gb(n):
    return f"{n / 1e9:.2f}"


def format_replay(result):
    lines = []
    for src in result["sources"]:
        what = "a step trace" if src["format"] == "trace" else f"{src['format']} JSON, rebuilt"
        lines.append(f"replay of {src['source']} ({what})")
        lines.append(f"  {'run':<30} {'plan':<5} {'step s pred/meas':>22} {'peak GB pred/meas':>22}")
        for r in src["runs"]:
            p, m, ratio = r["ran"]["predicted"], r["ran"]["measured"], r["ran"]["ratio"]
            verdict = "within 5%" if r["ran"]["within"] else (
                "kept apart: not within 5%" if r["apart"] else "NOT within 5%")
            lines.append(f"  {r['name']:<30} {'ran':<5} {p['step_seconds']:>8.4f}/{m['step_seconds']:.4f} "
                         f"{ratio['step_seconds']:>5.3f} {_gb(p['peak_bytes']):>8}/{_gb(m['peak_bytes'])} "
                         f"{ratio['peak_bytes']:>5.3f}  {verdict}")
            if r.get("apart_why"):
                lines.append(f"  {'':<30} apart: {r['apart_why']}")
            if "best" in r:
                b = r["best"]["predicted"]
                lines.append(f"  {'':<30} {'best':<5} {b['step_seconds']:>8.4f} {'':>13} {_gb(b['peak_bytes']):>8}"
                             f"{'':>13}  moves {_gb(b['bytes_offloaded'])} GB, recomputes "
                             f"{b['modules_recomputed']}")
        for t in src["targets"]:
            lines.append(f"  target {t['name']:<84} {t['value']:.3f} {t['op']} {t['limit']:.3f} "
                         f"{'PASS' if t['met'] else 'MISS'}")
        for u in src.get("unpredicted", []):
            lines.append(f"  not predicted: {u['name']}: {u['why']}")
        if src["assumptions"]:
            lines.append("  assumptions: " + "; ".join(src["assumptions"]))
    for s in result["skipped"]:
        lines.append(f"skipped {s['file']}: {s['why']}")
    lines.append(f"replayed within 5%: {'yes' if result['within'] else 'NO'}; targets on the best plans: "
                 f"{'all met' if result['targets_met'] else 'NOT all met'}")
    return "\n".join(lines)


def run(args):
    """The --replay branch of `ebbtide plan`; exit code 0 when every run is
    reproduced within 5% and every target is met, 3 otherwise."""
    result = replay_path(args.replay)
    if args.json:
        json.dump(result, sys.stdout, indent=2, default=str)
        print()
    else:
        print(format_replay(result))
    return 0 if result["within"] and result["targets_met"] else 3
