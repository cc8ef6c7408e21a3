"""The activation cache's torch glue (docs/tensor-cache.md), as the core's
cpp/src/cache is the cache itself:
- tensor_cache.py: ``TensorCache`` (construction, attach, steps, stats, close)
  and ``offload()``;
- hooks.py: what runs inside a step (the pack path, module hooks, release
  points, recompute by the cache); the C++ side is python/src/torch/hooks.cpp;
- adaptive.py: adaptive placement (the profiling step, plans, re-plans),
  measuring for the C++ planner (ebbtide.plan.planner);
- profile.py: what a profiling step measures beyond the forward times
  (backward times, gradient bytes, temporaries) for the step model;
- budget.py: the two memory budgets (``Budgets``), the settings that
  resolve them, and the messages for a budget no plan meets;
- summary.py: ``TensorCache.summary()``, its statistics as readable lines.
Modules here may import ebbtide._core, ebbtide._torch, ebbtide._settings and
ebbtide.plan; never ebbtide.checkpoint or the harness.
"""
from ebbtide.cache.tensor_cache import TensorCache, offload, release_pooled_stores

__all__ = ["TensorCache", "offload", "release_pooled_stores"]
