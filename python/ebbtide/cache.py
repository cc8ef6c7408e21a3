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
import shutil
import tempfile
import threading
import warnings
import weakref
from typing import Iterable, Optional, Sequence, Union

import torch
import torch.utils.checkpoint
from torch.multiprocessing.reductions import StorageWeakRef

from ebbtide import _core, _settings

try:  # Note [Two modules] (python/src/glue_api.hpp): the hooks need libtorch
    from ebbtide import _torch
except ImportError as _exc:  # built without torch's headers, or for another torch
    _torch = None
    _TORCH_MISSING = str(_exc)
from ebbtide._adaptive import _CUDA_PREFETCH_MODULES, Adaptive, resolve_budget, resolve_settings, tier_name

__all__ = ["TensorCache", "offload", "release_pooled_stores"]

_StateError = _core.StateError

_DEFAULT_MIN_BYTES = 64 * 1024
_ALL_SCOPES = (1 << 63) - 1
_LINK_PROBE_BYTES = 256 << 20
_LINK_BANDWIDTH: dict = {}  # CUDA device index -> (d2h, h2d) bytes/s
_DEFAULT_WINDOW = 512 * 1024 * 1024
_DEFAULT_WORKERS = 2
_TARGETS = ("auto", "ssd", "cpu")


def _add_kept(d, counts):
    """Adds the hooks' counts of kept tensors (Note [Kept tensors]) to a stats dict of the core."""
    saved, kept, deduped, nbytes, peak = counts
    d["tensors_saved"] += saved
    d["tensors_kept"] += kept
    d["tensors_deduped"] += deduped
    d["saved_bytes_total"] += nbytes
    d["peak_resident_bytes"] += peak


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


_warned_no_cuda_shim = False


def _warn_no_cuda_shim():
    global _warned_no_cuda_shim
    if not _warned_no_cuda_shim:
        _warned_no_cuda_shim = True
        warnings.warn("ebbtide: CUDA tensors stay on the GPU (nothing is offloaded): the CUDA driver shim is "
                      f"unavailable ({_core.cuda_unavailable_reason() or 'disabled for this cache'})",
                      RuntimeWarning, stacklevel=4)


_STRIDED = torch.strided
_graph_task_id = torch._C._current_graph_task_id
_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _in_backward() -> bool:
    # Note [Saves during backward]: activation-checkpoint recompute (and
    # create_graph backward) saves tensors while a graph task runs; they die
    # with that backward, so offloading them only costs time.
    return torch._C._current_graph_task_id() != -1


def _check_version(dtype, shape, saved, current):
    """The RuntimeError autograd raises when a saved tensor changed in place."""
    if current != saved:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{dtype} {list(shape)}] is at version {current}; expected version "
            f"{saved} instead. (reported by ebbtide's saved-tensor hooks)")


def _is_kv_cache(v) -> bool:
    """An HF key/value cache (DynamicCache and kin): stateful, appended to by each forward."""
    return type(v).__module__.startswith("transformers.") and hasattr(v, "get_seq_length")


