"""The main job: train a small HF transformer for a few steps under several
ways of handling activations and compare them.

Methods: no offload, ebbtide to SSD files, ebbtide to host memory, full
recompute (torch.utils.checkpoint per block, through HF's gradient
checkpointing), and torch's save_on_cpu; on request also ebbtide's adaptive
default, torchtune's OffloadActivations and torch's compiler offloading. For
each: median step time, peak memory of the step (see ebbtide.memmeter), bytes
ebbtide wrote, and the largest |gradient difference| against no offload (0
means bitwise equal). Models are random-init (nothing is downloaded).

All methods share one model (Note [One model for every method]).
"""
import contextlib
import importlib.util
import statistics
import sys
import tempfile
import time
import types

METHODS = ("none", "ebbtide-ssd", "ebbtide-cpu", "recompute", "save_on_cpu")
# Accepted by --methods but not run by default: ebbtide-auto (the default
# target: the planner offloads per block what it measured to hide, host memory
# first), torchtune (its OffloadActivations; needs torchtune and CUDA),
# compiler-offload (torch's AOTAutograd offloading pass; needs CUDA and
# compiled blocks).
EXTRA_METHODS = ("ebbtide-auto", "torchtune", "compiler-offload")
# Llama-family decoders first (the default: the architecture people train
# today), then the older GPT-2, BERT and T5.
MODELS = ("llama", "qwen2", "mistral", "mixtral", "gpt2", "bert", "t5")
DEFAULT_MODEL = "llama"
ATTENTION = ("eager", "sdpa")
COMPILE = ("none", "block")

# (layers, hidden, heads, seq, batch) per device kind: about a minute for all
# methods on 2 CPU cores; larger on a GPU.
SIZES = {
    "cpu": dict(layers=4, hidden=256, heads=8, seq=512, batch=4),
    "cuda": dict(layers=12, hidden=1024, heads=16, seq=1024, batch=8),
}
VOCAB = 8192
# Methods whose offloaded activations are host-memory copies (on the CPU they
# save no memory; format_table says so).
_HOST_COPY_METHODS = ("ebbtide-cpu", "save_on_cpu")
# Saved tensors smaller than this are left to torch by compiler-offload, as
# ebbtide's cache leaves them by default (min_bytes).
_COMPILER_OFFLOAD_MIN_BYTES = 64 * 1024

# Note [One model for every method]
# Every method runs on the same model object: a model copy per method would
# hold one set of weights, gradients and optimizer state per method on the
# device, and the large shapes of bench/offload_bench.py fit once, not eight
# times. Comparable gradients need the same weights, batch and dropout masks:
# a round runs step i of every method on the same weights (the batch and the
# torch seed derive from i, gradients are set to None before each method),
# then one optimizer step updates the shared weights for the next round. A
# method's activation handling is on only inside its own step: caches are
# attached for the whole run, but their hooks act only inside cache.step();
# recompute turns HF's checkpointing on and off around the step; compiled
# blocks switch to the variant the method needs (_BlockVariants).


