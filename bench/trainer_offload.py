#!/usr/bin/env python3
"""Activation offloading inside trainers: none, the framework's own offloader, ebbtide.

    python bench/trainer_offload.py [--frameworks trl,torchtune] [--json FILE]

trl: TRL's SFTTrainer on a random-init Llama (transformers), methods
  none         plain SFTTrainer
  framework    SFTConfig(activation_offloading=True) (TRL's offloader)
  ebbtide-cpu  ebbtide.integrations.hf.OffloadCallback(target="cpu")
  ebbtide-ssd  the same with target="ssd" (files under --path)
torchtune: a torchtune llama2 decoder in the loop torchtune's single-device
  recipe runs (forward inside the offloading context, loss and backward
  after), methods none, framework (torchtune.training's
  get_act_offloading_ctx_manager), ebbtide-cpu, ebbtide-ssd (ebbtide's
  drop-in).

Every method starts from the same weights and sees the same batches; the
torchtune methods take turns step by step (the order rotating), the TRL runs
one after the other (a Trainer cannot be stepped from outside). Per
method: median optimizer-step time (after --warmup steps), the largest step
peak of memory above the step's start (ebbtide.harness.memmeter: the CUDA allocator
on a GPU, the process heap on the CPU), bytes ebbtide offloaded, and whether
the parameters after training are bitwise those of none. The frameworks'
offloaders need a CUDA (or other accelerator) device: on a CPU-only machine
their rows say why they did not run.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from bench_common import write_result  # noqa: E402

FRAMEWORKS = ("trl", "torchtune")
METHODS = ("none", "framework", "ebbtide-cpu", "ebbtide-ssd")


def _rows(args, n):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(3, args.vocab, (n, args.seq), generator=g)


def _params_equal(a, b):
    import torch

    return all(torch.equal(x.detach().cpu(), y.detach().cpu()) for x, y in zip(a.parameters(), b.parameters()))


def _cache_settings(method, path):
    target = method.split("-", 1)[1]
    return dict(target=target, path=path if target == "ssd" else None)


class _Meter:
    """Times each optimizer step and measures its memory peak."""

    def __init__(self, device, caches=lambda: ()):
        # caches(): the TensorCaches of the step, whose host tiers PeakMeter
        # counts on the CPU (Note [Host tier on the heap] in ebbtide/harness/memmeter.py).
        self.device, self.times, self.peaks, self._m, self._t0 = device, [], [], None, 0.0
        self.caches = caches

    def begin(self):
        from ebbtide.harness.memmeter import PeakMeter

        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        self._m = PeakMeter(self.device, caches=[c for c in self.caches() if c is not None]).__enter__()
        self._t0 = time.perf_counter()

    def end(self):
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - self._t0
        self._m.__exit__(None, None, None)
        self.times.append(dt)
        self.peaks.append(self._m.peak_bytes)


def _llama(args, device):
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.heads, max_position_embeddings=args.seq,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager").to(device)


def _run_trl(method, args, device, path):
    import datasets
    import transformers
    import trl
    from tokenizers import Tokenizer, models

    from ebbtide.integrations.hf import OffloadCallback

    ebb = None
    meter = _Meter(device, lambda: [ebb.cache] if ebb is not None else [])

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            meter.begin()

        def on_step_end(self, *a, **k):
            meter.end()

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    vocab = {f"t{i}": i for i in range(args.vocab)}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
        pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t0")
    n = (args.warmup + args.steps) * args.accum * args.batch
    ds = datasets.Dataset.from_dict({"input_ids": [r.tolist() for r in _rows(args, n)]})
    callbacks = [Timer()]
    if method.startswith("ebbtide"):
        ebb = OffloadCallback(**_cache_settings(method, path), min_bytes=args.min_bytes)
        callbacks.insert(0, ebb)  # the timer's step spans the cache's
    cfg = trl.SFTConfig(output_dir=os.path.join(path, "out"), per_device_train_batch_size=args.batch,
                        gradient_accumulation_steps=args.accum, max_steps=args.warmup + args.steps,
                        learning_rate=1e-4, report_to=[], save_strategy="no", logging_strategy="no",
                        use_cpu=device.type == "cpu", seed=0, data_seed=0, disable_tqdm=True,
                        dataloader_num_workers=0, max_length=args.seq, packing=False,
                        activation_checkpointing=False, gradient_checkpointing=False,
                        activation_offloading=method == "framework")
    model = _llama(args, device)
    trl.SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=callbacks).train()
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = model.is_gradient_checkpointing
    if checkpointing:
        raise RuntimeError("trl: gradient checkpointing is on; this benchmark compares offloading without it")
    stats = ebb.cache.stats() if ebb is not None else None
    return model, meter, stats


def _tt_model(args, device):
    import torch
    from torchtune.models.llama2 import llama2

    torch.manual_seed(0)
    return llama2(vocab_size=args.vocab, num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.heads,
                  embed_dim=args.hidden, max_seq_len=args.seq, intermediate_dim=4 * args.hidden).to(device)


class _TorchtuneJob:
    """One method of the torchtune loop: its model, context, optimizer and meter."""

    def __init__(self, method, args, device, path):
        import torch
        import torchtune.training

        from ebbtide.integrations import torchtune as ebb_tt

        self.args, self.stats = args, None
        self.model = _tt_model(args, device)
        if method == "none":
            self.ctx = torchtune.training.get_act_offloading_ctx_manager(self.model, False)
        elif method == "framework":
            self.ctx = torchtune.training.get_act_offloading_ctx_manager(self.model, True)
        else:
            self.ctx = ebb_tt.get_act_offloading_ctx_manager(self.model, True, **_cache_settings(method, path),
                                                             min_bytes=args.min_bytes)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.rows = _rows(args, (args.warmup + args.steps) * args.accum * args.batch).to(device)
        self.meter = _Meter(device, lambda: [getattr(self.ctx, "cache", None)])
        self.k = 0

    def step(self):
        """One optimizer step of what torchtune's single-device recipe does."""
        import torch

        args = self.args
        self.meter.begin()
        for _ in range(args.accum):
            tokens = self.rows[self.k * args.batch:(self.k + 1) * args.batch]
            self.k += 1
            with self.ctx:
                logits = self.model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            (loss / args.accum).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.meter.end()

    def finish(self):
        cache = getattr(self.ctx, "cache", None)
        if cache is not None:
            self.stats = cache.stats()
            self.ctx.close()
        return self.model, self.meter, self.stats


