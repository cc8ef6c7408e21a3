"""ExCP-style delta checkpoint chains: compression against the quality of a run resumed from the chain's end.

Trains a small Llama-style model (random init, nothing downloaded) on CPU on a
learnable synthetic corpus (a fixed random sparse bigram source), with AdamW
and a warm-up + cosine schedule. Along the run the exact states are kept every
K steps; for each setting they are saved as a chain (a full lossless
checkpoint, then compress="delta" against the previous one), the chain's end
is loaded into a fresh model and optimizer, and training resumes for the same
steps as the uninterrupted run, on the same batches. Reported per setting:
the ratio of each delta (raw state: weights + AdamW moments, fp32), of the
deltas together and of the whole chain with its full base, save and load
time, the error of the loaded state against the exact one, and the held-out
loss of the resumed run against the uninterrupted run's.

    python bench/excp_bench.py [--quick] [--json out.json] [--png out.png]
"""
import argparse
import math
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import write_result  # noqa: E402

from ebbtide import checkpoint as ckpt  # noqa: E402

VOCAB = 512
SIZES = {  # name -> (hidden, layers, heads)
    "xs": (64, 2, 2),
    "s": (96, 2, 3),
    "m": (128, 3, 4),
    "h256": (256, 4, 4),  # the early-run case: 4 layers at hidden 256 (3.4M parameters)
    "l": (512, 8, 8),  # 25.7M parameters
}
# Settings: name -> lossy options (None: a lossless chain, the harness's control).
SETTINGS = {
    "lossless chain (control)": None,
    "ExCP code defaults (beta=2, v zeroed)": {"density": 0.1, "beta": 2.0, "v_unkept": "zero"},
    "issue-31 options (d=0.2, beta=0.5, v zeroed)": {"density": 0.2, "beta": 0.5, "v_unkept": "zero"},
    "default (d=0.1 + tolerance, 4/4 bits, v carried)": {},
    "fixed density (d=0.1, tolerance 0)": {"tolerance": 0.0},
    "d=0.05, 4/4 bits": {"density": 0.05},
    "d=0.05, 3/3 bits": {"density": 0.05, "bits": 3, "bits_moments": 3},
    "d=0.03, 3/3 bits": {"density": 0.03, "bits": 3, "bits_moments": 3},
    "d=0.02, 3/3 bits": {"density": 0.02, "bits": 3, "bits_moments": 3},
    "d=0.03, 3/2 bits": {"density": 0.03, "bits": 3, "bits_moments": 2},
}
DEFAULT = "default (d=0.1 + tolerance, 4/4 bits, v carried)"
QUICK_SETTINGS = ["lossless chain (control)", "ExCP code defaults (beta=2, v zeroed)", DEFAULT]
# --early-run: the chain of issue 42 §3, early in a run (a fixed density lost 2.85-7.7% there).
EARLY_SETTINGS = ["lossless chain (control)", "fixed density (d=0.1, tolerance 0)", DEFAULT]


class Corpus:
    """A fixed random sparse bigram source: each token has `fanout`
    successors with Dirichlet(0.5) probabilities. Batch t is drawn from a
    generator seeded by t, so a resumed run sees the same batches."""

    def __init__(self, seed=1234, fanout=8):
        g = torch.Generator().manual_seed(seed)
        self.succ = torch.randint(VOCAB, (VOCAB, fanout), generator=g)
        torch.manual_seed(seed)  # Dirichlet(0.5) rows: normalised Gamma(0.5) draws, the same in every run
        gamma = torch._standard_gamma(torch.full((VOCAB, fanout), 0.5))
        self.prob = gamma / gamma.sum(1, keepdim=True)
        self.cum = self.prob.cumsum(1)

    def batch(self, key, bsz, seq):
        g = torch.Generator().manual_seed(10_000_019 + key)
        x = torch.empty(bsz, seq, dtype=torch.long)
        x[:, 0] = torch.randint(VOCAB, (bsz,), generator=g)
        u = torch.rand(bsz, seq, generator=g)
        for i in range(1, seq):
            j = torch.searchsorted(self.cum[x[:, i - 1]], u[:, i:i + 1].contiguous()).clamp(max=self.cum.shape[1] - 1)
            x[:, i] = self.succ[x[:, i - 1], j[:, 0]]
        return x

    def entropy(self):
        """Per-token entropy of the source in nats (the loss floor)."""
        p = self.prob.clamp(min=1e-12)
        h = -(p * p.log()).sum(1)
        # stationary distribution by power iteration
        t = torch.zeros(VOCAB, VOCAB)
        t.scatter_add_(1, self.succ, self.prob)
        pi = torch.full((VOCAB,), 1.0 / VOCAB)
        for _ in range(200):
            pi = pi @ t
        return float((pi * h).sum())


