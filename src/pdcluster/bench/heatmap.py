"""Heat maps of a grid sweep: prompt length on x, output length on y, colour = a metric.

One picture shows where a deployment is good and where it breaks (e.g. TTFT exploding for long prompts
on a colocated worker while decode steps stall). `ratio` maps compare two runs cell by cell; the colour
scale is centred on 1.0 so "better" and "worse" read at a glance. Cells and colour bars share a unit: ms for
latencies, tok/s for throughput, × for ratios.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# metric -> (title, unit drawn, higher_is_better, scale from results.json's unit to the drawn one).
# Latencies are stored in seconds and drawn in ms, so the cells and the colour bar read in the same unit.
METRICS: dict[str, tuple[str, str, bool, float]] = {
    "ttft_p50": ("TTFT p50", "ms", False, 1000.0),
    "ttft_p99": ("TTFT p99", "ms", False, 1000.0),
    "tpot_p50": ("TPOT p50", "ms", False, 1000.0),
    "tpot_p99": ("TPOT p99", "ms", False, 1000.0),
    "output_tokens_per_second": ("output tokens/s", "tok/s", True, 1.0),
}


def grid(cells: Sequence[dict], key: str) -> tuple[list[int], list[int], list[list[float]]]:
    """(prompt lengths, output lengths, values[y][x]) with NaN where a cell is missing or empty."""
    xs = sorted({int(c["prompt_len"]) for c in cells})
    ys = sorted({int(c["output_len"]) for c in cells})
    vals = [[math.nan] * len(xs) for _ in ys]
    for c in cells:
        v = c.get(key)
        if v is None:
            continue
        vals[ys.index(int(c["output_len"]))][xs.index(int(c["prompt_len"]))] = float(v)
    return xs, ys, vals


def ratio_cells(a: Sequence[dict], b: Sequence[dict], keys: Sequence[str] = tuple(METRICS)) -> list[dict]:
    """Cell-wise a/b for each key over the cells both runs have; None where either side is missing/0."""
    index = {(c["prompt_len"], c["output_len"]): c for c in b}
    out = []
    for c in a:
        other = index.get((c["prompt_len"], c["output_len"]))
        if other is None:
            continue
        row = {"prompt_len": c["prompt_len"], "output_len": c["output_len"]}
        for k in keys:
            x, y = c.get(k), other.get(k)
            row[k] = (x / y) if (x is not None and y not in (None, 0)) else None
        out.append(row)
    return out


def cell_text(v: float, unit: str) -> str:
    """A cell's label, in the unit of the colour bar ("×" for ratios)."""
    if math.isnan(v):
        return "–"
    if unit == "×":
        return f"{v:.2f}×"
    if unit == "ms":
        return f"{v:.1f}ms" if v < 10 else f"{v:.0f}ms"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}"


def figure(cells: Sequence[dict], key: str, title: str = "", ratio: bool = False) -> Any:
    """One heat map as a matplotlib Figure. `ratio`: values are a/b ratios, drawn on a diverging scale
    around 1; otherwise values are drawn in METRICS' unit (ms for latencies), cells and colour bar alike."""
    import matplotlib

    matplotlib.use("Agg")  # headless: CI and pods have no display
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm, TwoSlopeNorm

    xs, ys, vals = grid(cells, key)
    name, unit, higher_better, scale = METRICS.get(key, (key, "", False, 1.0))
    if ratio:
        unit = "×"
    else:
        vals = [[v * scale for v in row] for row in vals]
    finite = [v for row in vals for v in row if not math.isnan(v)]
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(xs), 1.0 + 0.8 * len(ys)), dpi=100)
    norm: Any
    if ratio:
        lo, hi = (min(finite), max(finite)) if finite else (0.5, 2.0)
        # Diverging around 1.0; for latency a ratio > 1 (a slower than b) is red, for throughput blue.
        norm = TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 0.99), vmax=max(hi, 1.01))
        cmap = "RdBu" if higher_better else "RdBu_r"
        label = f"{name} ratio (×)"
    else:
        positive = [v for v in finite if v > 0]
        # Latency spans orders of magnitude across a grid; a log scale keeps both ends readable.
        use_log = len(positive) == len(finite) and positive and max(positive) / min(positive) > 20
        norm = LogNorm(min(positive), max(positive)) if use_log else None
        cmap = "viridis" if higher_better else "magma_r"
        label = f"{name} ({unit})"
    im = ax.imshow(vals, origin="lower", aspect="auto", cmap=cmap, norm=norm)
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])
    ax.set_yticks(range(len(ys)), [str(y) for y in ys])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("output length (tokens)")
    ax.set_title(title or label, fontsize=10)
    for yi, row in enumerate(vals):
        for xi, v in enumerate(row):
            ax.text(xi, yi, cell_text(v, unit), ha="center",
                    va="center", fontsize=8, color="black",
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "alpha": 0.6, "lw": 0})
    fig.colorbar(im, ax=ax, label=label)
    fig.tight_layout()
    return fig


def plot(cells: Sequence[dict], key: str, path: Path, title: str = "", ratio: bool = False) -> Path:
    """Write one heat map PNG (see `figure`)."""
    import matplotlib.pyplot as plt

    fig = figure(cells, key, title, ratio)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_all(cells: Sequence[dict], out: Path, prefix: str = "heatmap", title_suffix: str = "",
             ratio: bool = False) -> list[Path]:
    paths = []
    for key, (name, *_) in METRICS.items():
        if not any(c.get(key) is not None for c in cells):
            continue  # nothing measured (e.g. every request failed): no empty picture
        title = f"{name}{' ratio' if ratio else ''}{title_suffix}"
        paths.append(plot(cells, key, out / f"{prefix}_{key}.png", title=title, ratio=ratio))
    return paths
