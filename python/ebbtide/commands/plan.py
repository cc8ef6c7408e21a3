"""`ebbtide plan`: activation bytes, step time, SSD bandwidth and lifetime,
largest micro-batch for a transformer on a GPU with NVMe drives."""
import json
import math
import sys


def register(subparsers):
    p = subparsers.add_parser(
        "plan", help="performance model: activation bytes, SSD bandwidth and lifetime",
        description="Predict activation bytes, step time, the SSD write bandwidth offloading "
                    "needs, SSD lifetime and the largest micro-batch (docs/model.md).")
    p.add_argument("--list", action="store_true", help="show the GPU, SSD and model catalogs and exit")
    p.add_argument("--hf-config", metavar="PATH",
                   help="a local Hugging Face config.json (GPT-2, BERT, T5, Llama, Qwen2, Mistral, Mixtral, "
                        "Qwen2-MoE); explicit flags override its values")
    p.add_argument("--model", help="a model shape from the catalog (see --list); flags override it")
    p.add_argument("--layers", type=int, help="transformer layers (encoder layers for encoder-decoder)")
    p.add_argument("--decoder-layers", type=int, default=None,
                   help="decoder layers for --arch encoder-decoder (default: --layers)")
    p.add_argument("--hidden", type=int, help="hidden size h")
    p.add_argument("--heads", type=int, help="attention heads a (must divide --hidden unless --head-dim)")
    p.add_argument("--head-dim", type=int, default=None,
                   help="width of one attention head (default hidden/heads; T5: d_kv)")
    p.add_argument("--seq", help="sequence length s, or 'auto': the longest (a multiple of 256) that fits one "
                                 "sample per GPU, with and without offloading")
    p.add_argument("--batch", type=int, default=1, help="micro-batch b (default 1)")
    p.add_argument("--ffn-hidden", type=int, default=None, help="MLP width (default 4*hidden)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 50257)")
    p.add_argument("--arch", default=None,
                   help="decoder | encoder | encoder-decoder (GPT-2-style layers) | llama | moe "
                        "(Llama-style layers; moe needs --experts and --top-k) (default decoder)")
    p.add_argument("--kv-heads", type=int, default=None, help="llama: key/value heads (grouped-query attention)")
    p.add_argument("--experts", type=int, default=None, help="llama/moe: routed experts per layer")
    p.add_argument("--top-k", type=int, default=None, help="llama/moe: experts per token")
    p.add_argument("--expert-ffn-hidden", type=int, default=None, help="llama/moe: expert MLP width "
                   "(default --ffn-hidden)")
    p.add_argument("--shared-expert-ffn-hidden", type=int, default=None,
                   help="llama/moe: width of a shared expert (Qwen2-MoE)")
    p.add_argument("--norm", default=None, help="llama: rmsnorm | layernorm (default rmsnorm)")
    p.add_argument("--dropout", action="store_true", help="llama: attention dropout on; --megatron: hidden and attention dropout")
    p.add_argument("--no-flash-attn", action="store_true",
                   help="attention saves the s x s scores (eager / Megatron kernels)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    p.add_argument("--recompute", default="none", help="none | selective | full")
    p.add_argument("--dtype", default="bf16", help="activation dtype: bf16 | fp16 | fp32")
    p.add_argument("--dp", type=int, default=1, help="data-parallel GPUs (default 1)")
    p.add_argument("--zero", type=int, default=None, choices=(0, 1, 2, 3),
                   help="ZeRO stage: 1 shards optimizer state over --dp, 2 also gradients, 3 also parameters")
    p.add_argument("--fsdp", action="store_true", help="FSDP: ZeRO-3 over --dp (layers as units)")
    p.add_argument("--fsdp-hybrid", type=int, default=None, metavar="G",
                   help="hybrid FSDP: shard within groups of G GPUs, replicate across --dp / G groups")
    p.add_argument("--optimizer", default=None,
                   help="optimizer preset setting --optimizer-bytes: adam (12), adam-8bit (6), sgd-momentum (8), "
                        "sgd (4), adam-fp32 (8, with --param-bytes 4 --grad-bytes 4)")
    p.add_argument("--optimizer-bytes", type=float, default=None, metavar="K",
                   help="optimizer state per parameter in bytes (default 12: fp32 master + Adam's two moments)")
    p.add_argument("--param-bytes", type=float, default=2, help="bytes per parameter (default 2: bf16)")
    p.add_argument("--grad-bytes", type=float, default=2, help="bytes per gradient element (default 2: bf16)")
    p.add_argument("--network", default=None,
                   help="interconnect from the catalog (see --list): adds the data-parallel collectives, the "
                        "time compute does not hide, and the scaling efficiency")
    p.add_argument("--sweep", default=None, metavar="dp=N,N,...",
                   help="a table over data-parallel sizes, e.g. dp=8,64,512: model state, largest micro-batch "
                        "with and without offloading and (with --network) step time and scaling efficiency at each")
    p.add_argument("--png", default=None, metavar="PATH",
                   help="with --sweep: plot per-GPU memory by term and the largest micro-batch (with --network: "
                        "tokens/s) per dp to this file")
    p.add_argument("--gpu", default="h100-sxm", help="GPU from the catalog (see --list)")
    p.add_argument("--ssd", default="d7-p5620", help="SSD from the catalog (see --list)")
    p.add_argument("--ssds", type=int, default=1, help="SSDs per GPU, striped (default 1)")
    p.add_argument("--mfu", type=float, default=0.5, help="FLOPs utilisation in (0, 1] (default 0.5)")
    p.add_argument("--write-amplification", type=float, default=1.0,
                   help="SSD write amplification, >= 1 (default 1.0 for large sequential writes)")
    p.add_argument("--activation-budget", metavar="BYTES",
                   help="activation memory per GPU (e.g. 20GiB): print the planner's keep / offload / recompute "
                        "mix per layer that fits it at the least step time (Note [Budget plan])")
    p.add_argument("--host-budget", metavar="BYTES", default="0",
                   help="with --activation-budget: host memory per GPU the plan may offload to (default 0)")
    p.add_argument("--replay", metavar="TRACE_OR_BENCH_JSON",
                   help="replay a recorded GPU run (a step trace, or the JSON of bench/offload_bench.py or "
                        "bench/budget_bench.py; a folder: every run in it) through the planner's step model: "
                        "the plan that ran, predicted against measured, and the plan chosen now (docs/model.md, "
                        "\"Replays\"); exit code 3 when a run is not reproduced within 5%% or a target is missed")
    p.add_argument("--megatron", action="store_true",
                   help="Megatron-core's GPTModel (local layer spec): with --activation-budget, also the Megatron "
                        "flags (full recompute of the first layers, --offload-modules with --host-budget) that fit it")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _bytes(n):
    from ebbtide import _core

    return _core.format_bytes(float(n))


def _print_catalogs(out):
    from ebbtide.plan import model

    out.write("Models (--model)\n")
    out.write(f"  {'name':<13} {'layers':>6} {'hidden':>6} {'heads':>7} {'kv':>3} {'ffn':>6} {'vocab':>6} "
              f"{'experts':>7}  description\n")
    for m in model.models():
        experts = f"{m['experts']}/top{m['top_k']}" if m["experts"] else "-"
        layers = f"{m['layers']}+{m['decoder_layers']}" if m["decoder_layers"] else str(m["layers"])
        wide = m["head_dim"] and m["head_dim"] * m["heads"] != m["hidden"]  # T5: num_heads x d_kv != d_model
        heads = f"{m['heads']}x{m['head_dim']}" if wide else str(m["heads"])
        kv = m["kv_heads"] or "-"
        out.write(f"  {m['name']:<13} {layers:>6} {m['hidden']:>6} {heads:>7} {kv:>3} "
                  f"{m['ffn_hidden']:>6} {m['vocab']:>6} {experts:>7}  {m['description']}\n")
    out.write("\n")
    out.write("GPUs\n")
    out.write(f"  {'name':<10} {'bf16 TFLOP/s':>12} {'tf32 TFLOP/s':>12} {'memory GB':>9} "
              f"{'PCIe GB/s':>9}  description\n")
    for g in model.gpus():
        out.write(f"  {g['name']:<10} {g['peak_bf16_tflops']:>12.0f} {g['peak_tf32_tflops']:>12.1f} "
                  f"{g['memory_gb']:>9.0f} {g['pcie_gbps']:>9.0f}  {g['description']}\n")
    out.write("\nNetworks (--network), per GPU one direction\n")
    out.write(f"  {'name':<12} {'GPUs/node':>9} {'NVLink GB/s':>11} {'network GB/s':>12} {'latency us':>10}  "
              "description\n")
    for n in model.networks():
        out.write(f"  {n['name']:<12} {n['gpus_per_node']:>9} {n['intra_gbps']:>11.0f} {n['inter_gbps']:>12.2f} "
                  f"{n['latency_us']:>10.0f}  {n['description']}\n")
    out.write("\nSSDs\n")
    out.write(f"  {'name':<9} {'TB':>6} {'DWPD':>5} {'years':>5} {'PBW':>7} {'write GB/s':>10} "
              f"{'read GB/s':>9}  description\n")
    for s in model.ssds():
        out.write(f"  {s['name']:<9} {s['capacity_tb']:>6.2f} {s['dwpd']:>5.2f} {s['warranty_years']:>5.0f} "
                  f"{s['pbw']:>7.2f} {s['seq_write_gbps']:>10.1f} {s['seq_read_gbps']:>9.1f}  "
                  f"{s['description']}\n")


def _sharding_text(r):
    sh = r["sharding"]
    stage = sh["zero_stage"]
    how = {0: "replicated (DDP)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 / FSDP"}[stage]
    group = (f", sharded over {r['shard_over']}" + (f" x {sh['dp'] // r['shard_over']} replicas"
                                                    if sh["shard_group"] else "")) if stage else ""
    return (f"dp={sh['dp']}, {how}{group}; bytes/param: params {sh['param_bytes']:g}, grads {sh['grad_bytes']:g}, "
            f"optimizer {sh['optimizer_bytes']:g}")


def _state_text(r):
    text = (f"params {_bytes(r['params_bytes'])} + grads {_bytes(r['grads_bytes'])} + optimizer "
            f"{_bytes(r['optimizer_bytes'])}")
    if r["gathered_unit_bytes"]:
        text += (f" + gathered unit {_bytes(r['gathered_unit_bytes'])} + prefetch {_bytes(r['prefetch_unit_bytes'])}"
                 f" + root unit {_bytes(r['root_unit_bytes'])}")
    return text


def _print_report(r, out):
    c = r["config"]
    sh = r["sharding"]
    if c["family"] == "llama":
        layer = (f"llama, {c['layers']} layers, h={c['hidden']}, a={c['heads']}, kv={c['kv_heads']}, "
                 f"ffn={c['ffn_hidden']}, V={c['vocab']}, {c['norm']}")
        if c["experts"]:
            layer += (f", {c['experts']} experts top-{c['top_k']} ffn={c['expert_ffn_hidden']}"
                      + (f" + shared {c['shared_expert_ffn_hidden']}" if c["shared_expert_ffn_hidden"] else ""))
    elif c["family"] == "t5":
        layer = (f"t5, {c['layers']} + {c['decoder_layers']} decoder layers, h={c['hidden']}, "
                 f"a={c['heads']} x {c['head_dim']}, ffn={c['ffn_hidden']}"
                 f"{' gated-gelu' if c['gated_mlp'] else ' relu'}, V={c['vocab']}")
    else:
        layer = (f"{c['arch']}, {c['layers']} layers"
                 + (f" + {c['decoder_layers']} decoder layers" if c["arch"] == "encoder-decoder" else "")
                 + f", h={c['hidden']}, a={c['heads']}, ffn={c['ffn_hidden']}, V={c['vocab']}")
    rows = [
        ("model", layer),
        ("shape", f"s={c['seq']}, b={c['batch']}, {c['bytes_per_element']}-byte activations, "
                  f"flash_attn={'on' if c['flash_attn'] else 'off'}, tp={c['tp']}, "
                  f"sp={'on' if c['sp'] else 'off'}, recompute={c['recompute']}"),
        ("hardware", f"{r['gpu']}, {r['ssds']} x {r['ssd']}, mfu={r['mfu']}"),
        ("parameters", f"{r['params'] / 1e9:.3f} B  (model state {_bytes(r['model_state_bytes'])} per GPU)"),
        ("data parallel", _sharding_text(r)),
        ("model state / GPU", _state_text(r)),
        ("activations / layer", _bytes(r["activation_bytes_per_layer"])),
        ("activations / step", _bytes(r["activation_bytes_per_step"])),
        ("offloaded / step", f"{_bytes(r['offloaded_bytes_per_step'])}  (all but the last layer)"),
        ("logits", _bytes(r["logits_bytes"])),
        ("outside the layers", _bytes(r["outside_layers_bytes"])),
        ("forward FLOPs", f"{r['flops_forward']:.3e}"),
        ("forward time", f"{r['forward_seconds'] * 1e3:.1f} ms"),
        ("step time", f"{r['step_seconds'] * 1e3:.1f} ms  (3 x forward + recompute)"),
        ("required write", f"{r['required_write_gbps']:.2f} GB/s per GPU  (offloaded / half the step)"),
        ("SSD write / read", f"{r['ssd_write_gbps']:.1f} / {r['ssd_read_gbps']:.1f} GB/s  "
                             f"(PCIe {r['pcie_gbps']:.0f} GB/s)"),
        ("bandwidth", "sufficient" if r["bandwidth_sufficient"] else
         f"INSUFFICIENT to offload all that: the step would stretch to "
         f"{r['step_seconds_with_offload'] * 1e3:.1f} ms"),
        ("SSD lifetime", f"{r['ssd_lifetime_years']:.2f} years of continuous training "
                         f"(write amplification {r['write_amplification']})"),
        ("max micro-batch", f"{r['max_micro_batch']} offloaded, "
                            f"{r['max_micro_batch_without_offload']} without offloading  (per GPU; global "
                            f"{r['max_micro_batch'] * sh['dp']} / {r['max_micro_batch_without_offload'] * sh['dp']})"),
    ]
    if r["recomputed_layer_bytes"]:
        rows.insert(len(rows) - 1, ("rebuilt layer", f"{_bytes(r['recomputed_layer_bytes'])}  (full recompute: "
                                                     "the largest layer, rebuilt during its backward)"))
    if "max_micro_batch_with_budget_mix" in r:
        rows.append(("  with a budget mix", f"{r['max_micro_batch_with_budget_mix']} (keep / offload / recompute "
                                            "per layer in the memory the model state leaves)"))
    if "network" in r:
        rows.append(("network", f"{r['network']}: per layer gather {r['comm_gather_seconds'] * 1e3:.1f} ms, reduce "
                                f"{r['comm_reduce_seconds'] * 1e3:.1f} ms vs forward "
                                f"{r['unit_forward_seconds'] * 1e3:.1f} ms, backward "
                                f"{r['unit_backward_seconds'] * 1e3:.1f} ms"))
        rows.append(("scaling efficiency", f"{100 * r['scaling_efficiency']:.0f}%  (step "
                                           f"{r['step_seconds_with_comm'] * 1e3:.1f} ms, of it "
                                           f"{r['comm_exposed_seconds'] * 1e3:.1f} ms exposed communication)"))
    if "longest_seq" in r:
        rows.append(("longest sequence", f"{r['longest_seq']} offloaded, {r['longest_seq_without_offload']} "
                                         "without offloading  (one sample per GPU)"))
    if r["model_state_bytes"] >= r["gpu_memory_bytes"]:
        # First, before the figures it makes moot (no micro-batch fits).
        hint = "raise --tp" if sh["zero_stage"] == 3 else "shard it: --fsdp or --zero 1|2|3 with --dp"
        rows.insert(0, ("DOES NOT FIT", f"model state ({_bytes(r['model_state_bytes'])}) exceeds GPU memory "
                                        f"({_bytes(r['gpu_memory_bytes'])}): {hint}"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        out.write(f"{k:<{width}}  {v}\n")


_LLAMA_ARCHS = ("llama", "moe")
_FLAG_KEYS = {  # argparse dest -> config key, applied over --hf-config / --model
    "layers": "layers", "decoder_layers": "decoder_layers", "hidden": "hidden", "heads": "heads",
    "ffn_hidden": "ffn_hidden", "vocab": "vocab", "kv_heads": "kv_heads", "experts": "experts",
    "top_k": "top_k", "expert_ffn_hidden": "expert_ffn_hidden",
    "shared_expert_ffn_hidden": "shared_expert_ffn_hidden", "norm": "norm", "head_dim": "head_dim",
}


# Model settings -> the Hugging Face keys they come from, for error messages.
_HF_KEYS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
            "kv_heads": "num_key_value_heads", "ffn_hidden": "intermediate_size", "vocab": "vocab_size",
            "experts": "num_local_experts", "top_k": "num_experts_per_tok",
            "expert_ffn_hidden": "moe_intermediate_size"}


def _hf_config(path, seq, batch):
    from ebbtide.plan import model

    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    except OSError as e:
        raise OSError(f"{path}: cannot read the Hugging Face config ({e.strerror})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object (a Hugging Face config.json)")
    try:
        config = model.config_from_hf(raw, seq, batch)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    try:
        model.normalize_config(config)
    except ValueError as e:
        keys = [hf for setting, hf in _HF_KEYS.items() if f"'{setting}'" in str(e) and hf in raw]
        raise ValueError(f"{path}: {e}" + (f" (from {'keys' if len(keys) > 1 else 'key'} {', '.join(repr(k) for k in keys)})" if keys else "")) \
            from None
    return config


def _sweep_values(text):
    key, _, values = text.partition("=")
    try:
        dps = [int(v) for v in values.split(",")]
    except ValueError:
        dps = []
    if key.strip() != "dp" or not dps or min(dps) < 1:
        raise ValueError(f"--sweep {text!r}: expected dp=N,N,... with positive integers, e.g. dp=8,64,512")
    return dps


def sweep(config, dps, **hardware):
    """One row per data-parallel size: the plan at the config's micro-batch, the
    largest micro-batch with and without offloading and, with a network, the
    scaling efficiency at each of those micro-batches."""
    rows = []
    for dp in dps:
        r = model_plan(config, dict(hardware, dp=dp))
        row = {k: r[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "gathered_unit_bytes",
                                 "prefetch_unit_bytes", "root_unit_bytes", "model_state_bytes", "max_micro_batch",
                                 "max_micro_batch_without_offload", "step_seconds")}
        row["dp"] = dp
        if "network" in hardware:
            row["scaling_efficiency"] = r["scaling_efficiency"]
            for name, key in (("without_offload", "max_micro_batch_without_offload"), ("offload", "max_micro_batch")):
                b = r[key]
                e = model_plan(dict(config, batch=b), dict(hardware, dp=dp)) if b > 0 else None
                row[f"scaling_efficiency_{name}"] = e["scaling_efficiency"] if e else None
                # Offloading also stretches the step where the drives cannot keep up (conservatively
                # added to the exposed communication, not overlapped with it).
                stretch = e["step_seconds_with_offload"] - e["step_seconds"] if e and name == "offload" else 0.0
                step = e["step_seconds_with_comm"] + stretch if e else None
                row[f"step_seconds_{name}"] = step
                row[f"tokens_per_second_{name}"] = b * e["config"]["seq"] / step if e else None
        rows.append(row)
    return rows


def plot_sweep(rows, png_path):
    """Left: model state per GPU by term (GiB) per dp; right: tokens/s per GPU with and
    without offloading when the rows have a network, the largest micro-batch otherwise."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["dp"]) for r in rows]
    fig, (mem, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    bottom = [0.0] * len(rows)
    for key, name in (("params_bytes", "params"), ("grads_bytes", "grads"), ("optimizer_bytes", "optimizer"),
                      ("gathered_unit_bytes", "gathered unit"), ("prefetch_unit_bytes", "prefetch unit"),
                      ("root_unit_bytes", "root unit")):
        values = [r[key] / 2**30 for r in rows]
        mem.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    mem.set_xlabel("data-parallel GPUs")
    mem.set_ylabel("model state per GPU (GiB)")
    mem.legend(fontsize=8)
    with_net = "tokens_per_second_offload" in rows[0]
    x = range(len(rows))
    for shift, key, name in ((-0.2, "without_offload", "without offloading"), (0.2, "offload", "with ebbtide")):
        if with_net:
            values = [r[f"tokens_per_second_{key}"] or 0 for r in rows]
        else:
            values = [r["max_micro_batch" if key == "offload" else "max_micro_batch_without_offload"] for r in rows]
        right.bar([i + shift for i in x], values, width=0.4, label=name)
    right.set_xticks(list(x), labels)
    right.set_xlabel("data-parallel GPUs")
    right.set_ylabel("tokens/s per GPU at the largest micro-batch" if with_net else "largest micro-batch per GPU")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def model_plan(config, hardware):
    from ebbtide.plan import model

    return model.plan(config, **hardware)


def _print_sweep(rows, out):
    eff = "scaling_efficiency" in rows[0]
    out.write(f"{'dp':>6} {'params+grads+opt':>18} {'gathered':>10} {'state':>10} {'mb without':>10} "
              f"{'mb with':>8}" + (f" {'eff b':>6} {'eff without':>11} {'eff with':>8} {'tok/s without':>13} "
                                   f"{'tok/s with':>10}" if eff
                                   else f" {'step':>9}") + "\n")
    for r in rows:
        sharded = r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"]
        gathered = r["gathered_unit_bytes"] + r["prefetch_unit_bytes"] + r["root_unit_bytes"]

        def pct(v):
            return "-" if v is None else f"{100 * v:.0f}%"

        line = (f"{r['dp']:>6} {_bytes(sharded):>18} {_bytes(gathered):>10} {_bytes(r['model_state_bytes']):>10} "
                f"{r['max_micro_batch_without_offload']:>10} {r['max_micro_batch']:>8}")
        if eff:
            def rate(v):
                return "-" if v is None else f"{v:.0f}"

            line += (f" {pct(r['scaling_efficiency']):>6} {pct(r['scaling_efficiency_without_offload']):>11} "
                     f"{pct(r['scaling_efficiency_offload']):>8} {rate(r['tokens_per_second_without_offload']):>13} "
                     f"{rate(r['tokens_per_second_offload']):>10}")
        else:
            line += f" {r['step_seconds'] * 1e3:>6.0f} ms"
        out.write(line + "\n")


def _seq(text):
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--seq {text!r}: expected a positive integer or 'auto'") from None


def run(args):
    if args.replay:
        from ebbtide.harness import replay_report

        return replay_report.run(args)
    if args.list:
        _print_catalogs(sys.stdout)
        return 0
    from ebbtide.plan import model

    if args.hf_config and args.model:
        raise ValueError("give --hf-config or --model, not both")
    config = {}
    if args.hf_config:
        config = _hf_config(args.hf_config, 1 if args.seq in (None, "auto") else _seq(args.seq), args.batch)
    elif args.model:
        config = model.catalog_config(args.model)
    if args.arch is not None:
        if args.arch in _LLAMA_ARCHS:
            config.update(family="llama", arch="decoder")
        else:
            config.update(family="gpt2", arch=args.arch)
    if args.arch == "moe" and (args.experts is None or args.top_k is None) and not config.get("experts"):
        raise ValueError("--arch moe needs --experts and --top-k")
    for dest, key in _FLAG_KEYS.items():
        value = getattr(args, dest)
        if value is not None:
            config[key] = value
    if args.dropout:
        config["dropout"] = True
    if args.megatron:
        from ebbtide.plan.megatron import megatron_config

        config.update(megatron_config(config))
    missing = [f"--{n}" for n in ("layers", "hidden", "heads") if config.get(n) is None]
    missing += ["--seq"] if args.seq is None else []
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (or use --hf-config, --model or --list)")
    auto_seq = args.seq == "auto"
    config.update(seq=256 if auto_seq else _seq(args.seq), batch=args.batch, tp=args.tp, sp=args.sp,
                  flash_attn=not args.no_flash_attn, recompute=args.recompute, dtype=args.dtype)
    config.pop("bytes_per_element", None)
    hardware = dict(gpu=args.gpu, ssd=args.ssd, ssds=args.ssds, mfu=args.mfu,
                    write_amplification=args.write_amplification, dp=args.dp, zero=args.zero, fsdp=args.fsdp,
                    fsdp_hybrid=args.fsdp_hybrid, optimizer=args.optimizer, optimizer_bytes=args.optimizer_bytes,
                    param_bytes=args.param_bytes, grad_bytes=args.grad_bytes)
    if args.network is not None:
        hardware["network"] = args.network
    if args.sweep is not None:
        rows = sweep(config, _sweep_values(args.sweep), **hardware)
        if args.json:
            json.dump(_finite(rows), sys.stdout, indent=2, sort_keys=True)
            sys.stdout.write("\n")
        else:
            _print_sweep(rows, sys.stdout)
        if args.png:
            plot_sweep(rows, args.png)
            if not args.json:
                print(f"plot: {args.png}")
        return 0
    if args.png:
        raise ValueError("--png plots a --sweep")
    if auto_seq:
        longest = model.longest_seq(config, **{k: v for k, v in hardware.items() if k != "network"})
        config["seq"] = max(longest["longest_seq"], 256)
    report = model.plan(config, **hardware)
    if auto_seq:
        report.update(longest)
    host = _core_bytes(args.host_budget, "--host-budget")
    if args.recompute == "none":
        # The third answer (issue 34): the largest micro-batch a keep / offload /
        # recompute mix fits in the memory the model state leaves.
        report["max_micro_batch_with_budget_mix"] = model.max_micro_batch_budget(
            config, host_budget_bytes=host, **hardware)
    if args.activation_budget is not None:
        budget = _core_bytes(args.activation_budget, "--activation-budget")
        if budget <= 0:
            raise ValueError(f"--activation-budget {args.activation_budget!r}: must be more than 0 bytes")
        report["budget_plan"] = model.budget_plan(config, activation_budget_bytes=budget, gpu=args.gpu,
                                                  ssd=args.ssd, ssds=args.ssds, mfu=args.mfu,
                                                  host_budget_bytes=host)
        if args.megatron:
            from ebbtide.plan.megatron import megatron_flags

            report["megatron"] = megatron_flags(config, activation_budget_bytes=budget, gpu=args.gpu, ssd=args.ssd,
                                                ssds=args.ssds, mfu=args.mfu, host_budget_bytes=host)
    if args.json:
        json.dump(_finite(report), sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        _print_report(report, sys.stdout)
        if "budget_plan" in report:
            _print_budget(report["budget_plan"], sys.stdout)
        if "megatron" in report:
            _print_megatron(report["megatron"], report["budget_plan"], sys.stdout)
    return 0


def _core_bytes(text, what):
    from ebbtide import _core

    return _core.parse_bytes(text, what)


def _runs(names):
    """["keep", "keep", "recompute"] -> "keep x2, recompute": placements in layer order, runs collapsed."""
    out = []
    for n in names:
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return ", ".join(f"{n} x{k}" if k > 1 else n for n, k in out)


def _print_budget(p, out):
    counts = {}
    layers = [m for m in p["modules"] if m["name"] != "head"]
    for m in layers:  # the layers, as "by layer" shows them; the head after
        key = m["placement"] + (f" ({m['tier']})" if m["tier"] and m["placement"] != "offload_" + m["tier"] else "")
        counts[key] = counts.get(key, 0) + 1
    head = [m["placement"] for m in p["modules"] if m["name"] == "head"]
    base = p["forward_seconds"] + p["backward_seconds"]
    rows = [
        ("activation budget", f"{_bytes(p['activation_budget_bytes'])} per GPU"
                              + ("" if p["feasible"] else
                                 f"  NOT MET: the smallest the planner reaches is {_bytes(p['min_budget_bytes'])}")),
        ("mix", f"{len(layers)} layers: " + ", ".join(f"{k} {v}" for k, v in counts.items())
                + (f"; head {head[0]}" if head else "")),
        ("by layer", _runs([m["placement"] for m in layers])),
        ("predicted peak", f"{_bytes(p['peak_resident_bytes'])} of {_bytes(p['all_resident_bytes'])} kept-all "
                           f"({100 * p['peak_resident_fraction']:.0f}%)"),
        ("predicted step", f"{p['predicted_step_seconds'] * 1e3:.1f} ms = {base * 1e3:.1f} ms compute "
                           f"+ {p['recompute_seconds'] * 1e3:.1f} ms recompute "
                           f"+ {p['predicted_stall_seconds'] * 1e3:.1f} ms stall "
                           f"(+{100 * (p['predicted_step_seconds'] / base - 1) if base else 0:.1f}%)"),
        ("moved per step", f"{_bytes(p['bytes_ssd'])} to SSD, {_bytes(p['bytes_cpu'])} to host"),
    ]
    width = max(len(k) for k, _ in rows)
    out.write("\n")
    for k, v in rows:
        out.write(f"{k:<{width}}  {v}\n")


def _print_megatron(m, budget_plan, out):
    from ebbtide.plan.megatron import flag_rows

    rows = flag_rows(m, budget_plan, _bytes, _runs)
    width = max(len(k) for k, _ in rows)
    out.write("\n")
    for k, v in rows:
        out.write(f"{k:<{width}}  {v}\n")
