"""What the training benchmarks under bench/ share: where a run happened, its JSON and its step trace."""
import datetime
import json
import platform
import time


def write_result(result, path):
    """Stamps result with the date, host, torch version and GPU (when it ran on
    one), then writes it to path as JSON when path is given."""
    import torch

    result.update(date=datetime.date.today().isoformat(), host=platform.node(), torch=torch.__version__)
    if result.get("device", "").startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)


def write_trace(path, runs, assumptions=(), **about):
    """Writes a step trace (ebbtide.plan.replay's format, what `ebbtide plan
    --replay` reads) to path: the runs, the assumptions every run shares,
    and `about` (bench, device, shape, left_out, ...), stamped as
    write_result stamps a result."""
    from ebbtide.plan import replay

    doc = dict(about)
    write_result(doc, None)
    doc.update(format=replay.TRACE_FORMAT, version=replay.TRACE_VERSION, runs=list(runs),
               assumptions=list(assumptions))
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)


def gpt2_batch(args):
    """The CPU benches' model: a random-init HF GPT-2 LM (eager attention) of
    args.layers/hidden/heads/seq, in training mode, and one batch of
    args.batch sequences; torch threads set from args.threads (0: leave)."""
    import logging

    import torch
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                                  n_positions=args.seq, vocab_size=8192, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
    model.train()
    ids = torch.randint(0, 8192, (args.batch, args.seq))
    return model, dict(input_ids=ids, labels=ids)


def timed_step(model, batch, cache=None):
    """One forward and backward of a HF model on `batch` (under cache.step()
    with a cache), gradients cleared first: (wall seconds, CPU seconds of
    the process)."""
    model.zero_grad(set_to_none=True)
    t0, c0 = time.perf_counter(), time.process_time()
    if cache is None:
        model(**batch).loss.backward()
    else:
        with cache.step():
            model(**batch).loss.backward()
    return time.perf_counter() - t0, time.process_time() - c0
