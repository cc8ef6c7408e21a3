"""Offload planner through Python: ample / zero / capped bandwidth, host tier,
replan trigger, bad input, and no torch import."""
import subprocess
import sys

import pytest

from ebbtide.plan import planner

GB = 10**9


def uniform(n, seconds=0.1, nbytes=GB):
    return [{"name": f"layer{i}", "forward_seconds": seconds, "bytes": nbytes} for i in range(n)]


def placements(plan):
    return [m["placement"] for m in plan["modules"]]


def test_ample_bandwidth_offloads_all_but_last():
    # PlanPlanner.AmpleBandwidthOffloadsAllButTheLast: the last module stays, and the one
    # before it (its reload comes back as backward begins: moving it lowers no peak).
    p = planner.plan_offload(uniform(8), write_bps=1e15, read_bps=1e15)
    assert placements(p) == ["offload_ssd"] * 6 + ["keep"] * 2
    assert p["predicted_stall_seconds"] == pytest.approx(0, abs=1e-9)
    assert p["bytes_ssd"] == 6 * GB and p["bytes_keep"] == 2 * GB and p["bytes_cpu"] == 0
    assert p["all_resident_bytes"] == 8 * GB
    assert p["peak_resident_bytes"] < p["all_resident_bytes"]
    assert p["peak_resident_fraction"] == pytest.approx(p["peak_resident_bytes"] / p["all_resident_bytes"])
    assert [m["name"] for m in p["modules"]] == [f"layer{i}" for i in range(8)]


def test_zero_bandwidth_offloads_nothing():
    p = planner.plan_offload(uniform(8), write_bps=0, read_bps=1e12)
    assert placements(p) == ["keep"] * 8
    assert p["peak_resident_bytes"] == p["all_resident_bytes"]
    assert not planner.needs_replan(p, 0)


def test_cap_offloads_a_prefix_without_stall():
    # See PlanPlanner.CapOffloadsAPrefixWithoutStall: 2500 MB/s -> modules 0 and 1 (module
    # 2's writes would not all have started when backward begins).
    p = planner.plan_offload(uniform(10), write_bps=100e9, read_bps=100e9, max_write_mbps=2500)
    assert placements(p) == ["offload_ssd"] * 2 + ["keep"] * 8
    assert p["predicted_stall_seconds"] == pytest.approx(0, abs=1e-9)
    assert p["planned_write_bps"] == pytest.approx(2.5e9)
    # A higher cap moves more.
    more = planner.plan_offload(uniform(10), write_bps=100e9, read_bps=100e9, max_write_mbps=10000)
    assert more["bytes_ssd"] > p["bytes_ssd"]


def test_host_tier_and_keep_last():
    # PlanPlanner.HostTierTakesWhatTheSsdCannotHide.
    p = planner.plan_offload(uniform(10), write_bps=100e9, read_bps=100e9, max_write_mbps=2500,
                             host_budget_bytes=2 * GB, host_write_bps=50e9, host_read_bps=50e9)
    assert placements(p)[:5] == ["offload_ssd"] * 2 + ["offload_cpu"] * 2 + ["keep"]
    assert p["bytes_cpu"] == 2 * GB
    host = dict(host_budget_bytes=2 * GB, host_write_bps=50e9, host_read_bps=50e9)
    p = planner.plan_offload(uniform(10), 100e9, 100e9, max_write_mbps=2500, target="ssd", **host)
    assert p["bytes_cpu"] == 0 and p["bytes_ssd"] == 2 * GB
    p = planner.plan_offload(uniform(10), 100e9, 100e9, target="cpu", **host)
    assert p["bytes_ssd"] == 0 and p["bytes_cpu"] == 2 * GB
    with pytest.raises(ValueError, match="valid: auto, ssd, cpu"):
        planner.plan_offload(uniform(2), 1e9, 1e9, target="nvme")
    p = planner.plan_offload(uniform(6), write_bps=1e15, read_bps=1e15, keep_last_modules=3)
    assert placements(p) == ["offload_ssd"] * 3 + ["keep"] * 3
    assert p["peak_resident_bytes"] == 3 * GB


def test_needs_replan():
    p = planner.plan_offload(uniform(8), write_bps=10e9, read_bps=10e9)
    assert p["bytes_ssd"] > 0 and p["replan_fraction"] == 0.7
    assert not planner.needs_replan(p, 9e9)
    assert not planner.needs_replan(p, 7.1e9)
    assert planner.needs_replan(p, 6.9e9)
    p = planner.plan_offload(uniform(8), write_bps=10e9, read_bps=10e9, replan_fraction=0.95)
    assert planner.needs_replan(p, 9e9)
    with pytest.raises(ValueError, match="non-negative"):
        planner.needs_replan(p, -1)
    # Faster than planned beyond 1 / replan_fraction (the profile wrote fresh files).
    p = planner.plan_offload(uniform(8), write_bps=10e9, read_bps=10e9)
    assert not planner.link_faster(p, 14e9)
    assert planner.link_faster(p, 14.3e9)
    with pytest.raises(ValueError, match="non-negative"):
        planner.link_faster(p, -1)


