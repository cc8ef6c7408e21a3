"""The torch side of a TensorCache step: what runs inside training.

``_StepHooks`` is the part of ``TensorCache`` (tensor_cache.py) that autograd
and the model call into while a step runs: the Python pack path (the C++ hooks,
python/src/torch/hooks.cpp, take the common cases), module hooks around each
scoped block and the root module (scopes, Note [Release points], prefetch),
recompute by the cache (Note [Recompute by the cache]), closing when the last
entry goes (Note [Lifetime after the block]), aborted steps (Note [Exceptions
in a step]) and the statistics. tensor_cache.py holds construction, the public
methods and ``offload()``.
"""
from __future__ import annotations

import os
import shutil
import warnings
import weakref

import torch
import torch.utils.checkpoint
from torch.multiprocessing.reductions import StorageWeakRef

from ebbtide import _core
from ebbtide.cache.adaptive import _CUDA_PREFETCH_MODULES

_StateError = _core.StateError

_ALL_SCOPES = (1 << 63) - 1
_LINK_PROBE_BYTES = 256 << 20
_LINK_BANDWIDTH: dict = {}  # CUDA device index -> (d2h, h2d) bytes/s
_warned_no_cuda_shim = False


def _warn_no_cuda_shim():
    global _warned_no_cuda_shim
    if not _warned_no_cuda_shim:
        _warned_no_cuda_shim = True
        warnings.warn("ebbtide: CUDA tensors stay on the GPU (nothing is offloaded): the CUDA driver shim is "
                      f"unavailable ({_core.cuda_unavailable_reason() or 'disabled for this cache'})",
                      RuntimeWarning, stacklevel=4)


def _add_kept(d, counts):
    """Adds the hooks' counts of kept tensors (Note [Kept tensors]) to a stats dict of the core."""
    saved, kept, deduped, nbytes, peak = counts
    d["tensors_saved"] += saved
    d["tensors_kept"] += kept
    d["tensors_deduped"] += deduped
    d["saved_bytes_total"] += nbytes
    # The core's peak counts the kept bytes with its entries' (Note [Joint
    # resident peak] in cpp/src/cache/tensor_cache_load.cpp).
    d["peak_resident_bytes"] = max(d["peak_resident_bytes"], peak)


_STRIDED = torch.strided
_no_context = torch.utils.checkpoint.noop_context_fn
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


