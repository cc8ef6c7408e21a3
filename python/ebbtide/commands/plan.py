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
    p.add_argument("--list", action="store_true", help="show the GPU and SSD catalogs and exit")
    p.add_argument("--layers", type=int, help="transformer layers (encoder layers for encoder-decoder)")
    p.add_argument("--decoder-layers", type=int, default=None,
                   help="decoder layers for --arch encoder-decoder (default: --layers)")
    p.add_argument("--hidden", type=int, help="hidden size h")
    p.add_argument("--heads", type=int, help="attention heads a (must divide --hidden)")
    p.add_argument("--seq", type=int, help="sequence length s")
    p.add_argument("--batch", type=int, default=1, help="micro-batch b (default 1)")
    p.add_argument("--ffn-hidden", type=int, default=None, help="MLP width (default 4*hidden)")
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary size (default 50257)")
    p.add_argument("--arch", default="decoder", help="decoder | encoder | encoder-decoder")
    p.add_argument("--no-flash-attn", action="store_true",
                   help="attention saves the s x s scores (eager / Megatron kernels)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    p.add_argument("--recompute", default="none", help="none | selective | full")
    p.add_argument("--dtype", default="bf16", help="activation dtype: bf16 | fp16 | fp32")
    p.add_argument("--gpu", default="h100-sxm", help="GPU from the catalog (see --list)")
    p.add_argument("--ssd", default="d7-p5620", help="SSD from the catalog (see --list)")
    p.add_argument("--ssds", type=int, default=1, help="SSDs per GPU, striped (default 1)")
    p.add_argument("--mfu", type=float, default=0.5, help="FLOPs utilisation in (0, 1] (default 0.5)")
    p.add_argument("--write-amplification", type=float, default=1.0,
                   help="SSD write amplification, >= 1 (default 1.0 for large sequential writes)")
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
    from ebbtide import model

    out.write("GPUs\n")
    out.write(f"  {'name':<10} {'bf16 TFLOP/s':>12} {'tf32 TFLOP/s':>12} {'memory GB':>9} "
              f"{'PCIe GB/s':>9}  description\n")
    for g in model.gpus():
        out.write(f"  {g['name']:<10} {g['peak_bf16_tflops']:>12.0f} {g['peak_tf32_tflops']:>12.1f} "
                  f"{g['memory_gb']:>9.0f} {g['pcie_gbps']:>9.0f}  {g['description']}\n")
    out.write("\nSSDs\n")
    out.write(f"  {'name':<9} {'TB':>6} {'DWPD':>5} {'years':>5} {'PBW':>7} {'write GB/s':>10} "
              f"{'read GB/s':>9}  description\n")
    for s in model.ssds():
        out.write(f"  {s['name']:<9} {s['capacity_tb']:>6.2f} {s['dwpd']:>5.2f} {s['warranty_years']:>5.0f} "
                  f"{s['pbw']:>7.2f} {s['seq_write_gbps']:>10.1f} {s['seq_read_gbps']:>9.1f}  "
                  f"{s['description']}\n")


def _print_report(r, out):
    c = r["config"]
    rows = [
        ("model", f"{c['arch']}, {c['layers']} layers"
                  + (f" + {c['decoder_layers']} decoder layers" if c["arch"] == "encoder-decoder" else "")
                  + f", h={c['hidden']}, a={c['heads']}, ffn={c['ffn_hidden']}, V={c['vocab']}"),
        ("shape", f"s={c['seq']}, b={c['batch']}, {c['bytes_per_element']}-byte activations, "
                  f"flash_attn={'on' if c['flash_attn'] else 'off'}, tp={c['tp']}, "
                  f"sp={'on' if c['sp'] else 'off'}, recompute={c['recompute']}"),
        ("hardware", f"{r['gpu']}, {r['ssds']} x {r['ssd']}, mfu={r['mfu']}"),
        ("parameters", f"{r['params'] / 1e9:.3f} B  (model state {_bytes(r['model_state_bytes'])} per GPU)"),
        ("activations / layer", _bytes(r["activation_bytes_per_layer"])),
        ("activations / step", _bytes(r["activation_bytes_per_step"])),
        ("offloaded / step", f"{_bytes(r['offloaded_bytes_per_step'])}  (all but the last layer)"),
        ("logits", _bytes(r["logits_bytes"])),
        ("forward FLOPs", f"{r['flops_forward']:.3e}"),
        ("forward time", f"{r['forward_seconds'] * 1e3:.1f} ms"),
        ("step time", f"{r['step_seconds'] * 1e3:.1f} ms  (3 x forward + recompute)"),
        ("required write", f"{r['required_write_gbps']:.2f} GB/s per GPU  (offloaded / half the step)"),
        ("SSD write / read", f"{r['ssd_write_gbps']:.1f} / {r['ssd_read_gbps']:.1f} GB/s  "
                             f"(PCIe {r['pcie_gbps']:.0f} GB/s)"),
        ("bandwidth", "sufficient" if r["bandwidth_sufficient"] else
         f"INSUFFICIENT: step stretches to {r['step_seconds_with_offload'] * 1e3:.1f} ms"),
        ("SSD lifetime", f"{r['ssd_lifetime_years']:.2f} years of continuous training "
                         f"(write amplification {r['write_amplification']})"),
        ("max micro-batch", f"{r['max_micro_batch']} offloaded, "
                            f"{r['max_micro_batch_without_offload']} without offloading"),
    ]
    if r["model_state_bytes"] >= r["gpu_memory_bytes"]:
        rows.append(("note", f"model state ({_bytes(r['model_state_bytes'])}) exceeds GPU memory "
                             f"({_bytes(r['gpu_memory_bytes'])}): raise --tp"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        out.write(f"{k:<{width}}  {v}\n")


def run(args):
    if args.list:
        _print_catalogs(sys.stdout)
        return 0
    missing = [f"--{n}" for n in ("layers", "hidden", "heads", "seq") if getattr(args, n) is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (or use --list)")
    from ebbtide import model

    config = {
        "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq": args.seq,
        "batch": args.batch, "vocab": args.vocab, "arch": args.arch, "tp": args.tp, "sp": args.sp,
        "flash_attn": not args.no_flash_attn, "recompute": args.recompute, "dtype": args.dtype,
    }
    if args.ffn_hidden is not None:
        config["ffn_hidden"] = args.ffn_hidden
    if args.decoder_layers is not None:
        config["decoder_layers"] = args.decoder_layers
    report = model.plan(config, gpu=args.gpu, ssd=args.ssd, ssds=args.ssds, mfu=args.mfu,
                        write_amplification=args.write_amplification)
    if args.json:
        json.dump(_finite(report), sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        _print_report(report, sys.stdout)
    return 0