def _first_grad_tensor(obj, depth=0):
    """The first tensor requiring grad in a module's output (tuples, dicts, ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.requires_grad else None
    if depth > 3:
        return None
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for o in obj:
            t = _first_grad_tensor(o, depth + 1)
            if t is not None:
                return t
    return None


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


class TensorCache:
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
                 activation_budget_bytes: Optional[int] = None, _pooled: bool = False):
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
        cuda = torch.cuda.is_available() and (self._device is None or self._device.type == "cuda")
        budget = resolve_budget(activation_budget_bytes, adaptive)
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
                               activation_budget_bytes=budget) if adaptive else None
        # Note [Recompute by the cache]: scope -> block module, seen in
        # forward; the blocks whose forward the cache wraps in a checkpoint.
        self._scope_modules: dict = {}
        self._recompute: dict = {}  # id(module) -> (module, had an instance forward, that forward)

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

    def attach_stages(self, modules) -> "TensorCache":
        """Attaches to several modules whose forwards run separately, such as
        the pipeline stages one rank holds (interleaved and zero-bubble
        schedules): each module is one scoped block, numbered in the order
        given, and each forward of one starts a micro-batch record of its own.
        ``keep_last_modules`` counts these modules from the end.

        Note [Stages sharing a cache]: the saved-tensor hooks of a step take
        every save, whichever stage makes it, so one cache serves all of a
        rank's stages (two caches in step at once would not share them). The
        cache holds the ModuleList it scopes by; a stage's forward starts at
        scope (position - 1), so its block is scope `position`.
        """
        stages = torch.nn.ModuleList(modules)
        self._attach(stages, [(str(i), m) for i, m in enumerate(stages)], "attach_stages")
        self._stages = stages
        for position, m in enumerate(stages):
            # First among the module's pre-hooks, so its block hook sees the
            # stage's record.
            self._hooks.append(m.register_forward_pre_hook(self._stage_forward_pre(position), prepend=True))
            self._hooks.append(m.register_forward_hook(self._on_root_forward))
        return self

    def _stage_forward_pre(self, position):
        @torch.compiler.disable
        def hook(module, args):
            self._on_root_forward_pre(module, args)
            if self._in_step and not _in_backward():
                self._blocks_in_fwd = position
        return hook

    def detach(self) -> None:
        """Removes the module hooks and the cache's recompute wrappers (the cache stays usable)."""
        self._set_recompute(())
        self._scope_modules = {}
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
        ebbtide/_adaptive.py); the plan is made again from its measurements.
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

    def predict(self, activation_budget_bytes: int) -> dict:
        """The plan the last profiling step gives for `activation_budget_bytes`
        (0: no budget), without applying it: the planner's dict (placements,
        predicted peak and step time; ``feasible`` and ``min_budget_bytes`` say
        whether it fits and the smallest budget that does). Needs an adaptive
        cache that has profiled a step."""
        self._check_open()
        if self._adapt is None:
            raise RuntimeError("ebbtide.TensorCache.predict: the cache is not adaptive (adaptive=False)")
        return self._adapt.predict(_check_int("ebbtide.TensorCache.predict: activation_budget_bytes",
                                              activation_budget_bytes, 0, None))

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
        try:
            self.close()
        except Exception:
            pass

    # ---------------------------------------------------------------- internals
    def _use_device(self, device):
        self._device = d = self._normalize_device(device)
        self._device_is_cpu = d.type == "cpu"
        if self._native is not None:
            self._native.device = -1 if self._device_is_cpu else d.index if d.type == "cuda" else -3

    @staticmethod
    def _normalize_device(device):
        d = torch.device(device)
        if d.type == "cuda" and d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        return d

    def _check_open(self):
        if self._closed:
            raise RuntimeError("ebbtide.TensorCache: the cache is closed")

    def _remove_tmpdir(self):
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _record_params(self, model):
        refs = []
        keys = set()
        for p in model.parameters():
            try:
                st = p.untyped_storage()
            except Exception:
                continue
            keys.add(st._cdata)
            refs.append(StorageWeakRef(st))  # keeps the keys unique while recorded
        for b in model.buffers():
            try:
                st = b.untyped_storage()
            except Exception:
                continue
            keys.add(st._cdata)
            refs.append(StorageWeakRef(st))
        self._param_storages = keys
        self._param_refs = refs
        self._native.set_params(list(keys))

    def _base_is_param(self, b) -> bool:
        """Whether `b` (a view's base) or its bases are, or share storage with, a parameter or buffer."""
        params = self._param_storages
        for _ in range(8):
            if type(b) is not torch.Tensor and isinstance(b, torch.nn.Parameter):
                return True
            try:
                if b.untyped_storage()._cdata in params:
                    return True
            except Exception:
                return True
            b = b._base
            if b is None:
                return False
        return True

    def _eligible(self, t):
        """The storage of `t` when it may be offloaded, else None.

        Note [What is never offloaded]: parameters and anything sharing their
        storage, tensor subclasses (DTensor, FakeTensor, Parameter), non-strided
        or exotic tensors, tensors off the training device, saves during
        backward. Ordered cheapest first: it runs for every saved tensor.
        """
        if type(t) is not torch.Tensor or _graph_task_id() != -1:
            return None
        if self._device_is_cpu:
            if not t.is_cpu:
                return None
        else:
            dev = self._device
            if dev is None:
                if t.is_meta:
                    return None
                self._use_device(t.device)
                return self._eligible(t)
            if not t.is_cuda or t.device != dev:
                return None
            if not self._cuda_ok:
                _warn_no_cuda_shim()
                return None
        if (t.layout is not _STRIDED or t.is_quantized or t.is_nested or t.is_conj() or t.is_neg()
                or _is_functorch_wrapped(t)):
            return None
        st = t.untyped_storage()
        if st._cdata in self._param_storages:
            return None
        b = t._base
        if b is not None and self._base_is_param(b):
            return None
        return st

    def _keeping_scope(self) -> bool:
        k = self.keep_last_modules
        return k > 0 and self._model_ref is not None and self._scope >= self._expected_blocks - k

    def _pack(self, t):
        # The Python path of the pack hook (Note [Hooks in C++]): tensors of a
        # CUDA cache, and the first one of a cache whose device is not known.
        if self._closed:
            return t
        st = self._eligible(t)
        if st is None:
            return t
        nbytes = st.nbytes()
        if nbytes == 0:
            return t
        decision, tier = self._scope_placement()
        native = self._native
        if nbytes < self.min_bytes or decision != "offload":
            # Note [Kept tensors]: a save that stays resident needs no core
            # entry: the handle holds the tensor (as autograd would) and its
            # version, and the hooks count it once per storage and version,
            # like the core's dedup. On a GPU the core learns the bytes per
            # block, for the prefetch distance (note_kept).
            return native.keep(t, nbytes, decision == "offload", tier)
        if t.is_cuda:
            dev = t.device.index
            stream = torch.cuda.current_stream(t.device).cuda_stream
        else:
            dev = -1
            stream = 0
        version = t._version
        key = st._cdata
        # Note [Glue objects] (tensor_cache_save.cpp): the core holds `t` only while
        # the entry needs it resident; the storage's weak reference comes back
        # with prefetch candidates and keeps its key unique meanwhile.
        # Completions come back with the call (Note [Release points]: on a GPU
        # the released tensors go before the next allocation).
        try:
            eid, is_new, off, hid, done = self._core.save(key, version, st.data_ptr(), nbytes, dev, stream,
                                                          self._fwd_mb, True, tier, t, native.storage_ref(t))
        except _StateError:
            if self._closed:
                return t  # closed meanwhile: autograd keeps it
            raise
        if done is not None:
            native.ack(done)
        if off and t.is_cuda:
            # Note [Stream-ordered drops] (tensor_cache_device.cpp), as in the C++ hooks.
            t.record_stream(torch.cuda.current_stream(t.device))
        if is_new:
            native.note_plan(nbytes, off, decision == "offload", tier)
        return native.handle(t, eid, hid, version, key, nbytes)

    def _flush_kept_locked(self):
        n = self._native.take_unflushed()
        if n:
            self._core.note_kept(self._fwd_mb, n)

    def _scope_placement(self):
        """("keep" | "offload", store tier hint) for the current scope: keep_last_modules, then the plan."""
        if self._keeping_scope():
            return "keep", -1
        if self._adapt is not None:
            offload, tier = self._adapt.placement(self._scope)
            return ("offload" if offload else "keep"), tier
        return "offload", -1

    def _scope_name(self, s):
        return self._blocks[s][0] if 0 <= s < len(self._blocks) else ("<before blocks>" if s < 0 else
                                                                      f"<scope {s}>")

    def _poll_locked(self):
        done = self._core.poll()
        if done:
            self._ack(done)

    def _ack(self, done):
        """Completions: (id, ok, live tensor the core stopped holding, saved version)."""
        self._native.ack(done)

    def _stream(self):
        d = self._device
        if d is not None and d.type == "cuda":
            return torch.cuda.current_stream(d).cuda_stream
        return 0

    def _prefetch_scope(self, mb, scope):
        with self._lock:
            if self._closed:
                return
            if self._on_cuda() and torch.cuda.is_current_stream_capturing():
                return  # Note [Graph capture] (tensor_cache_device.cpp): nothing to release or load inside one
            if self._on_cuda():
                # Note [Release points]: backward of the micro-batch begins.
                self._core.release_copies(mb, _ALL_SCOPES, self._stream())
            self._poll_locked()
            self._native.prefetch_scope(mb, scope, _graph_task_id())

    def _entry_gone(self):
        # A handle's entry went while a close waits for the last one (the
        # hooks call this; Note [Lifetime after the block]).
        with self._lock:
            if not self._closed and self._core.entry_count() == 0:
                self._finish_deferred_close()

    def _close_when_released(self):
        # Note [Lifetime after the block]: ebbtide.offload() leaves its block
        # with the step's saved-tensor hooks gone but the graph (and the
        # handles in it) possibly alive: `loss.backward()` may come after the
        # block, as with save_on_cpu. The module hooks go now; the core, its
        # files and threads stay until the last handle dies, then close.
        with self._lock:
            if self._closed:
                return
            self.detach()
            self._native.close_pending = True
            if self._core.entry_count() == 0:  # after the flag: a release racing with us sees one or the other
                self.close()

    def _finish_deferred_close(self):
        try:
            self._poll_locked()
            self._last_stats = self._make_stats()  # the backward's reloads included
        except Exception:
            pass
        self.close()

    def _abort(self, step_no):
        # Note [Exceptions in a step]: the graph of a failed step may live on in
        # the traceback; release its entries now so no memory or file space
        # leaks, and make late unpacks fail clearly.
        with self._lock:
            if self._closed:
                return
            self._core.release_step(step_no)
            # Note [Kept cycles]: the failed step's kept handles let go of
            # their tensors (unpacking one now raises).
            self._native.abort_kept()

    def _break_cycles_locked(self, step_no):
        # Note [Kept cycles]
        # A tensor held by a handle that its own node saved (an op's output:
        # relu, exp, ...) forms a cycle through autograd's C++ graph (tensor
        # -> grad_fn -> saved handle -> tensor) that Python's collector cannot
        # see; identity saved-tensor hooks leak the same way. Backward breaks
        # it by freeing the saved tensors. A graph that is still alive when
        # its step ends (no backward yet, or never: an evaluation forward
        # with grad enabled) would leak, so its held tensors become detached
        # ones: the same storage and version counter without the grad_fn
        # (autograd gives the unpacked tensor its grad_fn back). Only the
        # survivors pay for it.
        self._native.detach_kept()
        if not self._closed:
            for eid, live in self._core.held_lives(step_no):
                self._core.hold_live(eid, live.detach())

    def _make_stats(self) -> dict:
        s = self._core.stats()
        out = dict(s["step"])
        _add_kept(out, self._native.kept_counts(False))  # Note [Kept tensors]
        out["total"] = dict(s["total"])
        _add_kept(out["total"], self._native.kept_counts(True))
        out["steps"] = s["steps"]
        out["resident_bytes"] = s["resident_bytes"] + self._native.kept_live
        out["entries"] = s["entries"]
        out["store_bytes_held"] = s["store_bytes_held"]
        out["store_bytes_staged"] = s["store_bytes_staged"]
        out["store_host_registrations"] = s["store_host_registrations"]
        out["target"] = self.target
        out["plan"] = self.plan()
        out["tiers"] = s["tiers"]
        out["adaptive"] = self._adapt is not None
        out["activation_budget_bytes"] = self._adapt.activation_budget_bytes if self._adapt is not None else 0
        out["recomputed_blocks"] = sorted(self._scope_name(s) for s in self._adapt.recompute_scopes) \
            if self._adapt is not None else []
        if self._adapt is not None:
            out.update(self._adapt.stats())
        else:
            out.update(planner=None, predicted_stall_seconds=None, predicted_peak_bytes=None,
                       max_inflight_bytes=self._max_inflight)
        return out

    # ------------------------------------------------------------ module hooks
    # Note [Hooks under compile]
    # A block compiled with module.compile() (torchtune, per-block compile)
    # compiles its hooks with its forward. The cache's module hooks keep
    # books in Python and C++ (scopes, marks, polls), so dynamo must not
    # trace them: each is torch.compiler.disable'd, a graph break around the
    # hook. The recompute wrapper (Note [Recompute by the cache]) is traced:
    # its checkpoint becomes part of the block's graph.
    @torch.compiler.disable
    def _on_root_forward_pre(self, module, args):
        if not self._in_step or _in_backward():
            return
        if self._mb_hinted:
            self._mb_hinted = False
        else:
            self._fwd_mb = self._next_mb
            self._next_mb += 1
        self._scope = -1
        self._blocks_in_fwd = 0
        if self._adapt is not None:
            self._adapt.mark(-1)

    @torch.compiler.disable
    def _on_root_forward(self, module, args, output):
        if not self._in_step or _in_backward():
            return
        if self._adapt is not None:
            self._adapt.mark(None)
        with self._lock:
            if self._closed:
                return
            self._flush_kept_locked()
            self._core.scope_end(self._fwd_mb, max(self._scope, 0))
            if self._blocks_in_fwd and self._stages is None:
                self._expected_blocks = self._blocks_in_fwd
                self._native.invalidate_placement()
            if self._auto_window:
                biggest = max((p["bytes_offloaded"] for p in self._plan.values()), default=0)
                if biggest:
                    blocks = _CUDA_PREFETCH_MODULES if self._on_cuda() else 1
                    self._core.set_prefetch_window(max(biggest * blocks, 64 << 10))
            self._poll_locked()

    def _release_after_block(self):
        # Note [Release points] (tensor_cache_device.cpp): after this block's forward,
        # the compute stream waits for the copies the plan has done by now and
        # the glue drops those tensors, an ordinary stream-ordered free.
        with self._lock:
            if self._closed:
                return
            scope = self._scope
            self._core.scope_end(self._fwd_mb, scope)
            through = self._adapt.release_through(scope) if self._adapt is not None else scope - 1
            if through >= 0:
                self._core.release_copies(self._fwd_mb, through, self._stream())
                self._poll_locked()

    # ------------------------------------------------------------- recompute
    # Note [Recompute by the cache]
    # A block the budget plan recomputes (Note [Budget plan]) runs its forward
    # inside torch.utils.checkpoint (non-reentrant, RNG state preserved, so
    # dropout matches): the cache sets the block's `forward` attribute to a
    # wrapper, after the module's pre-hooks (FSDP's unshard, the cache's own
    # scope) and before its post-hooks, so those run once and recompute in
    # backward re-runs the forward alone. The checkpoint saves the block's
    # positional tensor inputs through the ambient saved-tensor hooks, the
    # cache's: kept for `recompute`, offloaded for `recompute_offload`; the
    # activations inside the block go to the checkpoint's own hooks and are
    # re-made in backward. Outside a step of this cache, without grad, or in
    # a backward (another checkpoint's recompute) the wrapper calls the
    # forward as is. A block the user already checkpoints (HF gradient
    # checkpointing, torch's checkpoint_wrapper, or one whose forward the
    # profile saw run under someone else's saved-tensor hooks) is never
    # wrapped again. A forward given a key/value cache (HF models train with
    # `use_cache` on unless told otherwise) appends to it; the recompute gets
    # None for it (and use_cache False), as HF's own checkpointing does: in
    # training the cache held nothing of this block before its forward, so
    # the recomputed attention sees the same keys and values, and
    # checkpoint's shape check fails loudly where it would not.
    def _may_recompute(self, module) -> bool:
        if self._stages is not None:
            return False  # a pipeline stage's forward holds its communication
        if getattr(module, "gradient_checkpointing", False) and module.training:
            return False  # HF GradientCheckpointingLayer
        for m in module.modules():
            if hasattr(m, "_checkpoint_wrapped_module"):
                return False  # torch.distributed's checkpoint_wrapper (torchtune, Lightning, Accelerate)
            if type(m).__name__ == "FullyShardedDataParallel":
                return False  # FSDP1 unshards in its forward: the checkpoint must sit inside it
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is not None and top[0] is self._pack_hook

    def _scope_bytes(self, scope) -> int:
        """All bytes saved so far in `scope` this step."""
        for s, _offload, _tier, _n, b, _off in self._native.plan_rows():
            if s == scope:
                return b
        return 0

    def _set_recompute(self, scopes) -> None:
        """Wraps the forwards of the blocks of `scopes` in a checkpoint and
        unwraps the others (Note [Recompute by the cache])."""
        want = {}
        for s in scopes:
            m = self._scope_modules.get(s)
            if m is not None:
                want[id(m)] = m
        for key, (m, had, fwd, ours) in list(self._recompute.items()):
            if key in want and m.__dict__.get("forward") is ours:
                continue
            # Only our own wrapper is undone: a forward someone set since
            # (accelerate's hooks removed, another cache) stays as they left it.
            if m.__dict__.get("forward") is ours:
                if had:
                    m.forward = fwd
                else:
                    del m.__dict__["forward"]
            del self._recompute[key]
        for key, m in want.items():
            if key not in self._recompute:
                had = "forward" in m.__dict__
                fwd = m.__dict__.get("forward")
                ours = self._recompute_wrapper(m.forward)
                m.forward = ours
                self._recompute[key] = (m, had, fwd, ours)

    def _recompute_wrapper(self, inner):
        ref = weakref.ref(self)

        def forward(*args, **kwargs):
            c = ref()
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                # Nothing is offloaded inside a CUDA graph capture, and the
                # checkpoint's RNG stash cannot run there (Note [Graph capture]).
                return inner(*args, **kwargs)
            if torch.compiler.is_compiling():
                # A block compiled with its hooks (module.compile()): the
                # checkpoint is traced into the graph and the compiler's
                # partitioner recomputes (Note [Hooks under compile]).
                if c is None or not c._in_step or not torch.is_grad_enabled():
                    return inner(*args, **kwargs)
                return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True,
                                                         **kwargs)
            if c is None or not c._in_step or not torch.is_grad_enabled() or _in_backward():
                return inner(*args, **kwargs)
            first = [True]

            def run(*a, **kw):
                if first[0]:
                    first[0] = False
                elif any(_is_kv_cache(v) for v in kw.values()):
                    # The recompute in backward: a key/value cache the
                    # forward already appended to is not passed again.
                    kw = {k: (None if _is_kv_cache(v) else v) for k, v in kw.items()}
                    if "use_cache" in kw:
                        kw["use_cache"] = False
                return inner(*a, **kw)

            return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True,
                                                     **kwargs)

        forward.__wrapped__ = inner
        return forward

    def _on_cuda(self) -> bool:
        d = self._device
        return self._cuda_ok and d is not None and d.type == "cuda"

    def _link_bandwidth(self):
        """(device-to-host, host-to-device) bytes/s of the training GPU's link,
        measured once per device and process (Note [Profiling on a GPU])."""
        d = self._device
        if d.index not in _LINK_BANDWIDTH:
            free, _ = torch.cuda.mem_get_info(d)
            n = int(min(_LINK_PROBE_BYTES, max(free // 8, 1 << 20)))
            buf = torch.empty(n, dtype=torch.uint8, device=d)
            # The probe's streams are not ordered after the compute stream,
            # which may still use the memory the allocator just handed out.
            torch.cuda.current_stream(d).synchronize()
            _LINK_BANDWIDTH[d.index] = tuple(self._core.measure_link(d.index, buf.data_ptr(), n, 3))
            del buf
        return _LINK_BANDWIDTH[d.index]

    @torch.compiler.disable
    def _on_block_pre(self, module, args):
        if not self._in_step or _in_backward() or not torch.is_grad_enabled():
            return
        with self._lock:
            if self._closed:
                return
            self._flush_kept_locked()
            if self._scope >= 0:
                self._core.scope_end(self._fwd_mb, self._scope)
            self._scope = self._blocks_in_fwd
            self._blocks_in_fwd += 1
            self._scope_modules[self._scope] = module
            if self._adapt is not None:
                self._adapt.mark(self._scope)
                self._adapt.block_begins(self._scope, module, args)
            self._poll_locked()

    def _make_block_post(self, name):
        @torch.compiler.disable
        def hook(module, args, output):
            if not self._in_step or _in_backward():
                return
            if self._adapt is not None and self._adapt.profiling:
                self._adapt.block_ends(self._scope)
            if self._on_cuda() and self._scope >= 0:
                self._release_after_block()
            t = _first_grad_tensor(output)
            if t is None:
                return
            mb, scope = self._fwd_mb, self._scope
            ref = weakref.ref(self)

            def on_grad(grad):
                c = ref()
                if c is not None and not c._closed:
                    c._prefetch_scope(mb, scope)
                return None

            t.register_hook(on_grad)
        return hook


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
    try:
        if model is not None:
            cache.attach(model)
        with cache.step():
            yield cache
        ok = True
    finally:
        if ok:
            cache._close_when_released()
        else:
            cache.close()


def release_pooled_stores() -> int:
    """Drops the idle stores ``offload()`` keeps for its next use (their slab
    files, disk space, threads and host memory); returns how many."""
    return int(_core.release_pooled_stores())
