import math

from pdcluster.bench import heatmap


def cell(p, o, **kw):
    return {"prompt_len": p, "output_len": o, **kw}


def test_grid_orders_axes_and_marks_missing_cells_nan():
    cells = [cell(512, 8, ttft_p50=2.0), cell(128, 8, ttft_p50=1.0), cell(128, 64, ttft_p50=None)]
    xs, ys, vals = heatmap.grid(cells, "ttft_p50")
    assert xs == [128, 512] and ys == [8, 64]
    assert vals[0] == [1.0, 2.0] and all(math.isnan(v) for v in vals[1])


def test_ratio_cells_only_where_both_have_values():
    a = [cell(1, 1, ttft_p50=2.0, tpot_p50=1.0), cell(2, 1, ttft_p50=1.0, tpot_p50=None)]
    b = [cell(1, 1, ttft_p50=4.0, tpot_p50=0.0), cell(2, 1, ttft_p50=2.0, tpot_p50=1.0), cell(3, 3, ttft_p50=1.0)]
    r = heatmap.ratio_cells(a, b, keys=["ttft_p50", "tpot_p50"])
    assert r == [cell(1, 1, ttft_p50=0.5, tpot_p50=None), cell(2, 1, ttft_p50=0.5, tpot_p50=None)]


def test_plot_writes_pngs_and_skips_empty_metrics(tmp_path):
    cells = [cell(p, o, ttft_p50=0.001 * p * o, output_tokens_per_second=None) for p in (8, 64, 512) for o in (4, 32)]
    paths = heatmap.plot_all(cells, tmp_path)
    assert [p.name for p in paths] == ["heatmap_ttft_p50.png"]
    r = heatmap.plot(cells, "ttft_p50", tmp_path / "r.png", ratio=True)
    assert r.stat().st_size > 1000


def _colorbar(fig):
    ax = fig.axes[-1]  # the colour bar's axes come last
    return ax.get_ylabel(), ax.get_ylim()


def test_latency_cells_and_colour_bar_are_both_in_ms():
    cells = [cell(p, o, ttft_p50=0.001 * p * o) for p in (8, 64) for o in (4, 32)]  # 32 ms .. 2.048 s
    fig = heatmap.figure(cells, "ttft_p50")
    label, (lo, hi) = _colorbar(fig)
    assert label == "TTFT p50 (ms)" and (round(lo), round(hi)) == (32, 2048)  # not 0.032 .. 2.048 "s"
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert texts == {"32ms", "256ms", "2048ms"}


def test_throughput_and_ratio_colour_bars_name_their_unit():
    cells = [cell(p, 4, output_tokens_per_second=100.0 * p, tpot_p50=0.5 * p) for p in (1, 2)]
    assert _colorbar(heatmap.figure(cells, "output_tokens_per_second"))[0] == "output tokens/s (tok/s)"
    fig = heatmap.figure(cells, "tpot_p50", ratio=True)  # values are ratios: never scaled to ms
    assert _colorbar(fig)[0] == "TPOT p50 ratio (×)"
    assert {t.get_text() for t in fig.axes[0].texts} == {"0.50×", "1.00×"}
