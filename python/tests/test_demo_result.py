"""The demo says its result (issue 41, part 3): one line per method against
no offload, with the spread of the per-step time ratios; one peak figure per
row; a plot whose labels do not overlap."""
import itertools
import statistics

import pytest

pytest.importorskip("matplotlib")

from ebbtide.harness.demo import figure, format_table, verdict  # noqa: E402

METHODS = ["none", "ebbtide-ssd", "ebbtide-cpu", "recompute", "save_on_cpu"]


def row(method, times, peak, base_times=(1.0, 1.0, 1.0), base_peak=1000):
    ratios = [t / b for t, b in zip(times, base_times)]
    median = statistics.median
    return dict(method=method, status="ok", step_seconds=median(times), step_seconds_per_step=times,
                step_time_ratios=ratios, peak_bytes=peak, peak_ratio=peak / base_peak, tokens_per_second=1000 / times[0],
                bytes_written=0, max_grad_diff=0.0, step_time_ratio=median(times) / median(base_times), stats={})


def test_a_ratio_whose_spread_contains_one_is_within_noise():
    text = verdict(row("ebbtide-ssd", [0.95, 1.02, 1.09], 480), "cpu")
    assert text == ("ebbtide-ssd: 52% less peak step memory at step time within this run's noise "
                    "(1.02x; per step 0.95-1.09x over 3 steps)"), text


def test_a_ratio_outside_its_spread_is_a_percentage():
    text = verdict(row("recompute", [1.30, 1.35, 1.28], 600), "cuda:0")
    assert text == "recompute: 40% less peak step memory at +30% step time (per step 1.28-1.35x over 3 steps)", text
    # the headline is the table's ratio of medians, the spread that of the rounds
    text = verdict(row("recompute", [1.30, 1.35, 1.28], 600, base_times=(0.9, 1.0, 1.1)), "cuda:0")
    assert "+30% step time (per step 1.16-1.44x over 3 steps)" in text, text
    assert verdict(row("ebbtide-ssd", [0.8, 0.9, 0.85], 1100), "cpu").startswith(
        "ebbtide-ssd: 10% more peak step memory at -15% step time")


def test_host_copies_on_the_cpu_say_they_cannot_lower_memory():
    text = verdict(row("save_on_cpu", [1.1, 1.2, 1.15], 1000), "cpu")
    assert text.startswith("save_on_cpu: no less memory on the CPU"), text


def test_one_step_has_no_spread():
    assert verdict(row("recompute", [1.3], 600, base_times=(1.0,)), "cpu").endswith(
        "+30% step time (1 step: no spread measured)")


def result_of(rows):
    r = dict(model="llama", layers=2, hidden=64, heads=4, seq=64, batch=2, dtype="fp32", device="cpu", steps=3,
             warmup=1, rows=rows)
    for x in rows[1:]:
        x["verdict"] = verdict(x, "cpu")
    return r


def sample_rows():
    # On the CPU no offload, ebbtide-cpu and save_on_cpu land on one point.
    return [row("none", [1.0, 1.0, 1.0], 1000), row("ebbtide-ssd", [1.05, 0.97, 1.1], 500),
            row("ebbtide-cpu", [1.0, 1.0, 1.0], 1000), row("recompute", [1.3, 1.3, 1.3], 600),
            row("save_on_cpu", [1.0, 1.0, 1.0], 1000)]


def test_the_table_ends_with_one_result_line_per_method_and_one_peak_per_row():
    text = format_table(result_of(sample_rows()))
    lines = text.splitlines()
    i = lines.index("result, against no offload:")
    assert [line.split(":")[0].strip() for line in lines[i + 1:]] == METHODS[1:], text
    assert "peak resident" not in text


def test_the_plot_labels_do_not_overlap():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(result_of(sample_rows()))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        legend = ax.get_legend()
        assert [t.get_text() for t in legend.get_texts()] == METHODS
        assert not ax.texts  # no label is drawn next to a point
        texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *legend.get_texts()]
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts if t.get_text()]
        for (a, ba), (b, bb) in itertools.combinations(boxes, 2):
            assert not ba.overlaps(bb), (a, b)
        # the legend lies within the figure
        fb = fig.bbox
        lb = legend.get_window_extent(renderer)
        assert fb.x0 <= lb.x0 and lb.x1 <= fb.x1 and fb.y0 <= lb.y0 and lb.y1 <= fb.y1, (lb, fb)
    finally:
        plt.close(fig)
