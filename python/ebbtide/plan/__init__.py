"""The performance model and the planner, as the core's cpp/src/plan (both
are C++ in ebbtide._core; these modules adapt records and HF configs):
- model.py: activation bytes, FLOPs, bandwidth needed, SSD lifetime and
  cluster throughput (``ebbtide plan``, docs/model.md);
- planner.py: the offload and budget planner (plan_offload, simulate) that
  the cache's adaptive placement calls;
- megatron.py: Megatron-core's flags for a budget (``ebbtide plan --megatron``);
- replay.py: recorded runs through the step model (the plan that ran,
  predicted against measured; the plan chosen now; issue 40's targets).
Modules here may import ebbtide._core, ebbtide._records and each other
only: they work without torch.
"""