class _StepHooks:
    """The hook machinery of TensorCache (a mixin: TensorCache is its only user)."""

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
        self._check_process()

    def _check_process(self):
        if not self._origin.here():
            # Note [Objects across fork] (cpp/include/ebbtide/mem/fork_origin.hpp):
            # the store's threads and the step's state are the parent's.
            raise RuntimeError(f"ebbtide.TensorCache: this cache was made by process {self._origin.pid}; a forked "
                               f"child (process {os.getpid()}) can neither use nor close it (make one there)")

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
        # The scope's byte limit (Note [Scope byte limits]) is the C++ hooks':
        # this path takes no planned GPU step (the first tensor of a cache
        # whose device is unknown comes in its profiling step; CUDA tensors
        # without the driver shim stay resident).
        decision, tier, _limit, lead = self._scope_placement()
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
                                                          self._fwd_mb, True, tier, t, native.storage_ref(t),
                                                          lead_bytes=lead)
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
        """("keep" | "offload", store tier hint, byte limit or -1, reload lead
        in bytes or 0) for the current scope: keep_last_modules, then the
        plan (Note [Scope byte limits] in python/src/torch/hooks.cpp, Note
        [Reload lead] in cpp/src/plan/step_model.cpp)."""
        if self._keeping_scope():
            return "keep", -1, -1, 0
        if self._adapt is not None:
            scope = self._scope
            offload, tier = self._adapt.placement(scope)
            return (("offload" if offload else "keep"), tier, self._adapt.offload_limit(scope),
                    self._adapt.lead(scope))
        return "offload", -1, -1, 0

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

    def _stream_device(self):
        d = self._device
        return d.index if d is not None and d.type == "cuda" else -1

    def _prefetch_scope(self, mb, scope):
        with self._lock:
            if self._closed:
                return
            if self._on_cuda() and torch.cuda.is_current_stream_capturing():
                return  # Note [Graph capture] (tensor_cache_device.cpp): nothing to release or load inside one
            if self._on_cuda():
                # Note [Release points]: backward of the micro-batch begins.
                self._core.release_copies(mb, _ALL_SCOPES, self._stream(), device=self._stream_device())
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
        budgets = self._adapt.budgets if self._adapt is not None else None
        out["activation_budget_bytes"] = budgets.activation if budgets is not None else 0
        out["memory_budget_bytes"] = budgets.memory if budgets is not None else 0
        out["recomputed_blocks"] = sorted(self._scope_name(s) for s in self._adapt.recompute_scopes) \
            if self._adapt is not None else []
        if self._adapt is not None:
            out.update(self._adapt.stats())
        else:
            out.update(planner=None, predicted_stall_seconds=None, predicted_peak_bytes=None,
                       peak_allocated_bytes=None, predicted_peak_allocated_bytes=None,
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
                # A plan's leads bound the loads, its window the bytes ahead
                # (Note [Reload lead]); else a window of blocks (Note [Prefetch window]).
                planned = self._adapt.window_bytes() if self._adapt is not None else None
                biggest = max((p["bytes_offloaded"] for p in self._plan.values()), default=0)
                if planned:
                    self._core.set_prefetch_window(max(planned, biggest, 64 << 10))
                elif biggest:
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
            through, max_bytes = self._adapt.release_point(scope) if self._adapt is not None else (scope - 1, -1)
            if through >= 0 and max_bytes != 0:
                self._core.release_copies(self._fwd_mb, through, self._stream(), max_bytes, self._stream_device())
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
    #
    # Note [Framework blocks]
    # An integration that knows its framework sets three attributes of the
    # cache (ebbtide/integrations/megatron.py sets all three):
    # _checkpoint_context_fn, torch checkpoint's context_fn for the cache's
    # recompute (a framework's own RNG states, which preserve_rng_state does
    # not cover, stashed in forward and restored for the recompute);
    # _scope_without_grad, so a block whose forward runs without grad (inside
    # a reentrant checkpoint: Megatron's full recompute) still opens its
    # scope, and what the checkpoint saves as the block returns counts there;
    # and _recompute_blocks False, so the plan never recomputes a block
    # (another saved-tensor hook inside the blocks would take the
    # checkpoint's saves). A block running without grad is never recomputed
    # by the cache. detach() sets all three back.
    def _may_recompute(self, module) -> bool:
        if not self._recompute_blocks or not torch.is_grad_enabled():
            return False  # Note [Framework blocks]
        if self._stages is not None and any(module is s for s in self._stages):
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
                # Dynamo traces the default context_fn only; an integration's
                # (Note [Framework blocks]) is passed on and refused there.
                extra = {} if c._checkpoint_context_fn is None else {"context_fn": c._checkpoint_context_fn}
                return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True,
                                                         **extra, **kwargs)
            if c is None or not c._in_step or not torch.is_grad_enabled() or _in_backward():
                return inner(*args, **kwargs)
            first = [True]
            scope = c._scope  # the block's pre-hook has just set it (a module may run at several scopes)

            def run(*a, **kw):
                if first[0]:
                    first[0] = False
                    return inner(*a, **kw)
                if any(_is_kv_cache(v) for v in kw.values()):
                    # The recompute in backward: a key/value cache the
                    # forward already appended to is not passed again.
                    kw = {k: (None if _is_kv_cache(v) else v) for k, v in kw.items()}
                    if "use_cache" in kw:
                        kw["use_cache"] = False
                adapt = c._adapt if c is not None else None
                if adapt is None or not adapt.retiming:
                    return inner(*a, **kw)
                start = adapt._now()  # Note [Re-timed profile]: the recompute as the plan runs it
                try:
                    return inner(*a, **kw)
                finally:  # torch's checkpoint ends a recompute early by raising once it has what backward needs
                    adapt.recomputed(scope, start)

            return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True,
                                                     context_fn=c._checkpoint_context_fn or _no_context, **kwargs)

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
        if not self._in_step or _in_backward() or not (torch.is_grad_enabled() or self._scope_without_grad):
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
                    if c._adapt is not None:
                        c._adapt.mark_backward(scope)  # Note [Backward profile]
                    c._prefetch_scope(mb, scope)
                return None

            t.register_hook(on_grad)
        return hook
