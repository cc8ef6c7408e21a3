"""The demo and benchmark harness, apart from the library: nothing in
ebbtide.cache, ebbtide.checkpoint or ebbtide.plan imports it.
- models.py: random-init HF models of each family, sized per device;
- methods.py: the ways of handling activations compared, one context each;
- demo.py: ``ebbtide demo`` (the README's main job) and the runner the
  benchmarks in bench/ share;
- rok.py, budget_sweep.py: ``ebbtide rok``'s recompute-offload-keep and
  activation-budget sweeps;
- memmeter.py: peak memory of a step (CUDA allocator or host heap);
- gpu_runs.py, gpu_budget_runs.py: recorded GPU runs (step traces, and the
  bench JSON of older runs rebuilt with the assumptions they force) as runs
  ebbtide.plan.replay replays; replay_report.py: ``ebbtide plan --replay``.
"""
