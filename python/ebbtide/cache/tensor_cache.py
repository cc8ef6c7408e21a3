"""Activation offloading for PyTorch training: the torch glue of the tensor cache.

    with ebbtide.offload(model, target="ssd", path="/nvme/ebbtide") as cache:
        loss = model(**batch).loss
        loss.backward()
    print(cache.stats())

    cache = ebbtide.TensorCache(target="ssd", path=..., keep_last_modules=1)
    cache.attach(model)
    for batch in loader:
        with cache.step():
            model(**batch).loss.backward()
    cache.close()

Bookkeeping, dedup, the store/load workers and the prefetch schedule live in
the C++ core (``ebbtide._core.CacheCore``); this module adapts torch objects to
it: saved-tensor hooks, module hooks, storage identity, reload buffers, CUDA
streams. See docs/tensor-cache.md for the design and its limits.
"""
from __future__ import annotations

import contextlib
import operator
import os
import tempfile
import threading
import warnings
import weakref
from typing import Optional, Sequence, Union

import torch
import torch.utils.checkpoint

from ebbtide import _core, _fork, _settings

try:  # Note [Two modules] (python/src/glue_api.hpp): the hooks need libtorch
    from ebbtide import _torch
except ImportError as _exc:  # built without torch's headers, or for another torch
    _torch = None
    _TORCH_MISSING = str(_exc)
from ebbtide.cache.adaptive import Adaptive, tier_name
from ebbtide.cache.budget import Budgets, resolve_budgets, resolve_settings
from ebbtide.cache.hooks import _StepHooks, _in_backward

__all__ = ["TensorCache", "offload", "release_pooled_stores"]

_DEFAULT_MIN_BYTES = 64 * 1024
_DEFAULT_WINDOW = 512 * 1024 * 1024
_DEFAULT_WORKERS = 2
_TARGETS = ("auto", "ssd", "cpu")


def _check_int(what: str, value, low: int, high: Optional[int]) -> int:
    """`value` as an int in low..high (high None: no bound), else ValueError naming `what` and the value."""
    try:
        if isinstance(value, bool):
            raise TypeError
        v = operator.index(value)
    except TypeError:
        v = None
    if v is None or v < low or (high is not None and v > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{what}={value!r} must be {bound} (an integer)")
    return v



def _find_blocks(model: torch.nn.Module):
    """The modules the cache scopes by (Note [Scope granularity])."""
    if isinstance(model, (torch.nn.ModuleList, torch.nn.Sequential)) and len(model) > 1:
        return [(str(i), m) for i, m in enumerate(model)]
    chosen = []
    taken = set()
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p in taken):
            continue
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) > 1 and m is not model:
            taken.add(name)
            chosen.extend((f"{name}.{i}", sub) for i, sub in enumerate(m))
    if not chosen:
        chosen = list(model.named_children()) or [("", model)]
    return chosen


def _make_folders(paths):
    """Creates the SSD target's folders that do not exist yet, as a cache
    folder is expected to be; a file in the way or a folder that cannot be
    made is an OSError naming it."""
    for p in paths:
        if os.path.exists(p) and not os.path.isdir(p):
            raise NotADirectoryError(f"ebbtide.TensorCache: path {p!r} is a file, not a folder for the cache's files")
        try:
            os.makedirs(p, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"ebbtide.TensorCache: cannot create the folder {p!r} for the cache's files: "
                                   f"{e.strerror}") from e


