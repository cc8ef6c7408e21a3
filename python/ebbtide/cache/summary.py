"""TensorCache.summary(): a TensorCache's stats() as a few readable lines."""
from collections import Counter


def _b(n):
    from ebbtide import _core

    return _core.format_bytes(float(n or 0))


def format_summary(s):
    """The text of TensorCache.summary() for the dict `s` of its stats()."""
    steps = s.get("steps", 0)
    lines = [f"ebbtide TensorCache: target {s.get('target')}, {steps} step{'s' if steps != 1 else ''}"
             + (", adaptive" if s.get("adaptive") else "")
             + (f", activation budget {_b(s['activation_budget_bytes'])}" if s.get("activation_budget_bytes") else "")
             + (f", memory budget {_b(s['memory_budget_bytes'])}" if s.get("memory_budget_bytes") else "")]
    lines.append(f"  last step: saved {_b(s.get('saved_bytes_total'))} in {s.get('tensors_saved', 0)} tensors: "
                 f"offloaded {_b(s.get('bytes_offloaded'))} ({s.get('tensors_offloaded', 0)}), "
                 f"kept {s.get('tensors_kept', 0)}, deduplicated {s.get('tensors_deduped', 0)}, "
                 f"forwarded {s.get('tensors_forwarded', 0)}")
    lines.append(f"  reloaded {_b(s.get('bytes_reloaded'))} ({s.get('tensors_reloaded', 0)} tensors), "
                 f"peak resident {_b(s.get('peak_resident_bytes'))}, backward waited {s.get('stall_seconds', 0):.3f} s"
                 + (f", device waited {s['device_wait_seconds']:.3f} s" if s.get("device_wait_seconds") else ""))
    if s.get("peak_allocated_bytes") is not None:
        lines.append(f"  allocator peak above the step's start {_b(s['peak_allocated_bytes'])}"
                     + (f" (predicted {_b(s['predicted_peak_allocated_bytes'])})"
                        if s.get("predicted_peak_allocated_bytes") else ""))
    for t in s.get("tiers") or []:
        lines.append(f"  tier {t['tier']}: wrote {_b(t.get('bytes_written'))} in {t.get('write_seconds', 0):.3f} s, "
                     f"read {_b(t.get('bytes_read'))} in {t.get('read_seconds', 0):.3f} s, "
                     f"holds {_b(t.get('bytes_held'))}")
    plan = s.get("plan") or []
    if plan:
        mix = Counter(p.get("decision") for p in plan)
        lines.append(f"  blocks: {len(plan)}: " + ", ".join(f"{n} {d}" for d, n in sorted(mix.items())))
    if s.get("recomputed_blocks"):
        lines.append(f"  recomputed: {', '.join(map(str, s['recomputed_blocks']))}")
    failures = {k: s.get(k, 0) for k in ("store_failures", "load_failures") if s.get(k)}
    if failures:
        lines.append("  failures: " + ", ".join(f"{k.split('_')[0]}s {v}" for k, v in failures.items()))
    total = s.get("total") or {}
    if total and steps > 1:
        lines.append(f"  all steps: offloaded {_b(total.get('bytes_offloaded'))}, "
                     f"reloaded {_b(total.get('bytes_reloaded'))}")
    return "\n".join(lines)


def plan_line(p: dict, max_write_bps: float) -> str:
    """The INFO line a cache logs for its plan `p` (the planner's dict, with
    the cache's reason, backward factor and measured rates)."""
    from ebbtide.cache.budget import fmt_bytes
    from ebbtide.plan import planner

    counts = Counter({k: 0 for k in planner.PLACEMENTS})
    counts.update(d["placement"] for d in p["modules"])
    budget = ""
    if p["activation_budget_bytes"] or p["peak_budget_bytes"]:
        given = ", ".join(f"{what} {fmt_bytes(p[key])}" for what, key in (
            ("saved", "activation_budget_bytes"), ("allocator", "peak_budget_bytes")) if p[key])
        budget = (f"; budget {given}: recompute {counts['recompute']}, "
                  f"recompute+offload {counts['recompute_offload']} (+{p['recompute_seconds']:.3f} s)"
                  + ("" if p["feasible"] else " NOT MET"))
    rates = ", ".join(f"{k} write {v['write_bps'] / 1e6:.0f} MB/s read {v['read_bps'] / 1e6:.0f} MB/s "
                      f"({v['source']})" for k, v in sorted(p["measured"].items()))
    cap = f", SSD write cap {max_write_bps / 1e6:.0f} MB/s" if max_write_bps else ""
    return (f"ebbtide plan ({p['reason']}): {len(p['modules'])} blocks: keep {counts['keep']}, "
            f"host {counts['offload_cpu']} ({fmt_bytes(p['bytes_cpu'])}), ssd {counts['offload_ssd']} "
            f"({fmt_bytes(p['bytes_ssd'])}); predicted stall {p['predicted_stall_seconds']:.3f} s, "
            f"peak {fmt_bytes(p['peak_resident_bytes'])} of {fmt_bytes(p['all_resident_bytes'])} "
            f"({100 * p['peak_resident_fraction']:.0f}%){budget}; forward {p['forward_seconds']:.3f} s, "
            f"backward {p['backward_factor']:.2f}x forward; {rates}{cap}")
