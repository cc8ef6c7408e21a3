"""The main job: train a small HF transformer for a few steps under several
ways of handling activations and compare them.

Methods: no offload, ebbtide to SSD files, ebbtide to host memory, full
recompute (torch.utils.checkpoint per block, through HF's gradient
checkpointing), and torch's save_on_cpu. For each: median step time, peak
memory of the step (see ebbtide.memmeter), bytes ebbtide wrote, and the
largest |gradient difference| against no offload (0 means bitwise equal).
Models are random-init (nothing is downloaded).
"""
import contextlib
import copy
import statistics
import tempfile
import time

METHODS = ("none", "ebbtide-ssd", "ebbtide-cpu", "recompute", "save_on_cpu")
# Accepted by --methods but not run by default: ebbtide-auto (the default
# target: the planner offloads per block what it measured to hide, host memory
# first), torchtune (needs torchtune installed).
EXTRA_METHODS = ("ebbtide-auto", "torchtune")
MODELS = ("gpt2", "bert", "t5")

# (layers, hidden, heads, seq, batch) per device kind: about a minute for all
# methods on 2 CPU cores; larger on a GPU.
SIZES = {
    "cpu": dict(layers=4, hidden=256, heads=8, seq=512, batch=4),
    "cuda": dict(layers=12, hidden=1024, heads=16, seq=1024, batch=8),
}
VOCAB = 8192


def build_model(name, layers, hidden, heads, seq, dtype, device):
    """A random-init HF model and a function making its training batch."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()

    common = dict(vocab_size=VOCAB, attn_implementation="eager")
    if name == "gpt2":
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
    model.to(device=device, dtype=dtype)
    model.train()

    def make_batch(batch, generator):
        ids = torch.randint(1, VOCAB, (batch, seq), generator=generator).to(device)
        if name == "t5":
            labels = torch.randint(1, VOCAB, (batch, max(seq // 4, 8)), generator=generator)
            return dict(input_ids=ids, labels=labels.to(device))
        return dict(input_ids=ids, labels=ids)

    return model, make_batch


def _method_context(method, model, device, workdir):
    """Returns (enter_step() -> context manager, cache or None, cleanup())."""
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
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            disable = model.activation_checkpointing_disable
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            disable = model.gradient_checkpointing_disable
        return contextlib.nullcontext, None, disable
    if method == "save_on_cpu":
        pin = device.type == "cuda"
        return (lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)), None, lambda: None
    if method == "torchtune":
        try:
            from torchtune.training import OffloadActivations
        except ImportError as e:
            raise RuntimeError(f"method torchtune: torchtune is not importable ({e})") from e
        return (lambda: OffloadActivations(use_pin_memory=device.type == "cuda")), None, \
            lambda: None
    raise ValueError(f"method {method!r} is not one of {', '.join(METHODS + EXTRA_METHODS)}")


class _Runner:
    """One method's model copy, optimizer and activation handling; step(i)
    runs training step i (same batch and dropout seed for every method)."""

    def __init__(self, method, base_model, make_batch, device, batch, workdir):
        import torch

        self.method, self.make_batch, self.device, self.batch = method, make_batch, device, batch
        self.model = copy.deepcopy(base_model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.enter, self.cache, self._cleanup = _method_context(method, self.model, device, workdir)
        self.times, self.peaks, self.grads = [], [], []
        self.ssd_written = 0  # bytes the last step wrote to SSD files

    def _ssd_bytes_written(self):
        if self.cache is None:
            return 0
        return sum(t["bytes_written"] for t in self.cache.stats()["tiers"] if t["tier"] == "ssd")

    def step(self, i, measured):
        import torch

        from ebbtide.memmeter import PeakMeter

        gen = torch.Generator().manual_seed(1000 + i)
        inputs = self.make_batch(self.batch, gen)
        torch.manual_seed(i)  # dropout masks identical across methods
        self.opt.zero_grad(set_to_none=True)
        written0 = self._ssd_bytes_written()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        with PeakMeter(self.device) as meter:
            with self.enter():
                loss = self.model(**inputs).loss
                meter.sample()
                loss.backward()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.ssd_written = self._ssd_bytes_written() - written0
        # Kept for the comparison with no offload: on the host, or five methods'
        # gradients for every step would fill the GPU.
        self.grads.append([p.grad.detach().to("cpu", copy=True) if p.grad is not None else None
                           for p in self.model.parameters()])
        self.opt.step()
        if measured:
            self.times.append(dt)
            self.peaks.append(meter.peak_bytes)

    def close(self):
        stats = self.cache.stats() if self.cache is not None else {}
        self._cleanup()
        self.model = self.opt = None
        return dict(method=self.method, step_seconds=statistics.median(self.times),
                    peak_bytes=max(self.peaks), stats=stats, ssd_bytes_written=self.ssd_written), self.grads


def run_methods(methods, base_model, make_batch, device, steps, warmup, batch, workdir, log=print):
    """Runs the methods' steps interleaved: round i runs step i of every method,
    the order rotating each round, so drifting machine load and warm-up costs
    hit every method alike. Returns {method: (row, grads)}."""
    runners = {}
    try:
        for m in methods:
            runners[m] = _Runner(m, base_model, make_batch, device, batch, workdir)
        order = list(methods)
        for i in range(warmup + steps):
            log(f"[demo] step {i + 1}/{warmup + steps}{' (warm-up)' if i < warmup else ''}: {', '.join(order)}")
            for m in order:
                runners[m].step(i, measured=i >= warmup)
            order = order[1:] + order[:1]
        return {m: runners[m].close() for m in methods}
    finally:
        for r in runners.values():
            if r.model is not None:
                r._cleanup()


def max_grad_diff(grads, ref):
    worst = 0.0
    for step_g, step_r in zip(grads, ref):
        for g, r in zip(step_g, step_r):
            if (g is None) != (r is None):
                return float("inf")
            if g is not None:
                worst = max(worst, (g.float() - r.float()).abs().max().item())
    return worst


def run_demo(model="gpt2", methods=METHODS, steps=5, warmup=1, seq=None, batch=None,
             layers=None, hidden=None, heads=None, device=None, dtype="fp32", path=None,
             log=print):
    """Runs every method; returns a dict with the config and one row per method."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available to torch")
    size = dict(SIZES["cuda" if dev.type == "cuda" else "cpu"])
    for k, v in dict(layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch).items():
        if v is not None:
            if v <= 0:
                raise ValueError(f"--{k} must be positive, got {v}")
            size[k] = v
    if size["hidden"] % size["heads"]:
        raise ValueError(f"--hidden {size['hidden']} is not divisible by --heads {size['heads']}")
    if steps <= 0:
        raise ValueError(f"--steps must be positive, got {steps}")
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    torch.manual_seed(0)
    base, make_batch = build_model(model, size["layers"], size["hidden"], size["heads"],
                                   size["seq"], torch_dtype, dev)
    methods = ("none",) + tuple(m for m in methods if m != "none")  # the reference comes first
    rows = []
    with tempfile.TemporaryDirectory(prefix="ebbtide-demo-", dir=path) as workdir:
        results = run_methods(methods, base, make_batch, dev, steps, warmup, size["batch"], workdir, log)
        ref = results["none"][1]
        for method in methods:
            row, grads = results[method]
            row["max_grad_diff"] = max_grad_diff(grads, ref)
            row["bytes_written"] = row.pop("ssd_bytes_written")
            row["tokens_per_second"] = size["batch"] * size["seq"] / row["step_seconds"]
            rows.append(row)
    base_row = rows[0]
    for row in rows:
        row["step_time_ratio"] = row["step_seconds"] / base_row["step_seconds"]
        row["peak_ratio"] = row["peak_bytes"] / base_row["peak_bytes"] if base_row["peak_bytes"] else None
    return dict(model=model, device=str(dev), dtype=dtype, steps=steps, warmup=warmup,
                **size, rows=rows)