def make_model(size, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    h, layers, heads = SIZES[size]
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=h, intermediate_size=int(h * 8 / 3) // 8 * 8,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


class Run:
    def __init__(self, args, size):
        self.args, self.size = args, size
        self.total = args.steps + args.resume_steps
        self.corpus = Corpus()
        self.heldout = [self.corpus.batch(-1 - i, args.batch, args.seq) for i in range(args.eval_batches)]

    def lr_lambda(self, step):
        w = self.args.warmup
        if step < w:
            return (step + 1) / w
        frac = (step - w) / max(1, self.total - w)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    def fresh(self):
        model = make_model(self.size)
        opt = torch.optim.AdamW(model.parameters(), lr=self.args.lr, betas=(0.9, self.args.beta2), weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_lambda)
        return model, opt, sched

    def step(self, model, opt, sched, t):
        x = self.corpus.batch(t, self.args.batch, self.args.seq)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self, model):
        model.eval()
        loss = sum(float(model(input_ids=x, labels=x).loss) for x in self.heldout) / len(self.heldout)
        model.train()
        return loss

    def train(self):
        """The uninterrupted run: exact states at each checkpoint step, the
        held-out loss at the chain's end and after the resume steps."""
        a = self.args
        model, opt, sched = self.fresh()
        states, t0 = [], time.perf_counter()
        first = a.steps - a.every * (a.links)
        for t in range(self.total):
            loss = self.step(model, opt, sched, t)
            done = t + 1
            if done >= first and (done - first) % a.every == 0 and done <= a.steps:
                states.append((done, clone_state(model, opt, sched, done)))
            if done == a.steps:
                at_end = self.evaluate(model)
        final = self.evaluate(model)
        return {"states": states, "loss_at_chain_end": at_end, "heldout_loss": final, "last_train_loss": loss,
                "train_s": time.perf_counter() - t0, "params": sum(p.numel() for p in model.parameters())}

    def resume(self, state):
        model, opt, sched = self.fresh()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        at_resume = self.evaluate(model)
        for t in range(int(state["step"]), self.total):
            self.step(model, opt, sched, t)
        return at_resume, self.evaluate(model)


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone(v) for v in x]
    return x


def clone_state(model, opt, sched, step):
    return {"model": _clone(model.state_dict()), "optimizer": _clone(opt.state_dict()),
            "scheduler": _clone(sched.state_dict()), "step": step}


