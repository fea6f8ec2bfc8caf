"""`pdcluster bench`: grid sweep of prompt x output lengths against any OpenAI-compatible URL.

Writes to --out: results.json (list of cells), results.csv, requests.jsonl (every request), meta.json
and heat maps (heatmap_<metric>.png); with --compare, ratio.json and ratio_<metric>.png (this run /
the other). Failures (bad URL, unreachable, HTTP errors, broken streams) are counted per cell and
summarised; the command exits 0 if anything succeeded, 1 if nothing did, 2 on bad arguments. A URL that
answers no completion at all (unreachable, or refusing the probe request) exits 1 and writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

from pdcluster.bench import heatmap, loadgen, replay
from pdcluster.bench.stats import CELL_FIELDS, RequestResult, parse_int_list, summarize_cell
from pdcluster.worker.api import cli_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="router or worker base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--prompt-lens", default=None, help="comma-separated prompt lengths in tokens")
    p.add_argument("--output-lens", default=None, help="comma-separated output lengths in tokens")
    replay.add_arguments(p)  # --trace FILE [--speedup X]: replay a trace instead of a grid
    p.add_argument("--requests", type=cli_args.positive_int, default=16, help="requests per cell (default 16)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=cli_args.positive_int, default=None, help="closed loop: requests in flight (default 4)")
    mode.add_argument("--rate", type=cli_args.positive_float, default=None, help="open loop: Poisson arrivals, requests/s")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--compare", type=Path, default=None,
                   help="another run's results.json (or its directory): draw this/other ratio maps")
    p.add_argument("--model", default=None, help="model name to send (default: first of GET /v1/models)")
    p.add_argument("--seed", type=cli_args.non_negative_int, default=0)
    p.add_argument("--timeout", type=cli_args.positive_float, default=300.0, help="per-request timeout, seconds")
    p.add_argument("--warmup", type=cli_args.non_negative_int, default=1, help="uncounted requests before the sweep")
    p.add_argument("--token-id-max", type=cli_args.positive_int, default=250,
                   help="prompt token ids are drawn from [5, this); keep below the vocabulary size")
    p.add_argument("--label", default="", help="a name for this run, shown in titles (e.g. colocated)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG heat maps")


def load_results(path: Path) -> list[dict]:
    path = path / "results.json" if path.is_dir() else path
    data = json.loads(path.read_text())
    if isinstance(data, dict):  # tolerate {"cells": [...]}
        data = data.get("cells", [])
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of cells")
    return data


def run_label(results: Path, given: str = "") -> str:
    """A run's name for titles: `given` (--label), else the label in its meta.json, else its folder's name
    (never "results.json", which names every run)."""
    folder = results if results.is_dir() else results.parent
    if given:
        return given
    try:
        label = json.loads((folder / "meta.json").read_text()).get("label")
    except (OSError, ValueError, AttributeError):
        label = None
    return label or folder.resolve().name


def write_csv(cells: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CELL_FIELDS, extrasaction="ignore")
        w.writeheader()
        for c in cells:
            row = dict(c)
            row["error_kinds"] = ";".join(f"{k}={v}" for k, v in c.get("error_kinds", {}).items())
            w.writerow(row)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:8.1f}"


def format_table(cells: list[dict]) -> str:
    head = f"{'prompt':>7} {'output':>7} {'ok/n':>9} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>8} {'out tok/s':>10}  errors"
    lines = [head + "   (times in ms)"]
    for c in cells:
        errs = ", ".join(f"{k}×{v}" for k, v in c["error_kinds"].items())
        tps = c["output_tokens_per_second"]
        lines.append(
            f"{c['prompt_len']:>7} {c['output_len']:>7} {c['completed']:>4}/{c['requests']:<4} "
            f"{_ms(c['ttft_p50']):>9} {_ms(c['ttft_p99']):>8} {_ms(c['tpot_p50']):>9} {_ms(c['tpot_p99']):>8} "
            f"{(tps or 0):>10.1f}  {errs}"
        )
    return "\n".join(lines)


class NotServing(Exception):
    """The URL answered no completion request at all (unreachable, or every request refused)."""


class _Progress:
    """tqdm when available and wanted; a silent stand-in otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True, leave=False)
            except ImportError:
                pass
        self.errors = 0

    def done(self, r: RequestResult) -> None:
        self.errors += not r.ok
        if self.bar:
            self.bar.update(1)
            if self.errors:
                self.bar.set_postfix(errors=self.errors)

    def describe(self, text: str) -> None:
        if self.bar:
            self.bar.set_description(text)

    def close(self) -> None:
        if self.bar:
            self.bar.close()