def build_model(name, layers, hidden, heads, seq, dtype, device, attn="eager"):
    """A random-init HF model and a function making its training batch.

    Args:
        name: one of MODELS.
        layers, hidden, heads, seq: the transformer's shape (seq = positions).
        dtype, device: where and in which precision the weights live.
        attn: "eager" (HF's own matmul-softmax attention, which saves the
            score matrices) or "sdpa" (torch's fused scaled_dot_product_attention).

    Returns:
        (model, make_batch); make_batch(batch, generator) -> the model's kwargs.

    Raises:
        ValueError: an unknown model or attention.
    """
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    if attn not in ATTENTION:
        raise ValueError(f"--attn {attn!r} is not one of {', '.join(ATTENTION)}")

    # use_cache=False: a training step needs no KV cache (HF would fill one, and
    # its state changes between calls, recompiling compiled blocks).
    common = dict(vocab_size=VOCAB, attn_implementation=attn, use_cache=False)
    # Built on the device: a large model's random init runs there, not on the host.
    with torch.device(device) if device.type == "cuda" else contextlib.nullcontext():
        model = _make_hf_model(tf, name, layers, hidden, heads, seq, common)
    model.to(device=device, dtype=dtype)
    model.train()

    def make_batch(batch, generator):
        ids = torch.randint(1, VOCAB, (batch, seq), generator=generator).to(device)
        if name == "t5":
            labels = torch.randint(1, VOCAB, (batch, max(seq // 4, 8)), generator=generator)
            return dict(input_ids=ids, labels=labels.to(device))
        return dict(input_ids=ids, labels=ids)

    return model, make_batch


def _llama_family_config(tf, name, layers, hidden, heads, seq, common):
    """The config of a Llama-family decoder: RMSNorm, rotary positions, a
    SwiGLU MLP about 8/3 as wide as the model (rounded up to 64, as Llama
    rounds), grouped-query attention with a quarter as many key/value heads
    when the heads divide by 4 (Llama 3's 32:8). qwen2 adds q/k/v biases (its
    config's default), mistral a sliding window of half the sequence, mixtral
    top-2 routing over 4 experts, each with that MLP, and the router's
    load-balancing loss."""
    shape = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                 num_key_value_heads=heads // 4 if heads % 4 == 0 else heads,
                 intermediate_size=-(-8 * hidden // (3 * 64)) * 64, max_position_embeddings=seq,
                 pad_token_id=0, bos_token_id=0, eos_token_id=0, **common)
    if name == "llama":
        return tf.LlamaConfig(**shape), tf.LlamaForCausalLM
    if name == "qwen2":
        return tf.Qwen2Config(**shape), tf.Qwen2ForCausalLM
    if name == "mistral":
        return tf.MistralConfig(sliding_window=max(seq // 2, 1), **shape), tf.MistralForCausalLM
    cfg = tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                           **shape)
    return cfg, tf.MixtralForCausalLM


def _make_hf_model(tf, name, layers, hidden, heads, seq, common):
    if name in ("llama", "qwen2", "mistral", "mixtral"):
        cfg, cls = _llama_family_config(tf, name, layers, hidden, heads, seq, common)
        model = cls(cfg)
    elif name == "gpt2":
        cfg = tf.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq,
                            bos_token_id=0, eos_token_id=0, **common)
        model = tf.GPT2LMHeadModel(cfg)
    elif name == "bert":
        cfg = tf.BertConfig(num_hidden_layers=layers, hidden_size=hidden,
                            num_attention_heads=heads, intermediate_size=4 * hidden,
                            max_position_embeddings=seq, **common)
        model = tf.BertForMaskedLM(cfg)
    elif name == "t5":
        cfg = tf.T5Config(num_layers=layers, num_decoder_layers=layers, d_model=hidden,
                          num_heads=heads, d_kv=hidden // heads, d_ff=4 * hidden,
                          decoder_start_token_id=0, pad_token_id=0, **common)
        model = tf.T5ForConditionalGeneration(cfg)
    else:
        raise ValueError(f"--model {name!r} is not one of {', '.join(MODELS)}")
    return model


_block_variants_cls = None


def _block_variants(block):
    """Wraps block in a _BlockVariants (the class is made on first use, so
    that importing this module does not import torch)."""
    global _block_variants_cls
    if _block_variants_cls is None:
        import torch

        class _BlockVariants(torch.nn.Module):
            """One transformer block and callables running it: "eager" (the
            block itself) plus compiled versions; `active` picks the one
            forward calls.

            The block stays a registered submodule (its parameters, its hooks
            and HF's checkpointing flag are its own); hooks on this wrapper
            run outside the compiled code, where ebbtide's module hooks must
            run.
            """

            def __init__(self, block):
                super().__init__()
                self.block = block
                self.variants = {"eager": block}  # a plain dict: compiled wrappers are not submodules
                self.active = "eager"

            def forward(self, *args, **kwargs):
                return self.variants[self.active](*args, **kwargs)

            def __getattr__(self, name):
                try:
                    return super().__getattr__(name)
                except AttributeError:
                    return getattr(super().__getattr__("block"), name)

        _block_variants_cls = _BlockVariants
    return _block_variants_cls(block)


def _block_lists(model):
    """The ModuleLists of repeated blocks (GPT-2's h, BERT's layer, T5's encoder
    and decoder blocks), outermost first."""
    import torch

    found, taken = [], []
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p in taken):
            continue
        if isinstance(m, torch.nn.ModuleList) and len(m) > 1:
            taken.append(name)
            found.append(m)
    return found


def _mark_offloadable(gm, joint_inputs):
    """joint_custom_pass for torch's compiler offloading: asks it to offload
    every node of at least _COMPILER_OFFLOAD_MIN_BYTES; its partitioner then
    keeps only saved, contiguous, non-view forward outputs."""
    import torch

    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.numel() * val.element_size() >= _COMPILER_OFFLOAD_MIN_BYTES:
            node.meta["should_offload"] = True
    return gm


def compiler_offload_options():
    """torch._functorch.config settings compiler-offload applies, as far as the
    installed torch has them: {name: value}; empty when it has no offloading."""
    import torch._functorch.config as fc

    if not hasattr(fc, "enable_activation_offloading") or not hasattr(fc, "joint_custom_pass"):
        return {}
    opts = dict(enable_activation_offloading=True, joint_custom_pass=_mark_offloadable)
    for name in ("activation_offload_separate_stream", "activation_offload_sink_wait",
                 "activation_reload_prefetch"):
        if hasattr(fc, name):
            opts[name] = True
    return opts


def _compiler_offload_backend(gm, example_inputs):
    # A backend of its own: dynamo keys its cache by backend, so the offloading
    # graphs never stand in for the plain compiled ones (or the reverse).
    import torch._functorch.config as fc
    from torch._inductor.compile_fx import compile_fx

    with fc.patch(**compiler_offload_options()):
        return compile_fx(gm, example_inputs)


def compile_blocks(model, compile="block", offload_variant=False):
    """Wraps every repeated block in _BlockVariants and compiles it per block
    (as torchtitan does: a whole-model graph would hand its saved tensors to
    saved-tensor hooks only when the whole forward has ended).

    Args:
        model: a model from build_model.
        compile: "none" (wrappers running the eager blocks) or "block".
        offload_variant: also compile an "offload" variant with torch's
            compiler offloading (compiler_offload_options()).

    Returns:
        The default variant's name: "eager" or "compiled".
    """
    import torch

    if compile not in COMPILE:
        raise ValueError(f"--compile {compile!r} is not one of {', '.join(COMPILE)}")
    if compile == "none":
        return "eager"
    # Every block shares one compiled graph per variant; HF's checkpointing flag
    # (recompute) adds guards. Room for all of them:
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    for blocks in _block_lists(model):
        for i in range(len(blocks)):
            w = _block_variants(blocks[i])
            w.variants["compiled"] = torch.compile(w.block)
            if offload_variant:
                w.variants["offload"] = torch.compile(w.block, backend=_compiler_offload_backend)
            w.active = "compiled"
            blocks[i] = w
    # HF's checkpointing flag is a class attribute until recompute sets it on
    # the instance; set it there now, so that the guards see two states (on,
    # off), both compiled in the first round, not a third one later.
    for m in model.modules():
        if hasattr(type(m), "gradient_checkpointing"):
            m.gradient_checkpointing = bool(m.gradient_checkpointing)
    return "compiled"


def _set_variant(model, name):
    for m in model.modules():
        if _block_variants_cls is not None and isinstance(m, _block_variants_cls):
            m.active = name


def load_torchtune_offload():
    """torchtune's OffloadActivations class.

    Returns:
        (class, how): how says where it came from.

    Raises:
        ImportError: torchtune is not installed, or its module does not load.

    torchtune's package __init__ imports its datasets, models and torchao
    (`import torchtune` needs HF datasets, torchdata, omegaconf, ...), none of
    which OffloadActivations uses. When that import fails, the class is loaded
    from torchtune/training/_activation_offloading.py itself, unchanged, with
    the two small torchtune modules it imports; without torchao, the NF4Tensor
    it names (only in an error path, for quantized weights) is a stand-in.
    """
    try:
        from torchtune.training import OffloadActivations

        return OffloadActivations, "torchtune.training"
    except ImportError as e:
        package_error = e
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"torchtune is not installed ({package_error})")
    root = list(spec.submodule_search_locations)[0]

    def load(name, relpath):
        s = importlib.util.spec_from_file_location(name, f"{root}/{relpath}")
        m = importlib.util.module_from_spec(s)
        s.loader.exec_module(m)
        return m

    names = ("torchtune", "torchtune.modules", "torchtune.utils", "torchao", "torchao.dtypes",
             "torchao.dtypes.nf4tensor")
    saved = {n: sys.modules.get(n) for n in names}
    try:
        tt = types.ModuleType("torchtune")
        tt.__path__ = [root]
        sys.modules["torchtune"] = tt
        mods = types.ModuleType("torchtune.modules")
        mods.TiedLinear = load("_ebbtide_tt_tied_linear", "modules/tied_linear.py").TiedLinear
        sys.modules["torchtune.modules"] = mods
        utils = types.ModuleType("torchtune.utils")
        utils.get_logger = load("_ebbtide_tt_logging", "utils/_logging.py").get_logger
        sys.modules["torchtune.utils"] = utils
        try:
            import torchao.dtypes.nf4tensor  # noqa: F401
            how_ao = "torchao"
        except ImportError:
            ao = types.ModuleType("torchao")
            ao.__version__ = "0"
            nf4 = types.ModuleType("torchao.dtypes.nf4tensor")
            nf4.NF4Tensor = type("NF4Tensor", (), {})
            ao.dtypes = types.ModuleType("torchao.dtypes")
            ao.dtypes.nf4tensor = nf4
            sys.modules.update({"torchao": ao, "torchao.dtypes": ao.dtypes, "torchao.dtypes.nf4tensor": nf4})
            how_ao = "no torchao"
        mod = load("_ebbtide_tt_activation_offloading", "training/_activation_offloading.py")
    except Exception as e:  # a torchtune whose file layout differs
        raise ImportError(f"torchtune: package import failed ({package_error}); loading "
                          f"training/_activation_offloading.py failed too ({type(e).__name__}: {e})") from e
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    first = str(package_error).strip().splitlines()[0] if str(package_error).strip() else type(package_error).__name__
    return mod.OffloadActivations, (f"torchtune/training/_activation_offloading.py by file ({how_ao}; "
                                    f"package import failed: {first})")


def _method_context(method, model, device, workdir, default_variant="eager"):
    """Returns (enter_step() -> context manager, cache or None, cleanup()).

    enter_step() switches the method's activation handling on for one step.
    Raises RuntimeError (with the reason) for a method this environment cannot
    run, ValueError for an unknown one.
    """
    import torch

    if method == "none":
        return contextlib.nullcontext, None, lambda: None
    if method in ("ebbtide-ssd", "ebbtide-cpu", "ebbtide-auto"):
        from ebbtide.cache import TensorCache

        target = method.split("-", 1)[1]
        cache = TensorCache(target=target, path=workdir if target != "cpu" else None)
        cache.attach(model)

        def cleanup():
            cache.detach()
            cache.close()

        return cache.step, cache, cleanup
    if method == "recompute":
        # HF renamed gradient_checkpointing_* to activation_checkpointing_* in v5.
        kwargs = {"use_reentrant": False}

        @contextlib.contextmanager
        def recompute():
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
                disable = model.activation_checkpointing_disable
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
                disable = model.gradient_checkpointing_disable
            try:
                yield
            finally:
                disable()

        return recompute, None, lambda: None
    if method == "save_on_cpu":
        pin = device.type == "cuda"
        return (lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)), None, lambda: None
    if method == "torchtune":
        if device.type != "cuda":
            raise RuntimeError("needs CUDA (OffloadActivations copies on CUDA streams)")
        try:
            cls, how = load_torchtune_offload()
        except ImportError as e:
            raise RuntimeError(f"torchtune not importable: {e}") from e
        ctx = cls(use_pin_memory=True)  # torchtune's defaults: streams on, stash of 5

        def enter():
            return ctx

        enter.origin = how
        return enter, None, lambda: None
    if method == "compiler-offload":
        if device.type != "cuda":
            raise RuntimeError("needs CUDA (torch's ao::offload ops copy device tensors to host memory)")
        if not compiler_offload_options():
            raise RuntimeError(f"torch {torch.__version__} has no torch._functorch.config."
                               "enable_activation_offloading")
        if default_variant != "compiled":
            raise RuntimeError("needs --compile block (it is a pass of torch.compile)")

        @contextlib.contextmanager
        def offload():
            import torch._functorch.config as fc

            _set_variant(model, "offload")
            try:
                with fc.patch(**compiler_offload_options()):
                    yield
            finally:
                _set_variant(model, default_variant)

        return offload, None, lambda: None
    raise ValueError(f"method {method!r} is not one of {', '.join(METHODS + EXTRA_METHODS)}")


