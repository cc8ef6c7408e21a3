"""The harness's methods: each way of handling activations that ``ebbtide
demo`` and bench/offload_bench.py compare, as a context for one training step
(``_method_context``): ebbtide's cache per target, full recompute, torch's
save_on_cpu, torchtune's OffloadActivations (loaded by file) and torch's
compiler offloading with compiled blocks (_BlockVariants). All share one model
(Note [One model for every method] in demo.py).
"""
import contextlib
import importlib.util
import sys
import types

from ebbtide.harness.models import enable_hf_recompute

METHODS = ("none", "ebbtide-ssd", "ebbtide-cpu", "recompute", "save_on_cpu")
# Accepted by --methods but not run by default: ebbtide-auto (the default
# target: the planner offloads per block what it measured to hide, host memory
# first), torchtune (its OffloadActivations; needs torchtune and CUDA),
# compiler-offload (torch's AOTAutograd offloading pass; needs CUDA and
# compiled blocks).
EXTRA_METHODS = ("ebbtide-auto", "torchtune", "compiler-offload")
COMPILE = ("none", "block")
# Methods whose offloaded activations are host-memory copies (on the CPU they
# save no memory; format_table says so).
_HOST_COPY_METHODS = ("ebbtide-cpu", "save_on_cpu")
# Saved tensors smaller than this are left to torch by compiler-offload, as
# ebbtide's cache leaves them by default (min_bytes).
_COMPILER_OFFLOAD_MIN_BYTES = 64 * 1024


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


def compile_blocks(model, compile="block", offload_variant=False, backend=None):
    """Wraps every repeated block in _BlockVariants and compiles it per block
    (as torchtitan does: a whole-model graph would hand its saved tensors to
    saved-tensor hooks only when the whole forward has ended).

    Args:
        model: a model from build_model.
        compile: "none" (wrappers running the eager blocks) or "block".
        offload_variant: also compile an "offload" variant with torch's
            compiler offloading (compiler_offload_options()).
        backend: torch.compile's backend for the "compiled" variant (default:
            inductor's; the budget stage passes one per activation_memory_budget).

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
            w.variants["compiled"] = torch.compile(w.block) if backend is None else torch.compile(w.block,
                                                                                                 backend=backend)
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
        @contextlib.contextmanager
        def recompute():
            disable = enable_hf_recompute(model)
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