def test_guarded_writes_wait_instead_of_exceeding():
    """Note [Guarded writes] through the Python API: the hand case of
    PlanBudget.GuardedWritesWaitInsteadOfExceeding."""
    mods = [dict(name=f"m{i}", forward_seconds=1.0, bytes=100) for i in range(4)]
    pl = ["offload_ssd"] * 3 + ["keep"]
    kw = dict(prefetch_modules=1, activation_budget_bytes=200)
    assert planner.simulate(mods, pl, 50, 1e12, **kw)["forward_wait_seconds"] == 0
    g = planner.simulate(mods, pl, 50, 1e12, guarded_writes=True, **kw)
    assert g["forward_wait_seconds"] == pytest.approx(1.13)
    assert [m["forward_end_seconds"] for m in g["modules"]] == pytest.approx([1, 2.13, 4.13, 5.13])
    # The forward holds the budget; backward's peak adds the first save of
    # module 1 that the last unpack of module 2 prefetches: 200 + 13.
    assert g["peak_resident_bytes"] == 213


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="'write_bps'"):
        planner.plan_offload(uniform(2), write_bps=-1, read_bps=1)
    with pytest.raises(ValueError, match="'layer1'"):
        planner.plan_offload([uniform(2)[0], {"name": "layer1", "forward_seconds": -1, "bytes": 1}], 1e9, 1e9)
    with pytest.raises(ValueError, match="lacks 'bytes'"):
        planner.plan_offload([{"name": "x", "forward_seconds": 1.0}], 1e9, 1e9)
    with pytest.raises(ValueError, match="'max_write_mbps'"):
        planner.plan_offload(uniform(2), 1e9, 1e9, max_write_mbps=-5)
    with pytest.raises(ValueError, match="'keep_last_modules'"):
        planner.plan_offload(uniform(2), 1e9, 1e9, keep_last_modules=-1)
    with pytest.raises(ValueError, match="'host_budget_bytes' must be >= 0, got -1"):
        planner.plan_offload(uniform(2), 1e9, 1e9, host_budget_bytes=-1)
    with pytest.raises(ValueError, match=r"module 1 \('layer1'\) setting 'bytes' must be >= 0, got -1"):
        planner.plan_offload([uniform(2)[0], {"name": "layer1", "forward_seconds": 1, "bytes": -1}], 1e9, 1e9)
    with pytest.raises(ValueError, match="'forward_seconds' must be a number, got '1'"):
        planner.plan_offload([{"name": "x", "forward_seconds": "1", "bytes": 1}], 1e9, 1e9)


def test_planner_and_model_do_not_import_torch():
    code = ("import sys, ebbtide.plan.planner, ebbtide.plan.model; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    import os
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path if p)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_writes_within_forward_offloads_only_what_the_link_copies_in_time():
    mods = uniform(16, 0.1, GB)  # 10 GB/s made; the link copies 4 GB/s
    kw = dict(target="cpu", host_budget_bytes=1 << 50, host_write_bps=4e9, host_read_bps=1e12,
              prefetch_modules=4)
    p = planner.plan_offload(mods, 0, 0, writes_within_forward=True, **kw)
    assert 7 * GB >= p["bytes_cpu"] >= 5 * GB
    assert p["predicted_stall_seconds"] == pytest.approx(0, abs=1e-9)
    for m in p["modules"]:
        if m["placement"] != "keep":
            assert m["write_done_seconds"] <= p["forward_seconds"] + 1e-9


def test_a_plans_recompute_offload_rows_replay_as_they_ran():
    """The plan writes recompute_offload with its tier apart; the trace of the
    step (TensorCache.trace_run) names it whole, which simulate_ran takes
    (a trace that held the plan's name failed its replay)."""
    mods = [dict(name=f"m{i}", forward_seconds=1.0, bytes=100, recomputable=True, recompute_bytes=10,
                 recompute_seconds=1.0) for i in range(3)]
    row = dict(placement="recompute_offload", tier="cpu")
    assert planner.ran_placement(row) == "recompute_offload_cpu"
    assert planner.ran_placement(dict(placement="offload_ssd", tier="ssd")) == "offload_ssd"
    pl = [planner.ran_placement(row), "recompute", "keep"]
    out = planner.simulate_ran(mods, pl, 1e9, 1e9, host_budget_bytes=1 << 30, host_write_bps=1e9,
                               host_read_bps=1e9)
    assert [(m["placement"], m["tier"]) for m in out["modules"]] == [("recompute_offload", "cpu"),
                                                                     ("recompute", None), ("keep", None)]