class _GradCompare:
    """Compares every method's gradients with no offload's, round by round,
    without keeping more than one copy: the first method of a round leaves its
    gradients (on the host) as the round's reference R, every method is
    measured against R on the device, and max|g - g_none| follows exactly
    when R is no offload's or no offload matches R bitwise (else it is bounded
    by d(g, R) + d(g_none, R) and flagged inexact)."""

    _CHUNK = 1 << 26  # elements compared at once: bounds the temporaries on the device

    def __init__(self, params, device):
        self.params = list(params)
        self.device = device
        self.ref = None
        self.ref_method = None
        self.rounds = []  # per round: {method: d(g, R)}

    def begin_round(self):
        self.ref_method = None
        self.rounds.append({})

    def observe(self, method):
        import torch

        grads = [p.grad for p in self.params]
        if self.ref_method is None:
            pin = self.device.type == "cuda"
            if self.ref is None:
                self.ref = [None if g is None else torch.empty(g.shape, dtype=g.dtype, pin_memory=pin)
                            for g in grads]
            for r, g in zip(self.ref, grads):
                if (r is None) != (g is None):
                    raise RuntimeError("gradients of the first method of a round differ in "
                                       "which parameters have one")
                if g is not None:
                    r.copy_(g, non_blocking=pin)
            if pin:
                torch.cuda.synchronize(self.device)
            self.ref_method = method
            self.rounds[-1][method] = 0.0
            return
        worst = torch.zeros((), dtype=torch.float32, device=self.device)
        for r, g in zip(self.ref, grads):
            if (r is None) != (g is None):
                self.rounds[-1][method] = float("inf")
                return
            if g is None:
                continue
            gf, rf = g.reshape(-1), r.reshape(-1)
            for s in range(0, gf.numel(), self._CHUNK):
                a = gf[s:s + self._CHUNK]
                b = rf[s:s + self._CHUNK].to(self.device, non_blocking=True)
                worst = torch.maximum(worst, (a.float() - b.float()).abs().max())
        self.rounds[-1][method] = worst.item()

    def result(self, method, reference="none"):
        """(max |g_method - g_reference| over all rounds, exact?)."""
        worst, exact = 0.0, True
        for rnd in self.rounds:
            if method not in rnd or reference not in rnd:
                continue
            d_m, d_ref = rnd[method], rnd[reference]
            if d_ref == 0.0 or method == reference:
                d = d_m if method != reference else 0.0
            else:
                d = d_m + d_ref
                exact = False
            worst = max(worst, d) if d == d else float("nan")
        return worst, exact