async def sweep(args, url: str, prompt_lens: list[int], output_lens: list[int], out: Path) -> tuple[list[dict], dict]:
    concurrency = args.concurrency or (256 if args.rate else 4)
    meta: dict = {"url": args.url, "mode": "open" if args.rate else "closed", "rate": args.rate,
                  "concurrency": None if args.rate else concurrency, "requests_per_cell": args.requests,
                  "seed": args.seed, "label": args.label, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    cells: list[dict] = []
    async with loadgen.make_client(concurrency, args.timeout) as client:
        model = args.model or await loadgen.discover_model(client, url)
        meta["model"] = model
        probe = await loadgen.probe_shape(client, url, model, min(args.timeout, 60.0))
        if probe.shape is None:
            # Nothing works: a measurement of a dead URL is not a measurement (no results, no heat map).
            raise NotServing(f"{probe.result.error}: {probe.result.detail}")
        meta["request_shape"] = probe.shape
        if not probe.shape["ids"]:
            print("bench: server rejects token-id prompts; using text prompts (lengths approximate)",
                  file=sys.stderr)
        rng = random.Random(args.seed)
        for _ in range(args.warmup):
            await loadgen.stream_one(client, url, loadgen.build_payload(16, 4, rng, probe.shape, model), args.timeout)
        total = len(prompt_lens) * len(output_lens) * args.requests
        progress = _Progress(total, enabled=not args.no_progress)
        out.mkdir(parents=True, exist_ok=True)  # only now: a URL that serves nothing leaves no folder behind
        reqlog = (out / "requests.jsonl").open("w")
        try:
            for pl in prompt_lens:
                for ol in output_lens:
                    progress.describe(f"prompt {pl} out {ol}")
                    ids_range = (5, max(6, args.token_id_max))
                    payloads = [loadgen.build_payload(pl, ol, rng, probe.shape, model, ids_range)
                                for _ in range(args.requests)]
                    results, wall = await loadgen.run_requests(
                        client, url, payloads, concurrency=None if args.rate else concurrency,
                        rate=args.rate, seed=args.seed, timeout=args.timeout, on_done=progress.done)
                    cell = summarize_cell(pl, ol, results, wall)
                    cells.append(cell)
                    for r in results:
                        reqlog.write(json.dumps({"prompt_len": pl, "output_len": ol, **r.to_json()}) + "\n")
                    # Write as we go: an interrupted long sweep still leaves usable results.
                    (out / "results.json").write_text(json.dumps(cells, indent=1))
        finally:
            reqlog.close()
            progress.close()
    return cells, meta


def run(args: argparse.Namespace) -> int:
    if args.trace is not None:
        return replay.run(args)
    try:
        if not args.prompt_lens or not args.output_lens:
            raise ValueError("--prompt-lens and --output-lens are required (or --trace FILE)")
        url = loadgen.completions_url(args.url)
        prompt_lens = parse_int_list(args.prompt_lens)
        output_lens = parse_int_list(args.output_lens)
        if args.requests < 1:
            raise ValueError("--requests must be >= 1")
        if args.concurrency is not None and args.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        if args.rate is not None and args.rate <= 0:
            raise ValueError("--rate must be > 0")
        other = load_results(args.compare) if args.compare else None
    except (ValueError, OSError) as e:
        print(f"pdcluster bench: {e}", file=sys.stderr)
        return 2
    out: Path = args.out
    try:
        cells, meta = asyncio.run(sweep(args, url, prompt_lens, output_lens, out))
    except NotServing as e:
        print(f"pdcluster bench: {args.url} is not serving completions ({e}); nothing written", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pdcluster bench: interrupted; partial results are in", out, file=sys.stderr)
        return 130
    (out / "results.json").write_text(json.dumps(cells, indent=1))
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    write_csv(cells, out / "results.csv")
    plots: list[Path] = []
    suffix = f" — {args.label}" if args.label else ""
    if not args.no_plots:
        plots += heatmap.plot_all(cells, out, "heatmap", suffix)
    if other is not None:
        ratios = heatmap.ratio_cells(cells, other)
        (out / "ratio.json").write_text(json.dumps(ratios, indent=1))
        if not args.no_plots:
            names = f" ({run_label(out, args.label)} / {run_label(args.compare)})"
            plots += heatmap.plot_all(ratios, out, "ratio", names, ratio=True)

    print(format_table(cells))
    n = sum(c["requests"] for c in cells)
    ok = sum(c["completed"] for c in cells)
    kinds: Counter[str] = Counter()
    for c in cells:
        kinds.update(c["error_kinds"])
    print(f"\n{ok}/{n} requests succeeded" + (f"; errors: {dict(kinds)}" if kinds else ""))
    print(f"wrote {out}/results.json, results.csv" + (f" and {len(plots)} heat maps" if plots else ""))
    return 0 if ok else 1
