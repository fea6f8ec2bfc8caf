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