class _Runner:
    """One method's activation handling on the shared model; step(i) runs
    training step i (same batch and dropout seed for every method)."""

    def __init__(self, method, model, make_batch, device, batch, workdir, default_variant):
        self.method, self.model, self.make_batch = method, model, make_batch
        self.device, self.batch = device, batch
        self.enter, self.cache, self._cleanup = _method_context(method, model, device, workdir,
                                                                default_variant)
        self.origin = getattr(self.enter, "origin", None)
        self.times, self.fwd_times, self.peaks = [], [], []
        self.step_stats = []  # the cache's stats() after each timed step
        self.ssd_written = 0  # bytes the last step wrote to SSD files
        self.closed = False

    def _ssd_bytes_written(self):
        if self.cache is None:
            return 0
        return sum(t["bytes_written"] for t in self.cache.stats()["tiers"] if t["tier"] == "ssd")

    def step(self, i, measured):
        import torch

        from ebbtide.memmeter import PeakMeter

        cuda = self.device.type == "cuda"
        gen = torch.Generator().manual_seed(1000 + i)
        inputs = self.make_batch(self.batch, gen)
        torch.manual_seed(i)  # dropout masks identical across methods
        self.model.zero_grad(set_to_none=True)
        written0 = self._ssd_bytes_written()
        if cuda:
            torch.cuda.synchronize(self.device)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        t0 = time.perf_counter()
        with PeakMeter(self.device, caches=[self.cache] if self.cache is not None else ()) as meter:
            with self.enter():
                if cuda:
                    ev[0].record()
                tf0 = time.perf_counter()
                loss = self.model(**inputs).loss
                tf1 = time.perf_counter()
                if cuda:
                    ev[1].record()
                meter.sample()
                loss.backward()
            if cuda:
                torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        fwd = ev[0].elapsed_time(ev[1]) / 1e3 if cuda else tf1 - tf0
        self.ssd_written = self._ssd_bytes_written() - written0
        if measured:
            self.times.append(dt)
            self.fwd_times.append(fwd)
            self.peaks.append(meter.peak_bytes)
            if self.cache is not None:
                self.step_stats.append(self.cache.stats())

    def close(self):
        if self.closed:
            return
        self.closed = True
        self._cleanup()

    def row(self):
        stats = self.step_stats[-1] if self.step_stats else {}
        return dict(method=self.method, status="ok", step_seconds=statistics.median(self.times),
                    forward_seconds=statistics.median(self.fwd_times), peak_bytes=max(self.peaks),
                    stats=stats, ssd_bytes_written=self.ssd_written,
                    forward_seconds_per_step=list(self.fwd_times),
                    bytes_offloaded_per_step=[s["bytes_offloaded"] for s in self.step_stats] or None,
                    **({"origin": self.origin} if self.origin else {}))