def raw_bytes(state):
    from ebbtide.checkpoint import tree
    return sum(t.numel() * t.element_size() for _, t in tree.walk_tensors(state))


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def rel_l2(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def state_errors(loaded, exact):
    """Relative L2 error of the weights, first and second moments (all tensors together)."""
    out = {}
    w = [(loaded["model"][k], v) for k, v in exact["model"].items() if v.is_floating_point()]
    out["weights"] = rel_l2(torch.cat([x.reshape(-1) for x, _ in w]), torch.cat([y.reshape(-1) for _, y in w]))
    for name, key in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        s1, s0 = loaded["optimizer"]["state"], exact["optimizer"]["state"]
        out[name] = rel_l2(torch.cat([s1[i][key].reshape(-1) for i in s0]),
                           torch.cat([s0[i][key].reshape(-1) for i in s0]))
    return out


def run_setting(run, base_run, name, lossy, tmp):
    states = base_run["states"]
    d = tempfile.mkdtemp(dir=tmp)
    links, save_s = [], []
    prev = None
    for i, (step, st) in enumerate(states):
        path = os.path.join(d, f"step{step:05d}")
        t0 = time.perf_counter()
        if prev is None or lossy is None:
            info = ckpt.save(st, path, compress="lossless")
        else:
            info = ckpt.save(st, path, compress="delta", base=prev, lossy=lossy)
        save_s.append(time.perf_counter() - t0)
        links.append({"step": step, "raw_bytes": raw_bytes(st), "stored_bytes": dir_bytes(path),
                      "payload_bytes": int(info["stored_bytes"]),
                      "kind": "full" if prev is None or lossy is None else "delta"})
        links[-1]["ratio"] = links[-1]["raw_bytes"] / links[-1]["stored_bytes"]
        kept = [v["kept"] for p, v in (info.get("error") or {}).get("tensors", {}).items()
                if not p.endswith((".exp_avg", ".exp_avg_sq"))]
        links[-1]["weights_kept"] = sum(kept) / len(kept) if kept else None  # mean kept fraction of the residuals
        prev = path
    t0 = time.perf_counter()
    loaded = ckpt.load(prev)
    load_s = time.perf_counter() - t0
    errs = state_errors(loaded, states[-1][1])
    at_resume, final = run.resume(loaded)
    deltas = [x for x in links if x["kind"] == "delta"] or links[1:]
    res = {"setting": name, "lossy": lossy, "links": links,
           "delta_ratio_mean": sum(x["raw_bytes"] for x in deltas) / sum(x["stored_bytes"] for x in deltas),
           "delta_payload_ratio": sum(x["raw_bytes"] for x in deltas) / sum(x["payload_bytes"] for x in deltas),
           "chain_ratio": sum(x["raw_bytes"] for x in links) / sum(x["stored_bytes"] for x in links),
           "chain_stored_bytes": sum(x["stored_bytes"] for x in links),
           "weights_kept_mean": (sum(x["weights_kept"] for x in deltas) / len(deltas)
                                 if deltas and all(x.get("weights_kept") is not None for x in deltas) else None),
           "save_s_mean": sum(save_s[1:]) / max(1, len(save_s) - 1), "load_chain_end_s": load_s,
           "state_rel_l2": errs, "loss_at_resume": at_resume, "heldout_loss": final,
           "loss_delta_pct": 100.0 * (final - base_run["heldout_loss"]) / base_run["heldout_loss"]}
    shutil.rmtree(d)
    return res


def fmt_table(rows, base_loss):
    head = (f"{'setting':46} {'delta x':>8} {'payload':>8} {'chain x':>8} {'kept':>6} {'save s':>7} {'load s':>7} "
            f"{'W err':>7} {'m err':>7} {'v err':>7} {'loss':>7} {'vs ref':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        e = r["state_rel_l2"]
        lines.append(f"{r['setting'][:46]:46} {r['delta_ratio_mean']:8.1f} {r['delta_payload_ratio']:8.1f} "
                     f"{r['chain_ratio']:8.1f} "
                     f"{(r['weights_kept_mean'] if r['weights_kept_mean'] is not None else float('nan')):6.3f} "
                     f"{r['save_s_mean']:7.3f} {r['load_chain_end_s']:7.3f} {e['weights']:7.4f} "
                     f"{e['exp_avg']:7.3f} {e['exp_avg_sq']:7.3f} {r['heldout_loss']:7.4f} "
                     f"{r['loss_delta_pct']:+7.2f}%")
    lines.append(f"{'uninterrupted run':46} {'':8} {'':8} {'':8} {'':6} {'':7} {'':7} {'':7} {'':7} {'':7} "
                 f"{base_loss:7.4f}")
    return "\n".join(lines)


def plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("excp_bench: matplotlib is not installed; no PNG written", file=sys.stderr)
        return
    fig, ax = plt.subplots(1, 2 if result.get("sizes") else 1, figsize=(12 if result.get("sizes") else 7, 4.5),
                           squeeze=False)
    a = ax[0][0]
    for r in result["settings"]:
        if r["lossy"] is None:
            continue
        a.scatter(r["delta_ratio_mean"], r["loss_delta_pct"], s=30)
        a.annotate(r["setting"].split(" (")[0] if "ExCP" in r["setting"] or "issue" in r["setting"]
                   else r["setting"], (r["delta_ratio_mean"], r["loss_delta_pct"]), fontsize=7,
                   xytext=(4, 3), textcoords="offset points")
    a.axhline(1.0, ls="--", c="grey", lw=0.8)
    a.axhline(2.0, ls=":", c="grey", lw=0.8)
    a.set_xscale("log")
    a.set_xlabel("compression of the deltas (raw fp32 state / stored)")
    a.set_ylabel("held-out loss of the resumed run vs uninterrupted (%)")
    a.set_title(f"ExCP-style chain, Llama {result['size']} ({result['params']:,} params), CPU", fontsize=9)
    if result.get("sizes"):
        b = ax[0][1]
        xs = [s["params"] for s in result["sizes"]]
        b.plot(xs, [s["delta_ratio_mean"] for s in result["sizes"]], "o-", label="deltas")
        b.plot(xs, [s["delta_payload_ratio"] for s in result["sizes"]], "^-", label="deltas, payload (no padding)")
        b.plot(xs, [s["chain_ratio"] for s in result["sizes"]], "s-", label=f"whole chain ({result['links'] + 1} ckpts)")
        b.set_xscale("log")
        b.set_xlabel("parameters")
        b.set_ylabel("compression (x)")
        b.set_title("default setting by model size", fontsize=9)
        b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def fio_write(directory, nbytes):
    """fio's sequential write rate to `directory` (1 MiB, queue depth 16,
    O_DIRECT, fsync at the end), in GB/s; None without fio."""
    import json as _json
    import subprocess
    if shutil.which("fio") is None:
        return None
    r = subprocess.run(["fio", "--name=excp", f"--directory={directory}", "--rw=write", "--bs=1M", "--direct=1",
                        "--ioengine=io_uring", "--iodepth=16", f"--size={nbytes}", "--end_fsync=1",
                        "--output-format=json", "--filename=fio.dat"], capture_output=True, text=True)
    os.unlink(os.path.join(directory, "fio.dat"))
    if r.returncode != 0:
        return None
    job = _json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]
    return job["write"]["io_bytes"] / (job["job_runtime"] / 1e3) / 1e9


def throughput(a):
    """--throughput: how fast a delta save of a >= 1 GB state runs. A
    Llama-style model of about 109M parameters (hidden 1024, 6 layers,
    vocabulary 16,000), random init, AdamW steps on the synthetic corpus;
    the state after the first step is saved losslessly as the base, the
    state two steps later is encoded against it. Rounds alternate: the
    encoding alone (lossy.encode on a checkpoint writer's threads, the base
    loaded), the whole compressed save (base read back, encoding, writes),
    a lossless and a raw save, fio's write of the state's size; then async
    saves (delta with a staging buffer ready, lossless): what each blocks
    its caller for. GB/s of the raw state (fp32 weights and both moments)."""
    import statistics

    from transformers import LlamaConfig, LlamaForCausalLM

    from ebbtide.checkpoint import lossy
    torch.manual_seed(0)
    vocab, hidden, inter, layers, heads = (16000, 1024, 2752, 6, 16) if a.throughput == "full" else (512, 64, 176, 2, 2)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=256,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    corpus = Corpus()  # its vocabulary (512) is a subset of the model's
    states = []
    for t in range(3):
        x = corpus.batch(t, 4, 64)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if t in (0, 2):
            states.append({"model": _clone(model.state_dict()), "optimizer": _clone(opt.state_dict())})
    del model, opt
    base_state, state = states
    nbytes = raw_bytes(state)
    params = sum(v.numel() for v in state["model"].values())
    if a.dir:
        os.makedirs(a.dir, exist_ok=True)
    d = tempfile.mkdtemp(prefix="excp-throughput-", dir=a.dir)
    try:
        w = ckpt.Writer()
        base = os.path.join(d, "base")
        ckpt.save(base_state, base, compress="lossless", writer=w)
        loaded = ckpt.load(base)
        rounds = {k: [] for k in ("encode_s", "encode_cpu_s", "delta_save_s", "lossless_save_s", "raw_save_s",
                                  "fio_GBps")}
        info = None
        for r in range(a.rounds + 1):  # round 0 (the writer's first: its scratch memory is fresh) reported apart
            t0, c0 = time.perf_counter(), time.process_time()
            lossy.encode(state, loaded, None, w._native)
            rounds["encode_s"].append(time.perf_counter() - t0)
            rounds["encode_cpu_s"].append(time.process_time() - c0)  # all threads: what it costs on a free machine
            t0 = time.perf_counter()
            info = ckpt.save(state, os.path.join(d, "delta"), compress="delta", base=base, writer=w)
            rounds["delta_save_s"].append(time.perf_counter() - t0)
            for key, kw in (("lossless_save_s", {"compress": "lossless"}), ("raw_save_s", {})):
                t0 = time.perf_counter()
                ckpt.save(state, os.path.join(d, key), writer=w, **kw)
                rounds[key].append(time.perf_counter() - t0)
            w.join()
            f = fio_write(d, nbytes)
            if f is not None:
                rounds["fio_GBps"].append(f)
        blocked = {"delta": [], "lossless": []}
        for r in range(a.rounds + 1):  # the first delta one fills the staging buffer
            for kind, kw in (("delta", {"compress": "delta", "base": base}), ("lossless", {"compress": "lossless"})):
                t0 = time.perf_counter()
                h = w.save(state, os.path.join(d, f"async-{kind}"), async_=True, **kw)
                blocked[kind].append(time.perf_counter() - t0)
                h.wait()
                w.join()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    gb = nbytes / 1e9
    first = {k: v[0] for k, v in rounds.items() if v}
    med = {k: statistics.median(v[1:]) for k, v in rounds.items() if len(v) > 1}
    if rounds["fio_GBps"]:  # encode against fio in the same round: the machine's load moves both
        rounds["encode_vs_fio"] = [gb / e / f for e, f in zip(rounds["encode_s"], rounds["fio_GBps"])]
        med["encode_vs_fio"] = statistics.median(rounds["encode_vs_fio"][1:])
    out = {"bench": "excp-throughput", "params": params, "state_bytes": nbytes, "rounds": rounds, "first": first,
           "median": med, "async_blocked_s": blocked, "delta_ratio": info["ratio"], "delta_error": info["error"]["overall"],
           "load_average": os.getloadavg()}
    print(f"ExCP throughput: Llama-style, {params:,} parameters, state {gb:.3f} GB (fp32 weights + AdamW moments); "
          f"medians of {a.rounds} rounds after a first one; load average {out['load_average'][0]:.2f}")
    rows = [("encode (lossy.encode, writer's threads)", "encode_s"),
            ("delta save: read base + encode + write", "delta_save_s"),
            ("lossless save (zstd)", "lossless_save_s"), ("raw save", "raw_save_s")]
    for name, key in rows:
        print(f"  {name:<44} {med[key]:7.3f} s  {gb / med[key]:6.2f} GB/s  (first round {first[key]:.3f} s)")
    cores = min(4, len(os.sched_getaffinity(0)))  # the writer's threads (EBBTIDE_CKPT_THREADS unset)
    out["encode_GBps_free_cores"] = gb * cores / med["encode_cpu_s"]
    print(f"  {'encode, CPU seconds (all threads)':<44} {med['encode_cpu_s']:7.3f} s  {gb / med['encode_cpu_s']:6.2f} GB/s "
          f"per core: {out['encode_GBps_free_cores']:.2f} GB/s with its {cores} cores free")
    if "fio_GBps" in med:
        print(f"  {'fio sequential write (1M, qd16, direct, fsync)':<44} {'':7}    {med['fio_GBps']:6.2f} GB/s  "
              f"(encode / fio, each round's: median {med['encode_vs_fio']:.2f}x, rounds "
              f"{', '.join(f'{x:.2f}' for x in rounds['encode_vs_fio'][1:])})")
    later = lambda v: statistics.median(v[1:])  # noqa: E731 - the first delta one had no staging buffer
    print(f"  async saves, caller blocked (later calls, median): delta {later(blocked['delta']):.3f} s, lossless "
          f"{later(blocked['lossless']):.3f} s; first delta {blocked['delta'][0]:.3f} s (encoded in the call)")
    print(f"  delta ratio {info['ratio']:.1f}x, rel. L2 error {info['error']['overall']['rel_l2']:.4f}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small run for a test (about half a minute)")
    ap.add_argument("--early-run", action="store_true",
                    help="the chain early in a run: model h256, lr 1e-3, deltas every 20 steps from step 40 to "
                         "160, resumed for 40 steps")
    ap.add_argument("--size", default="s", choices=sorted(SIZES), help="model of the settings sweep")
    ap.add_argument("--sizes", nargs="*", default=None,
                    help="model sizes for the size sweep at the default setting (default: xs s m; none with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="steps up to the chain's end")
    ap.add_argument("--resume-steps", type=int, default=None, help="steps after the chain's end")
    ap.add_argument("--every", type=int, default=20, help="steps between the chain's checkpoints")
    ap.add_argument("--links", type=int, default=None, help="delta checkpoints in the chain")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--beta2", type=float, default=0.95, help="AdamW beta2 (Pythia: 0.95; torch's default: 0.999)")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--settings", nargs="*", default=None, help="names of settings to run (default: all)")
    ap.add_argument("--dir", default=None, help="where the chains are written (default: a temporary directory)")
    ap.add_argument("--throughput", nargs="?", const="full", choices=("full", "tiny"),
                    help="encode and save rates of a >= 1 GB state (109M parameters; tiny: 0.3M, a test) against "
                         "fio, instead of the chain sweep")
    ap.add_argument("--rounds", type=int, default=3, help="--throughput: rounds")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if a.throughput:
        result = throughput(a)
        write_result(result, a.json)
        return result
    if a.early_run:
        a.size, a.steps, a.every, a.links, a.resume_steps, a.lr = "h256", 160, 20, 6, 40, 1e-3
        a.sizes = a.sizes or []
        a.settings = a.settings or EARLY_SETTINGS
    if a.quick:
        a.size = "xs" if a.size == "s" else a.size
        a.links = a.links or 3
        a.every = 10
        a.steps = a.steps or 60
        a.resume_steps = a.resume_steps or 20
        a.batch, a.eval_batches = 8, 2
        a.sizes = a.sizes or []
        a.warmup = 10
    a.links = a.links or 8
    a.steps = a.steps or 300
    a.resume_steps = a.resume_steps or 100
    if a.sizes is None:
        a.sizes = ["xs", "s", "m"]
    names = a.settings or (QUICK_SETTINGS if a.quick else list(SETTINGS))
    bad = [n for n in names if n not in SETTINGS]
    if bad:
        ap.error(f"unknown setting {bad[0]!r} (valid: {', '.join(SETTINGS)})")
    if a.every * a.links >= a.steps:
        ap.error(f"--every {a.every} x --links {a.links} must be below --steps {a.steps}")
    if a.dir:
        os.makedirs(a.dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="excp-bench-", dir=a.dir)
    try:
        run = Run(a, a.size)
        base = run.train()
        print(f"Llama-style {a.size}: {base['params']:,} parameters, {a.steps}+{a.resume_steps} steps, AdamW "
              f"betas (0.9, {a.beta2}) "
              f"(batch {a.batch}x{a.seq}), chain of 1 full + {a.links} deltas every {a.every} steps; "
              f"source entropy {run.corpus.entropy():.3f} nats, held-out loss {base['loss_at_chain_end']:.4f} at "
              f"the chain's end, {base['heldout_loss']:.4f} after {a.resume_steps} more steps "
              f"(trained in {base['train_s']:.0f} s)")
        rows = []
        for n in names:
            rows.append(run_setting(run, base, n, SETTINGS[n], tmp))
            print(f"  {n}: deltas {rows[-1]['delta_ratio_mean']:.1f}x, loss {rows[-1]['loss_delta_pct']:+.2f}%",
                  flush=True)
        print()
        print(fmt_table(rows, base["heldout_loss"]))
        result = {"bench": "excp", "size": a.size, "params": base["params"], "steps": a.steps,
                  "resume_steps": a.resume_steps, "every": a.every, "links": a.links, "batch": a.batch,
                  "seq": a.seq, "lr": a.lr, "beta2": a.beta2, "uninterrupted_heldout_loss": base["heldout_loss"],
                  "loss_at_chain_end": base["loss_at_chain_end"], "source_entropy": run.corpus.entropy(),
                  "settings": rows, "sizes": []}
        if a.sizes:
            print("\ndefault setting by model size:")
            print(f"{'size':5} {'params':>10} {'delta x':>8} {'payload':>8} {'chain x':>8} {'loss vs ref':>12}")
            for s in a.sizes:
                if s == a.size and DEFAULT in names:
                    r = next(x for x in rows if x["setting"] == DEFAULT)
                    p = base["params"]
                else:
                    rs = Run(a, s)
                    b = rs.train()
                    r = run_setting(rs, b, "default", {}, tmp)
                    p = b["params"]
                result["sizes"].append({"size": s, "params": p, "delta_ratio_mean": r["delta_ratio_mean"],
                                        "delta_payload_ratio": r["delta_payload_ratio"],
                                        "chain_ratio": r["chain_ratio"], "loss_delta_pct": r["loss_delta_pct"]})
                print(f"{s:5} {p:10,} {r['delta_ratio_mean']:8.1f} {r['delta_payload_ratio']:8.1f} {r['chain_ratio']:8.1f} "
                      f"{r['loss_delta_pct']:+11.2f}%", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_result(result, a.json)
    if a.png:
        plot(result, a.png)
    return result


if __name__ == "__main__":
    main()