def _run_torchtune_all(methods, args, device, workdir):
    """Every method's step in turn (the order rotating each step), so machine
    load hits all alike. Returns method -> (model, meter, stats) or the
    exception that stopped it."""
    jobs, out = {}, {}
    for method in methods:
        sub = os.path.join(workdir, f"torchtune-{method}")
        os.makedirs(sub)
        try:
            jobs[method] = _TorchtuneJob(method, args, device, sub)
        except Exception as exc:
            out[method] = exc
    order = list(jobs)
    for i in range(args.warmup + args.steps):
        print(f"[trainer_offload] torchtune: step {i + 1}/{args.warmup + args.steps}", file=sys.stderr)
        for method in order:
            if method in out:
                continue
            try:
                jobs[method].step()
            except Exception as exc:
                out[method] = exc
        order = order[1:] + order[:1]
    for method, job in jobs.items():
        if method not in out:
            out[method] = job.finish()
    return out


def _run_trl_all(methods, args, device, workdir):
    """Each method's whole SFTTrainer run in turn (a Trainer cannot be stepped
    from outside). Returns method -> (model, meter, stats) or the exception."""
    out = {}
    for method in methods:
        print(f"[trainer_offload] trl: {method}", file=sys.stderr)
        sub = os.path.join(workdir, f"trl-{method}")
        os.makedirs(sub)
        try:
            out[method] = _run_trl(method, args, device, sub)
        except Exception as exc:
            out[method] = exc
    return out


def run(args):
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available to torch")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    frameworks = [f for f in args.frameworks.split(",") if f]
    methods = ["none"] + [m for m in args.methods.split(",") if m and m != "none"]
    for f in frameworks:
        if f not in FRAMEWORKS:
            raise SystemExit(f"--frameworks: {f!r} is not one of {', '.join(FRAMEWORKS)}")
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"--methods: {m!r} is not one of {', '.join(METHODS)}")
    runner = {"trl": _run_trl_all, "torchtune": _run_torchtune_all}
    rows = []
    with tempfile.TemporaryDirectory(prefix="ebbtide-trainer-", dir=args.path) as workdir:
        for fw in frameworks:
            results = runner[fw](methods, args, device, workdir)
            ref = None
            for method in methods:
                res = results[method]
                row = dict(framework=fw, method=method)
                if isinstance(res, Exception):
                    if method != "framework":  # ours and the reference must run
                        raise res
                    # The framework's offloader on a machine it does not support.
                    row.update(error=f"{type(res).__name__}: {res}".splitlines()[0][:160])
                    rows.append(row)
                    continue
                model, meter, stats = res
                times, peaks = meter.times[args.warmup:], meter.peaks[args.warmup:]
                if ref is None:
                    ref = (model, statistics.median(times), max(peaks))
                row.update(step_seconds=statistics.median(times), peak_bytes=max(peaks),
                           step_time_ratio=statistics.median(times) / ref[1],
                           peak_ratio=max(peaks) / ref[2] if ref[2] else None,
                           params_equal_none=_params_equal(model, ref[0]),
                           bytes_offloaded=stats["total"]["bytes_offloaded"] if stats else None)
                rows.append(row)
    return dict(model="llama", layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                batch=args.batch, accum=args.accum, vocab=args.vocab, steps=args.steps, warmup=args.warmup,
                device=device.type, threads=torch.get_num_threads(), rows=rows)


def format_table(result):
    from ebbtide import _core

    fb = _core.format_bytes
    lines = [f"trainer_offload: llama layers={result['layers']} hidden={result['hidden']} seq={result['seq']} "
             f"batch={result['batch']} x accum {result['accum']} on {result['device']} "
             f"({result['threads']} threads), {result['steps']} steps (+{result['warmup']} warm-up)",
             f"{'framework':<11}{'method':<13}{'step s':>9}{'ratio':>7}{'peak mem':>12}{'ratio':>7}"
             f"{'offloaded':>12}{'params==none':>14}"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['framework']:<11}{r['method']:<13}  did not run: {r['error']}")
            continue
        off = fb(r["bytes_offloaded"]) if r["bytes_offloaded"] is not None else "-"
        pr = f"{r['peak_ratio']:.2f}" if r["peak_ratio"] is not None else "-"
        lines.append(f"{r['framework']:<11}{r['method']:<13}{r['step_seconds']:>9.3f}{r['step_time_ratio']:>7.2f}"
                     f"{fb(r['peak_bytes']):>12}{pr:>7}{off:>12}{str(r['params_equal_none']):>14}")
    lines.append("step s: median optimizer step; peak mem: the largest step's peak above its start; "
                 "offloaded: ebbtide's bytes over all steps.")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--min-bytes", type=int, default=64 * 1024, help="ebbtide's min_bytes")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--path", default=None, help="directory for ebbtide-ssd's files")
    ap.add_argument("--json", default=None, help="write every number to this file")
    args = ap.parse_args()
    result = run(args)
    print(format_table(result))
    write_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