def _error_text(e):
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return text if len(text) <= 200 else text[:197] + "..."


def run_methods(methods, model, make_batch, device, steps, warmup, batch, workdir, log=print,
                optimizer="adamw", default_variant="eager", progress=None):
    """Runs the methods' steps interleaved on one model (Note [One model for
    every method]): round i runs step i of every method, the order rotating
    each round, so drifting machine load and warm-up costs hit every method
    alike; then one optimizer step (optimizer "adamw" or "none").

    `progress` (an ebbtide._progress.Progress) is advanced once per round and
    names the step and method running; with it, the per-round log lines are
    left to the bar.

    Returns {method: row}; a row has status "ok" and the measurements, or
    "skipped: <reason>" for a method that cannot run here or failed (no
    offload failing is an error: it is the reference).
    """
    import torch

    if "none" not in methods:
        raise ValueError("the methods must include none (the reference)")
    runners, skipped = {}, {}
    opt = None
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif optimizer != "none":
        raise ValueError(f"--optimizer {optimizer!r} is not one of adamw, none")
    grads = _GradCompare(model.parameters(), device)
    try:
        for m in methods:
            try:
                runners[m] = _Runner(m, model, make_batch, device, batch, workdir, default_variant)
            except RuntimeError as e:
                if m == "none":
                    raise
                skipped[m] = f"skipped: {e}"
                log(f"[demo] {m}: {skipped[m]}")
        order = [m for m in methods if m in runners]
        for i in range(warmup + steps):
            what = f"step {i + 1}/{warmup + steps}{' (warm-up)' if i < warmup else ''}"
            if progress is None:
                log(f"[demo] {what}: {', '.join(order)}")
            grads.begin_round()
            for m in list(order):
                if progress is not None:
                    progress.describe(f"{what}: {m}")
                try:
                    runners[m].step(i, measured=i >= warmup)
                    grads.observe(m)
                except Exception as e:  # noqa: BLE001 - one method's failure is its row, not the run's end
                    if m == "none" or isinstance(e, KeyboardInterrupt):
                        raise
                    skipped[m] = f"skipped: failed in step {i + 1}: {_error_text(e)}"
                    log(f"[demo] {m}: {skipped[m]}")
                    order.remove(m)
                    model.zero_grad(set_to_none=True)
                    runners.pop(m).close()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                        torch.cuda.empty_cache()
            if opt is not None:
                opt.step()
            model.zero_grad(set_to_none=True)
            order = order[1:] + order[:1]
            if progress is not None:
                progress.update()
        rows = {}
        for m in methods:
            if m in skipped:
                rows[m] = dict(method=m, status=skipped[m])
                continue
            r = runners[m]
            rows[m] = r.row()
            r.close()
            rows[m]["max_grad_diff"], rows[m]["max_grad_diff_exact"] = grads.result(m)
        return rows
    finally:
        for r in runners.values():
            r.close()