class TensorCache(_StepHooks):
    """Offloads the activations autograd saves to SSD files or host memory.

    target: "auto" (host memory up to ``host_budget_bytes``, then SSD files
    under ``path``; adaptive), "ssd" (files under ``path``; a list of
    directories stripes) or "cpu" (host memory). adaptive: profile the first
    step and let the planner choose per block what to offload and where
    (default: True for "auto", False otherwise; EBBTIDE_ADAPTIVE).
    host_budget_bytes: auto's host tier (default EBBTIDE_HOST_BUDGET, else a
    quarter of the available memory when training on CUDA and 0 on CPU).
    max_write_mbps: cap on SSD writes in MB/s (EBBTIDE_MAX_WRITE_MBPS; 0 or
    None: no cap). min_bytes: storages below stay resident.
    keep_last_modules: activations of the last N scoped blocks (and whatever
    follows them, e.g. the head and the loss) stay resident: backward needs
    them first. prefetch_window_bytes: how much backward loads ahead (default:
    the largest block's offloaded bytes, measured in each forward).
    activation_budget_bytes: bound on the step's peak of saved-activation
    bytes held in the training device's memory (EBBTIDE_ACTIVATION_BUDGET;
    None or 0: none). The planner then keeps, offloads or recomputes each
    block (non-reentrant activation checkpointing applied by the cache) to fit
    it at the least step time; a budget nothing fits raises at the first step,
    naming the smallest that does. Implies adaptive.
    memory_budget_bytes: bound on the step's peak of the training device's
    allocator above the step's start (EBBTIDE_MEMORY_BUDGET; what
    torch.cuda.max_memory_allocated() shows: saved activations, gradients,
    temporaries), met the same way (Note [Two budgets] in
    ebbtide/cache/budget.py). On a CPU device it bounds the resident saved
    bytes, as activation_budget_bytes does. Implies adaptive.
    capacity_bytes: bound on offloaded bytes (per directory for ssd); beyond
    it, activations stay resident. max_inflight_bytes: a pack waits while more
    bytes than this are queued for storing (0: never waits). device: the training device (default: that
    of the attached model's first parameter, else of the first saved tensor).
    """

    def __init__(self, target: str = "auto", path: Union[None, str, os.PathLike, Sequence] = None, *,
                 min_bytes: Optional[int] = None, keep_last_modules: int = 1,
                 prefetch_window_bytes: Optional[int] = None, capacity_bytes: int = 0,
                 workers: Optional[int] = None, max_inflight_bytes: Optional[int] = None,
                 device: Union[None, str, torch.device] = None, adaptive: Optional[bool] = None,
                 host_budget_bytes: Optional[int] = None, max_write_mbps: Optional[float] = None,
                 activation_budget_bytes: Optional[int] = None, memory_budget_bytes: Optional[int] = None,
                 _pooled: bool = False):
        self._origin = _fork.Origin()  # Note [Objects across fork]
        if _torch is None:
            raise RuntimeError("ebbtide.TensorCache: ebbtide._torch, the cache's saved-tensor hooks, is not "
                               f"available ({_TORCH_MISSING}); it is built against the installed torch: "
                               "install torch first, then ebbtide with `pip install --no-build-isolation`")
        if target not in _TARGETS:
            raise ValueError(f"ebbtide.TensorCache: target {target!r} is not valid (valid: 'auto', 'ssd', 'cpu')")
        if keep_last_modules < 0:
            raise ValueError(f"ebbtide.TensorCache: keep_last_modules={keep_last_modules} must be >= 0")
        _check_int("ebbtide.TensorCache: capacity_bytes", capacity_bytes, 0, None)
        min_bytes = _settings.resolve("EBBTIDE_MIN_BYTES", min_bytes, "ebbtide.TensorCache: min_bytes")
        prefetch_window_bytes = _settings.resolve("EBBTIDE_PREFETCH_WINDOW", prefetch_window_bytes,
                                                  "ebbtide.TensorCache: prefetch_window_bytes")
        max_inflight_bytes = _settings.resolve("EBBTIDE_MAX_INFLIGHT", max_inflight_bytes,
                                               "ebbtide.TensorCache: max_inflight_bytes")
        workers = _settings.resolve("EBBTIDE_CACHE_WORKERS", workers, "ebbtide.TensorCache: workers")
        self._native = None
        self.target = target
        self.capacity_bytes = int(capacity_bytes)
        self._keep_last = int(keep_last_modules)
        self._device = None
        self._device_is_cpu = False
        if device is not None:
            self._use_device(device)
        self._tmpdir = None
        paths: list = []
        if target in ("ssd", "auto"):
            if path is None:
                # The slab file is unlinked as soon as it is open, so the
                # temporary directory itself serves: no directory of ours for
                # a killed process to leave behind.
                paths = [tempfile.gettempdir()]
            elif isinstance(path, (str, os.PathLike)):
                paths = [os.fspath(path)]
            else:
                paths = [os.fspath(p) for p in path]
            if not paths:
                raise ValueError("ebbtide.TensorCache: path is an empty list")
        # Note [Prefetch window]: unless given, the window is sized after each
        # forward to the largest block's offloaded bytes. Loads stream at tensor
        # granularity (each unpack refills the window), so one block hides the
        # reloads behind backward compute without reloading everything at once,
        # which would undo the savings (the peak is then about kept blocks plus
        # one block).
        self._auto_window = prefetch_window_bytes is None
        window = _DEFAULT_WINDOW if prefetch_window_bytes is None else int(prefetch_window_bytes)
        self._window_bytes = int(window)
        cuda = torch.cuda.is_available() and (self._device is None or self._device.type == "cuda")
        budget = resolve_budgets(activation_budget_bytes, memory_budget_bytes, adaptive)
        max_write_bps, host_budget, adaptive = resolve_settings(target, cuda, adaptive, host_budget_bytes,
                                                               max_write_mbps)
        adaptive = adaptive or bool(budget)
        self.host_budget_bytes = host_budget
        try:
            args = (paths, int(capacity_bytes), int(window), workers or _DEFAULT_WORKERS, bool(cuda),
                    max_inflight_bytes or 0)
            # The GPU path's two bounds have no argument: the variables or the core's defaults.
            gpu_settings = dict(device_inflight_bytes=_core.env_setting("EBBTIDE_DEVICE_INFLIGHT"),
                                staging_bytes=_core.env_setting("EBBTIDE_STAGING_BYTES"))
            try:
                _make_folders(paths)
                self._core = _core.CacheCore(target, *args, host_budget_bytes=host_budget,
                                             max_write_bps=max_write_bps, pooled=bool(_pooled), **gpu_settings)
            except OSError as exc:
                if target != "auto":
                    raise
                # Note [Auto without an SSD]: host memory alone, bounded by the
                # budget when there is one.
                warnings.warn(f"ebbtide: target 'auto' cannot use the SSD path {paths} ({exc}); offloading to "
                              "host memory only", RuntimeWarning, stacklevel=2)
                self._remove_tmpdir()
                paths = []
                args = (paths, int(host_budget)) + args[2:]
                self._core = _core.CacheCore("cpu", *args, **gpu_settings)
        except BaseException:
            self._remove_tmpdir()
            raise
        # Device tensors need the CUDA driver shim; without it (EBBTIDE_CUDA=0,
        # no libcuda) they stay resident rather than failing the step.
        self._cuda_ok = bool(cuda) and _core.cuda_driver_available()
        # Note [Host copies on the caller]: reloads up to this size may land
        # in a tensor the glue allocates (only host-tier entries do).
        self._inline_bytes = int(self._core.inline_copy_bytes) if target != "ssd" else 0
        self.paths = paths
        self._lock = threading.RLock()
        # Note [Hooks in C++] (python/src/torch/hooks.cpp): the saved-tensor
        # hooks, their handles and the books they keep (kept tensors, the
        # step's plan); the glue tells them the device, scope, micro-batch,
        # parameters and placement. Their closed and close_pending flags
        # (close once the last entry goes, Note [Lifetime after the block])
        # are the cache's.
        self._native = _torch.Hooks(self, self._core, self._inline_bytes)
        self._pack_hook = self._native.pack  # one object: _may_recompute compares by identity
        self._native.min_bytes = _DEFAULT_MIN_BYTES if min_bytes is None else int(min_bytes)
        self._native.cuda_ok = self._cuda_ok
        if self._device is not None:
            self._use_device(self._device)
        self._in_step = False
        self._last_stats = None
        self._max_inflight = int(max_inflight_bytes or 0)  # the user's; budget plans may lower it
        # Module scoping (attach).
        self._model_ref = None
        self._hooks: list = []
        self._blocks: list = []
        self._param_storages: set = set()
        self._param_refs: list = []
        self._expected_blocks = 0
        self._stages = None  # attach_stages: the ModuleList of the stage modules
        self._next_mb = 0
        self._mb_hinted = False
        self._blocks_in_fwd = 0
        self._phase = "forward"
        self._adapt = Adaptive(self, max_write_bps=max_write_bps, host_budget_bytes=host_budget,
                               budgets=budget) if adaptive else None
        # Note [Recompute by the cache]: scope -> block module, seen in
        # forward; the blocks whose forward the cache wraps in a checkpoint.
        self._scope_modules: dict = {}
        self._recompute: dict = {}  # id(module) -> (module, had an instance forward, that forward)
        # Note [Framework blocks]: what an integration tells the block hooks.
        self._checkpoint_context_fn = None  # torch checkpoint's context_fn for the cache's recompute
        self._scope_without_grad = False    # blocks run without grad (reentrant checkpoints) open scopes
        self._recompute_blocks = True       # False: the plan never recomputes a block

    # State the hooks read on every save (Note [Hooks in C++]).
    @property
    def min_bytes(self) -> int:
        """Storages below this many bytes stay resident."""
        return self._native.min_bytes

    @min_bytes.setter
    def min_bytes(self, value: int) -> None:
        self._native.min_bytes = _check_int("ebbtide.TensorCache: min_bytes", value, 0, None)

    @property
    def keep_last_modules(self) -> int:
        return self._keep_last

    @keep_last_modules.setter
    def keep_last_modules(self, value: int) -> None:
        self._keep_last = _check_int("ebbtide.TensorCache: keep_last_modules", value, 0, None)
        self._native.invalidate_placement()

    @property
    def _closed(self) -> bool:
        n = self._native
        return n is None or n.closed

    @property
    def _close_pending(self) -> bool:
        return self._native.close_pending

    @property
    def _fwd_mb(self) -> int:
        return self._native.fwd_mb

    @_fwd_mb.setter
    def _fwd_mb(self, mb: int) -> None:
        self._native.fwd_mb = mb

    @property
    def _scope(self) -> int:
        return self._native.scope

    @_scope.setter
    def _scope(self, scope: int) -> None:
        n = self._native
        n.scope = scope
        n.invalidate_placement()

    @property
    def _plan(self) -> dict:
        """Per scope of the step: what was saved, and kept or offloaded."""
        return {s: dict(scope=s, module=self._scope_name(s), decision="offload" if offload else "keep",
                        tier=tier_name(tier) if offload else None, tensors=n, bytes=b, bytes_offloaded=off)
                for s, offload, tier, n, b, off in self._native.plan_rows()}

    # ------------------------------------------------------------------ public
    def attach(self, model: torch.nn.Module) -> "TensorCache":
        """Scopes by the model's blocks and records its parameters (never offloaded)."""
        self._attach(model, _find_blocks(model), "attach")
        self._hooks.append(model.register_forward_pre_hook(self._on_root_forward_pre))
        self._hooks.append(model.register_forward_hook(self._on_root_forward))
        return self

    def _attach(self, model, blocks, what):
        """Records `model`'s parameters and hooks `blocks` (name, module) as the scoped blocks."""
        self._check_open()
        if self._model_ref is not None:
            raise RuntimeError(f"ebbtide.TensorCache.{what}: already attached to a model; detach() first")
        if not blocks:
            raise ValueError(f"ebbtide.TensorCache.{what}: no modules given")
        self._model_ref = weakref.ref(model)
        self._record_params(model)
        if self._device is None:
            p = next(iter(model.parameters()), None)
            if p is not None:
                self._use_device(p.device)
        self._blocks = blocks
        self._expected_blocks = len(blocks)
        for name, block in blocks:
            self._hooks.append(block.register_forward_pre_hook(self._on_block_pre))
            self._hooks.append(block.register_forward_hook(self._make_block_post(name)))

    def attach_stages(self, modules, blocks=None) -> "TensorCache":
        """Attaches to several modules whose forwards run separately, such as
        the pipeline stages one rank holds (interleaved and zero-bubble
        schedules): each forward of one starts a micro-batch record of its
        own. Each module is one scoped block, numbered in the order given, or
        `blocks` names the blocks inside each: one list of (name, submodule)
        per module (Megatron's decoder layers), numbered on across the
        modules. ``keep_last_modules`` counts blocks from the end.

        Note [Stages sharing a cache]: the saved-tensor hooks of a step take
        every save, whichever stage makes it, so one cache serves all of a
        rank's stages (two caches in step at once would not share them). The
        cache holds the ModuleList it scopes by; a stage's forward starts at
        scope (its first block - 1), so its first block is the next scope.
        """
        stages = torch.nn.ModuleList(modules)
        if blocks is None:
            blocks = [[(str(i), m)] for i, m in enumerate(stages)]
        else:
            blocks = [list(b) for b in blocks]
            if len(blocks) != len(stages):
                raise ValueError(f"ebbtide.TensorCache.attach_stages: {len(blocks)} lists of blocks for "
                                 f"{len(stages)} modules (one list per module)")
        self._attach(stages, [b for per_stage in blocks for b in per_stage], "attach_stages")
        self._stages = stages
        first = 0
        for m, per_stage in zip(stages, blocks):
            # First among the module's pre-hooks, so its block hook sees the
            # stage's record.
            self._hooks.append(m.register_forward_pre_hook(self._stage_forward_pre(first), prepend=True))
            self._hooks.append(m.register_forward_hook(self._on_root_forward))
            first += len(per_stage)
        return self

    def _stage_forward_pre(self, first_block):
        @torch.compiler.disable
        def hook(module, args):
            self._on_root_forward_pre(module, args)
            if self._in_step and not _in_backward():
                self._blocks_in_fwd = first_block
        return hook

    def detach(self) -> None:
        """Removes the module hooks and the cache's recompute wrappers (the cache stays usable)."""
        self._set_recompute(())
        self._scope_modules = {}
        self._checkpoint_context_fn, self._scope_without_grad, self._recompute_blocks = None, False, True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._blocks = []
        self._stages = None
        self._model_ref = None
        self._param_storages = set()
        self._param_refs = []
        if self._native is not None:
            self._native.set_params([])
            self._native.invalidate_placement()

    @contextlib.contextmanager
    def step(self):
        """Saved-tensor hooks for one training step (forward and backward)."""
        self._check_open()
        if self._in_step:
            raise RuntimeError("ebbtide.TensorCache.step(): step() inside step() of the same cache; "
                               "end the outer step first")
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None:
            self._record_params(model)
        self._core.begin_step()
        if self._adapt is not None:
            self._adapt.begin_step(self._core.stats())
        with self._lock:
            self._native.begin_step()
        step_no = self._core.current_step
        self._in_step = True
        # Micro-batch ids keep counting across steps: a graph retained past
        # its step keeps its own records.
        self._fwd_mb = self._next_mb
        self._mb_hinted = False
        self._scope = -1
        self._blocks_in_fwd = 0
        self._phase = "forward"
        ok = False
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack_hook, self._native.unpack):
                yield self
            ok = True
        finally:
            self._in_step = False
            if not ok:
                self._abort(step_no)
            with self._lock:
                if ok:
                    self._break_cycles_locked(step_no)
                if not self._closed:
                    self._poll_locked()
                    self._core.end_step()
                    self._native.fold_step()
                    if ok and self._adapt is not None:
                        self._adapt.end_step(self._core.stats())
                    self._last_stats = self._make_stats()
            if ok and self._adapt is not None and self._adapt.infeasible:
                # Said once, at the step that made the plan (Note [Budget plan]).
                msg, self._adapt.infeasible = self._adapt.infeasible, None
                raise ValueError(msg)

    def profile(self) -> None:
        """Makes the next step a profiling step (Note [Profiling step] in
        ebbtide/cache/adaptive.py); the plan is made again from its measurements.
        Turns an adaptive=False cache adaptive."""
        self._check_open()
        if self._adapt is None:
            self._adapt = Adaptive(self, max_write_bps=self.max_write_mbps * 1e6,
                                   host_budget_bytes=self.host_budget_bytes)
        self._adapt.request_profile()

    @property
    def adaptive(self) -> bool:
        return self._adapt is not None

    @property
    def max_write_mbps(self) -> float:
        """The SSD write cap in MB/s (0: none). Settable; a lower cap shows in
        the next step's measured bandwidth, which triggers a re-plan."""
        for t in self._core.stats()["tiers"]:
            if t["tier"] == "ssd":
                return t["write_limit_bps"] / 1e6
        return 0.0

    @max_write_mbps.setter
    def max_write_mbps(self, value: float) -> None:
        self._check_open()
        value = _core.check_setting("EBBTIDE_MAX_WRITE_MBPS", value, "ebbtide.TensorCache: max_write_mbps")
        self._core.set_write_limit(_core.TIER_SSD, float(value) * 1e6)
        if self._adapt is not None:
            self._adapt.max_write_bps = float(value) * 1e6

    def microbatch(self, index: int) -> None:
        """Hint: the next forward (or backward) is micro-batch `index` (pipeline schedules)."""
        self._fwd_mb = int(index)
        self._mb_hinted = True
        self._next_mb = max(self._next_mb, int(index) + 1)

    def phase(self, name: str) -> None:
        """Hint: "forward" or "backward" begins; "backward" starts prefetching the current micro-batch."""
        if name not in ("forward", "backward"):
            raise ValueError(f"ebbtide.TensorCache.phase: {name!r} is not 'forward' or 'backward'")
        self._check_open()
        self._phase = name
        if name == "backward":
            self._prefetch_scope(self._fwd_mb, 1 << 62)
            self._mb_hinted = False  # a backward hint does not name the next forward

    def stats(self) -> dict:
        """Statistics of the last (or current) step, plus "total" over all steps and the plan."""
        with self._lock:
            if self._closed or (not self._in_step and self._last_stats is not None):
                if self._last_stats is None:
                    raise RuntimeError("ebbtide.TensorCache.stats: the cache was closed before any step")
                return dict(self._last_stats)
            self._poll_locked()
            return self._make_stats()

    def summary(self) -> str:
        """stats() as a few readable lines (print(cache.summary())); stats()
        keeps the dict for programs."""
        from ebbtide.cache.summary import format_summary

        return format_summary(self.stats())

    def predict(self, activation_budget_bytes: int = 0, memory_budget_bytes: int = 0) -> dict:
        """The plan the last profiling step gives for these budgets (0: none),
        without applying it: the planner's dict (placements, predicted peaks
        and step time; ``feasible``, ``min_budget_bytes`` and
        ``min_peak_budget_bytes`` say whether it fits and the smallest
        budgets that do). Needs an adaptive cache that has profiled a step."""
        self._check_open()
        if self._adapt is None:
            raise RuntimeError("ebbtide.TensorCache.predict: the cache is not adaptive (adaptive=False)")
        return self._adapt.predict(Budgets(
            _check_int("ebbtide.TensorCache.predict: activation_budget_bytes", activation_budget_bytes, 0, None),
            _check_int("ebbtide.TensorCache.predict: memory_budget_bytes", memory_budget_bytes, 0, None)))

    def trace_run(self, name: str, measured: dict) -> dict:
        """This cache's last plan as a replayable run (ebbtide.plan.replay's
        trace format, what `ebbtide plan --replay` reads inside a file
        ``{"format": "ebbtide-step-trace", "version": 1, "runs": [...]}``):
        the profile, the settings and decisions the step ran with, and
        `measured` (``step_seconds``, ``peak_bytes``: the allocator's peak
        above the step's start). Needs an adaptive cache with a plan."""
        self._check_open()
        if self._adapt is None:
            raise RuntimeError("ebbtide.TensorCache.trace_run: the cache is not adaptive (adaptive=False)")
        return self._adapt.trace_run(name, measured)

    def plan(self) -> list:
        """Per scoped block of the last step: name, keep/offload, bytes saved."""
        return [dict(v) for _, v in sorted(self._plan.items())]

    def describe(self) -> str:
        self._check_open()
        return self._core.describe()

    def drain(self) -> None:
        """Waits until every queued store and load has finished (tests, benchmarks)."""
        self._check_open()
        self._core.drain()
        with self._lock:
            self._poll_locked()

    def close(self) -> None:
        """Frees every entry and its space; the cache is unusable afterwards. Idempotent."""
        if self._closed:
            return
        self._check_process()  # closing the parent's store here would wait for threads it does not have
        with self._lock:
            if self._closed:
                return
            if self._last_stats is None or self._in_step:
                try:
                    self._poll_locked()
                    self._last_stats = self._make_stats()
                except Exception:
                    pass
            self.detach()
            self._native.closed = True
            self._core.close()
        self._remove_tmpdir()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        origin = getattr(self, "_origin", None)
        if origin is None or not origin.here():
            return  # a forked child's copy: Note [Objects across fork]
        try:
            self.close()
        except Exception:
            pass


