"""Recompute-offload-keep (ROK) curves: for each micro-batch size, train a few
steps keeping all activations, offloading them with ebbtide, and recomputing
them (full activation checkpointing), and plot model throughput against the
step's peak memory. Built on the demo harness (ebbtide.harness.demo)."""
from ebbtide.harness.demo import run_demo
from ebbtide.harness.models import DEFAULT_MODEL

ROK_METHODS = {"keep": "none", "offload": "ebbtide-ssd", "recompute": "recompute"}


def run_rok(model=DEFAULT_MODEL, batches=(1, 2, 4, 8), steps=2, warmup=1, device=None, dtype="fp32",
            path=None, log=print, progress=None, **size):
    """Runs the demo's keep / offload / recompute methods per micro-batch size;
    returns the config and one point per (strategy, batch). `progress` (an
    ebbtide._progress.Progress) advances once per round of every run."""
    if not batches:
        raise ValueError("--batch: give at least one micro-batch size")
    for b in batches:
        if b <= 0:
            raise ValueError(f"--batch: micro-batch sizes must be positive, got {b}")
    points = []
    result = None
    for b in batches:
        if progress is None:
            log(f"[rok] micro-batch {b}")
        else:
            progress.prefix = f"micro-batch {b}: "
        result = run_demo(model=model, methods=tuple(ROK_METHODS.values()), steps=steps,
                          warmup=warmup, batch=b, device=device, dtype=dtype, path=path,
                          log=log, progress=progress, **size)
        by_method = {r["method"]: r for r in result["rows"]}
        for label, method in ROK_METHODS.items():
            r = by_method[method]
            points.append(dict(strategy=label, batch=b, step_seconds=r["step_seconds"],
                               tokens_per_second=r["tokens_per_second"],
                               peak_bytes=r["peak_bytes"], max_grad_diff=r["max_grad_diff"]))
    cfg = {k: result[k] for k in ("model", "device", "dtype", "layers", "hidden", "heads", "seq")}
    return dict(cfg, batches=list(batches), steps=steps, points=points)


def format_table(result):
    from ebbtide import _core

    lines = [f"ebbtide rok: {result['model']} layers={result['layers']} hidden={result['hidden']} "
             f"seq={result['seq']} {result['dtype']} on {result['device']}",
             f"{'strategy':<11}{'batch':>6}{'step s':>9}{'tokens/s':>11}{'peak mem':>12}"]
    for p in result["points"]:
        lines.append(f"{p['strategy']:<11}{p['batch']:>6}{p['step_seconds']:>9.3f}"
                     f"{p['tokens_per_second']:>11.0f}{_core.format_bytes(p['peak_bytes']):>12}")
    return "\n".join(lines)


def plot(result, png_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for strategy in ROK_METHODS:
        pts = [p for p in result["points"] if p["strategy"] == strategy]
        xs = [p["peak_bytes"] / 2**20 for p in pts]
        ys = [p["tokens_per_second"] for p in pts]
        ax.plot(xs, ys, marker="o", label=strategy)
        for p, x, y in zip(pts, xs, ys):
            ax.annotate(f"{strategy} b={p['batch']}", (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
    ax.set_xlabel("activation peak: peak step memory (MiB)")
    ax.set_ylabel("model throughput (tokens/s)")
    ax.set_title(f"ROK curve: {result['model']} seq={result['seq']} on {result['device']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