def max_grad_diff(grads, ref):
    worst = 0.0
    for step_g, step_r in zip(grads, ref):
        for g, r in zip(step_g, step_r):
            if (g is None) != (r is None):
                return float("inf")
            if g is not None:
                worst = max(worst, (g.float() - r.float()).abs().max().item())
    return worst


def resolve_size(device, **overrides):
    """SIZES for the device kind with the given (non-None) overrides, checked."""
    size = dict(SIZES["cuda" if device.type == "cuda" else "cpu"])
    for k, v in overrides.items():
        if v is not None:
            if v <= 0:
                raise ValueError(f"--{k} must be positive, got {v}")
            size[k] = v
    if size["hidden"] % size["heads"]:
        raise ValueError(f"--hidden {size['hidden']} is not divisible by --heads {size['heads']}")
    return size


def run_demo(model=DEFAULT_MODEL, methods=METHODS, steps=5, warmup=1, seq=None, batch=None,
             layers=None, hidden=None, heads=None, device=None, dtype="fp32", path=None,
             log=print, attn="eager", compile="none", optimizer="adamw", before_methods=None,
             progress=None):
    """Runs every method on one model; returns a dict with the config and one
    row per method (skipped methods have only method and status).

    Args:
        attn: "eager" or "sdpa" (build_model).
        compile: "none" or "block" (compile_blocks).
        optimizer: "adamw" (one step per round) or "none".
        before_methods: optional f(model, make_batch, device, size) called once
            the model is built, before any method runs; the dict it returns is
            merged into the result (bench/offload_bench.py measures there).
        progress: an ebbtide._progress.Progress advanced once per round
            (run_methods).
    """
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available to torch")
    size = resolve_size(dev, layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch)
    if steps <= 0:
        raise ValueError(f"--steps must be positive, got {steps}")
    valid = METHODS + EXTRA_METHODS
    bad = [m for m in methods if m not in valid]
    if bad:
        raise ValueError(f"--methods: {', '.join(bad)} not valid (valid: {', '.join(valid)})")
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    torch.manual_seed(0)
    net, make_batch = build_model(model, size["layers"], size["hidden"], size["heads"],
                                  size["seq"], torch_dtype, dev, attn=attn)
    variant = compile_blocks(net, compile, offload_variant="compiler-offload" in methods
                             and dev.type == "cuda" and bool(compiler_offload_options()))
    methods = ("none",) + tuple(m for m in methods if m != "none")  # the reference comes first
    extra = before_methods(net, make_batch, dev, size) if before_methods else {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="ebbtide-demo-", dir=path) as workdir:
        results = run_methods(methods, net, make_batch, dev, steps, warmup, size["batch"], workdir, log,
                              optimizer=optimizer, default_variant=variant, progress=progress)
        for method in methods:
            row = results[method]
            if row["status"] == "ok":
                row["bytes_written"] = row.pop("ssd_bytes_written")
                row["tokens_per_second"] = size["batch"] * size["seq"] / row["step_seconds"]
            rows.append(row)
    base_row = rows[0]
    for row in rows:
        if row["status"] != "ok":
            continue
        row["step_time_ratio"] = row["step_seconds"] / base_row["step_seconds"]
        row["peak_ratio"] = row["peak_bytes"] / base_row["peak_bytes"] if base_row["peak_bytes"] else None
    del net
    return dict(model=model, device=str(dev), dtype=dtype, steps=steps, warmup=warmup, attn=attn,
                compile=compile, optimizer=optimizer, **size, **extra, rows=rows)