def format_table(result):
    from ebbtide import _core

    fb = _core.format_bytes
    lines = [f"ebbtide demo: {result['model']} layers={result['layers']} hidden={result['hidden']} "
             f"heads={result['heads']} seq={result['seq']} batch={result['batch']} "
             f"{result['dtype']} on {result['device']}, {result['steps']} steps "
             f"(+{result['warmup']} warm-up)",
             f"{'method':<13}{'step s':>9}{'ratio':>7}{'peak mem':>12}{'ratio':>7}"
             f"{'written':>12}{'max|dgrad|':>12}"]
    for r in result["rows"]:
        peak_ratio = f"{r['peak_ratio']:.2f}" if r["peak_ratio"] is not None else "-"
        lines.append(f"{r['method']:<13}{r['step_seconds']:>9.3f}{r['step_time_ratio']:>7.2f}"
                     f"{fb(r['peak_bytes']):>12}{peak_ratio:>7}{fb(r['bytes_written']):>12}"
                     f"{r['max_grad_diff']:>12.3g}")
    for r in result["rows"]:
        s = r["stats"]
        if s:
            lines.append(f"  {r['method']}: offloaded {s.get('tensors_offloaded', 0)} tensors "
                         f"({fb(s.get('bytes_offloaded', 0))}), kept {s.get('tensors_kept', 0)}, "
                         f"forwarded {s.get('tensors_forwarded', 0)}"
                         + (f" ({fb(s['bytes_discarded'])} written in vain)" if s.get('bytes_discarded') else "")
                         + ", peak resident "
                         f"{fb(s.get('peak_resident_bytes', 0))} of "
                         f"{fb(s.get('saved_bytes_total', 0))} saved, "
                         f"stall {s.get('stall_seconds', 0):.3f} s")
    lines.append("peak mem: step's peak allocation above its start (CUDA allocator on GPU, "
                 "process heap on CPU): activations, temporaries and gradients.")
    return "\n".join(lines)


def plot(result, png_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for r in result["rows"]:
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