@contextlib.contextmanager
def offload(model: Optional[torch.nn.Module] = None, target: str = "auto",
            path: Union[None, str, os.PathLike, Sequence] = None, **kwargs):
    """One training step with activation offloading (like torch.autograd.graph.save_on_cpu).

    Yields the TensorCache; its stats() stay readable after the block. The
    cache's store (slab files, I/O threads, page-locked host memory) comes
    from a process-wide pool and goes back to it at close, so entering and
    leaving costs its setup only once per process;
    ``ebbtide.release_pooled_stores()`` drops the idle ones. As
    with save_on_cpu, backward may run after the block: the cache closes (and
    releases its files, memory and threads) once the autograd graph that
    holds its entries is gone, or at once when nothing holds any
    (Note [Lifetime after the block]).
    """
    # Note [Store pool] (cpp/src/cache/store_pool.cpp): the store is borrowed from a pool
    # of idle ones with the same settings and given back at close, so a
    # cache per step costs its slab file and threads once per process.
    cache = TensorCache(target=target, path=path, _pooled=True, **kwargs)
    ok = False
    key = None
    try:
        if model is not None:
            cache.attach(model)
            if cache._adapt is not None:
                # Note [Plans across offload() calls] (ebbtide/cache/adaptive.py).
                key = _plan_key(cache, kwargs)
                state = _PLANS.get(model, {}).get(key)
                if state is not None:
                    cache._adapt.restore(state)
        with cache.step():
            yield cache
        ok = True
    finally:
        if ok and key is not None:
            kept = _PLANS.setdefault(model, {})
            if cache._adapt.profile_modules and not cache._adapt._profile_next:
                kept[key] = cache._adapt.snapshot()
            else:  # the step's saves no longer match the profile: the next call profiles
                kept.pop(key, None)
        if ok:
            cache._close_when_released()
        else:
            cache.close()


# Per model: settings -> the last profile an offload() cache planned from.
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _plan_key(cache: "TensorCache", kwargs: dict) -> tuple:
    """The settings a kept profile belongs to: the cache's and the call's."""
    return (cache.target, tuple(cache.paths), str(cache._device),
            tuple(sorted((k, repr(v)) for k, v in kwargs.items())),
            repr(cache._adapt.budgets) if cache._adapt is not None else None)  # budgets from the environment too


def release_pooled_stores() -> int:
    """Drops the idle stores ``offload()`` keeps for its next use (their slab
    files, disk space, threads and host memory); returns how many."""
    return int(_core.release_pooled_stores())