def format_table(result):
    from ebbtide import _core

    fb = _core.format_bytes
    w = max([13] + [len(r["method"]) + 1 for r in result["rows"]])
    lines = [f"ebbtide demo: {result['model']} layers={result['layers']} hidden={result['hidden']} "
             f"heads={result['heads']} seq={result['seq']} batch={result['batch']} "
             f"{result['dtype']} attn={result.get('attn', 'eager')} compile={result.get('compile', 'none')} "
             f"on {result['device']}, {result['steps']} steps (+{result['warmup']} warm-up)",
             f"{'method':<{w}}{'step s':>9}{'ratio':>7}{'peak mem':>12}{'ratio':>7}"
             f"{'written':>12}{'max|dgrad|':>12}"]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['method']:<{w}}{r['status']}")
            continue
        peak_ratio = f"{r['peak_ratio']:.2f}" if r["peak_ratio"] is not None else "-"
        lines.append(f"{r['method']:<{w}}{r['step_seconds']:>9.3f}{r['step_time_ratio']:>7.2f}"
                     f"{fb(r['peak_bytes']):>12}{peak_ratio:>7}{fb(r['bytes_written']):>12}"
                     f"{r['max_grad_diff']:>12.3g}{'' if r.get('max_grad_diff_exact', True) else ' (bound)'}")
    for r in result["rows"]:
        s = r.get("stats")
        if s:
            lines.append(f"  {r['method']}: offloaded {s.get('tensors_offloaded', 0)} tensors "
                         f"({fb(s.get('bytes_offloaded', 0))}), kept {s.get('tensors_kept', 0)}, "
                         f"forwarded {s.get('tensors_forwarded', 0)}"
                         + (f" ({fb(s['bytes_discarded'])} written in vain)" if s.get('bytes_discarded') else "")
                         + ", peak resident "
                         f"{fb(s.get('peak_resident_bytes', 0))} of "
                         f"{fb(s.get('saved_bytes_total', 0))} saved, "
                         f"stall {s.get('stall_seconds', 0):.3f} s (last step)")
        if r.get("origin"):
            lines.append(f"  {r['method']}: OffloadActivations from {r['origin']}")
    lines.append("peak mem: the step's peak above its start (CUDA allocator on GPU; on CPU the process "
                 "heap plus ebbtide's host-tier copies): activations, temporaries and gradients.")
    copies = [r["method"] for r in result["rows"] if r["method"] in _HOST_COPY_METHODS]
    if not result["device"].startswith("cuda") and copies:
        lines.append(f"on CPU, {' and '.join(copies)} copy activations to host memory, where they "
                     "already live: they cannot lower it.")
    return "\n".join(lines)


def plot(result, png_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for r in result["rows"]:
        if r["status"] != "ok":
            continue
        x = r["peak_bytes"] / 2**20
        y = r["tokens_per_second"]
        ax.scatter([x], [y], s=40)
        ax.annotate(r["method"], (x, y), textcoords="offset points", xytext=(5, 5), fontsize=9)
    ax.set_xlabel("peak step memory (MiB)")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title(f"ebbtide demo: {result['model']} seq={result['seq']} batch={result['batch']} "
                 f"on {result['device']}")
    ax.grid(True, alpha=0.3)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
