"""`pdcluster serve` over HTTP vs the same engine in process vs Hugging Face `generate`, in one run.

    python -m benchmarks.served_vs_hf [--threads 2] [--batches 1,16] [--repeats 3] [--no-stream]
        [--client aiohttp|httpx] [--py-spy PATH] [--json out.json]

The model is engine_vs_hf's random ~56M Llama (fp32, CPU). The server is a real `pdcluster serve` subprocess
on 127.0.0.1 with `--threads N`; HF and an in-process LLMEngine (no HTTP, no event loop: what serving costs on top) run in
this process with the same N torch threads. Each repeat draws fresh
128-token prompts (so the server's prefix cache cannot help) and sends the same prompts to both: `batch`
concurrent /v1/completions requests (greedy, EOS ignored, exactly 64 new tokens) vs one `generate` call.

Reported per side: **whole-request tok/s** (batch x 64 / wall time from the first request sent to the last
response complete, prefill included) and **decode tok/s** (batch x 63 / (last token - every request has its
first token), from SSE arrival times on our side, from a timestamping streamer on HF's). The served token
ids are checked against HF's (greedy must be identical). The **roofline** is the weight-streaming bound of
a batch-1 decode step: bytes of every weight a step reads (all but the embedding table) / a read bandwidth
measured in this run with the same thread count (best of a few sums over a 512 MiB buffer). Beside it, the
**matmul floor**: the step's matrix-vector products alone (the engine's own weights, one row), timed in the
same run, says how much of the roofline the BLAS library reaches before any attention, norm or serving work.
The client runs on the same cores as the server (a deployment's clients do not), so every CPU second it
spends is taken from the served step: it is aiohttp (C HTTP parser) by default, and its CPU per decode step is
reported beside the figures (`--client httpx`: httpx, ~3.5x the CPU, the client of earlier runs).
With `--py-spy PATH` (a py-spy binary) the served process is sampled during the runs and the top functions
are printed (where the served step spends its time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.engine_vs_hf import MODEL, _Clock, workload_arguments
from benchmarks.served_client import served_run


def read_bandwidth(threads: int, mib: int = 512, tries: int = 5) -> float:
    """Bytes/s of a streaming read (torch sum over a buffer far larger than the caches), best of `tries`."""
    torch.set_num_threads(threads)
    buf = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    buf.sum()  # fault the pages in
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def matmul_floor(engine: Any, tries: int = 9) -> float:
    """Seconds of a batch-1 step's matrix-vector products alone (every projection of the engine's model, as it
    stores them: MKL's Linear or the native packed kernel, one row each), median of `tries`: the part of the
    roofline the matmul library can reach."""
    from pdcluster.worker.engine.cpu_linear import PackedLinear  # the native kernel's projections count too

    lins = [m for m in engine.runner.model.modules() if isinstance(m, torch.nn.Linear | PackedLinear)]
    xs = [torch.randn(1, m.in_features) for m in lins]
    times = []
    with torch.inference_mode():
        for _ in range(tries):
            t0 = time.perf_counter()
            for x, m in zip(xs, lins, strict=True):
                m(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_bytes(model: Any) -> int:
    """Bytes a batch-1 decode step streams: every weight but the input embedding (a lookup of one row)."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(folder: Path, port: int, threads: int, extra: list[str],
                 env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pdcluster.cli", "serve", "--model", str(folder), "--port", str(port),
           "--threads", str(threads), "--max-batch-size", "16", "--max-batch-tokens", "4096",
           "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=None if env is None else {**os.environ, **env})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy in 300 s")


def hf_run(model: Any, prompts: list[list[int]], new: int) -> tuple[float, float, list[list[int]]]:
    ids = torch.tensor(prompts)
    clock = _Clock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, streamer=clock)
    wall = time.perf_counter() - t0
    b = len(prompts)
    return b * new / wall, b * (new - 1) / (clock.times[-1] - clock.times[1]), out[:, ids.shape[1]:].tolist()


def check_tokens(hf: Any, prompts: list[list[int]], hids: list[list[int]], sides: dict[str, list[list[int]]],
                 new: int) -> int:
    """Every side's greedy tokens equal HF's. A request where they differ from HF's *batched* generate is
    checked against HF generating that prompt alone (the oracle of the equality tests): batched, HF's GEMMs
    round differently and can flip a near-tie on their own. Returns how many requests that excused; any other
    difference raises."""
    flips = 0
    for i, want in enumerate(hids):
        if all(ids[i] == want for ids in sides.values()):
            continue
        alone = hf_run(hf, [prompts[i]], new)[2][0]
        wrong = [name for name, ids in sides.items() if ids[i] != alone]
        if wrong:
            raise AssertionError(f"request {i}: {', '.join(wrong)} greedy tokens differ from HF generate (batched "
                                 "and alone)")
        flips += alone != want
    return flips


def engine_run(engine: Any, prompts: list[list[int]], new: int) -> tuple[float, float, list[list[int]]]:
    """The same requests through an in-process LLMEngine (no HTTP, no event loop): what serving costs on top."""
    from pdcluster.worker.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [f"inproc-{t0}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    first = last = 0.0
    while engine.has_unfinished():
        outs = engine.step()
        last = time.perf_counter()
        for out in outs:
            got[out.request_id].extend(out.new_token_ids)
        if not first and all(got.values()):
            first = last
    b = len(prompts)
    return b * new / (last - t0), b * (new - 1) / (last - first), [got[rid] for rid in ids]


def _row(samples: dict[str, list[float]]) -> dict[str, Any]:
    row: dict[str, Any] = {f"{k}_median": round(statistics.median(v), 1) for k, v in samples.items()}
    for kind in ("whole", "decode"):
        s, h, e = samples[f"served_{kind}"], samples[f"hf_{kind}"], samples[f"engine_{kind}"]
        row[f"{kind}_ratio_paired_median"] = round(statistics.median(a / b for a, b in zip(s, h, strict=True)), 2)
        row[f"{kind}_engine_hf_paired_median"] = round(statistics.median(a / b for a, b in zip(e, h, strict=True)), 2)
        if f"served_off_{kind}" in samples:  # the same server with the native kernels off, same prompts
            off = samples[f"served_off_{kind}"]
            row[f"{kind}_off_hf_paired_median"] = round(statistics.median(a / b for a, b in zip(off, h, strict=True)), 2)
            row[f"{kind}_on_off_paired_median"] = round(statistics.median(a / b for a, b in zip(s, off, strict=True)), 2)
    row["samples"] = {k: [round(x, 1) for x in v] for k, v in samples.items()}
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(ap)
    ap.add_argument("--no-stream", action="store_true", help="non-streamed requests (no decode tok/s)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `pdcluster serve` argument")
    ap.add_argument("--native-off-too", action="store_true",
                    help="also serve with PDCLUSTER_NATIVE_KERNELS=0 (a second server) and compare, interleaved")
    ap.add_argument("--off-env", default="PDCLUSTER_NATIVE_KERNELS=0",
                    help="NAME=VALUE[,NAME=VALUE...] the second server runs with (e.g. PDCLUSTER_NATIVE_KERNELS=-linear: "
                         "only the linear off; a value may hold commas: -linear,-screen)")
    ap.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp",
                    help="the load-generating HTTP client (it runs on the server's cores; its CPU is reported)")
    ap.add_argument("--py-spy", metavar="PATH", help="sample the served process with this py-spy binary")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from transformers import LlamaForCausalLM

    from pdcluster.worker.local.demo_model import build_demo_model

    stream = not a.no_stream
    with tempfile.TemporaryDirectory(prefix="pdc-served-") as tmp:
        folder = build_demo_model(Path(tmp), **MODEL)
        hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine

        engine = LLMEngine(EngineConfig(model=str(folder), max_batch_size=16, max_batch_tokens=4096,
                                        num_threads=a.threads))
        port = _free_port()
        server = start_server(folder, port, a.threads, a.server_arg)
        port_off = _free_port() if a.native_off_too else None
        off_env: dict[str, str] = {}
        for item in filter(None, a.off_env.split(",")):  # an item without "=" continues the last value
            if "=" in item or not off_env:
                name, _, value = item.partition("=")
                off_env[name] = value
            else:
                off_env[name] += "," + item
        server_off = start_server(folder, port_off, a.threads, a.server_arg, off_env) if port_off else None
        results: dict[str, Any] = {}
        try:
            results.update(_measure(a, hf, engine, port, stream, port_off))
            if a.py_spy:
                results["profile"] = _profile(a, port, stream, server.pid, Path(tmp) / "spy.txt")
                print(results["profile"])
        finally:
            for proc in (server, server_off):
                if proc is not None:
                    proc.terminate()
                    proc.wait(timeout=60)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return results


def _measure(a: argparse.Namespace, hf: Any, engine: Any, port: int, stream: bool,
             port_off: int | None = None) -> dict[str, Any]:
    params_m = sum(p.numel() for p in hf.parameters()) / 1e6
    bw = read_bandwidth(a.threads)
    roofline = bw / step_bytes(hf)  # batch-1 decode steps (tokens) per second at full read bandwidth
    floor = matmul_floor(engine)
    print(f"model: {params_m:.1f}M params, fp32, {a.threads} threads, prompt {a.prompt_len}, {a.new_tokens} new, "
          f"{'streamed' if stream else 'non-streamed'}; read bandwidth {bw / 1e9:.1f} GB/s, "
          f"batch-1 roofline {roofline:.1f} tok/s ({step_bytes(hf) / 1e6:.0f} MB per step); the step's "
          f"matmuls alone {floor * 1e3:.1f} ms = {1 / floor:.1f} tok/s = {100 / floor / roofline:.1f} % of roofline "
          f"({step_bytes(hf) / floor / 1e9:.1f} GB/s)")
    results: dict[str, Any] = {"params_m": round(params_m, 1), "threads": a.threads, "stream": stream,
                               "read_gb_s": round(bw / 1e9, 2), "roofline_tok_s": round(roofline, 1),
                               "matmul_floor_ms": round(floor * 1e3, 2),
                               "matmul_floor_pct_roofline": round(100 / floor / roofline, 1),
                               "load_avg": os.getloadavg()[0], "batches": {}}
    g = torch.Generator().manual_seed(0)
    for batch in (int(b) for b in a.batches.split(",")):
        warm = torch.randint(10, 32000, (batch, a.prompt_len), generator=g).tolist()
        asyncio.run(served_run(port, warm, 4, stream, a.client)), hf_run(hf, warm, 4), engine_run(engine, warm, 4)
        sides = ("served", "engine", "hf") + (("served_off",) if port_off else ())
        if port_off:
            asyncio.run(served_run(port_off, warm, 4, stream, a.client))
        samples: dict[str, list[float]] = {f"{side}_{kind}": [] for kind in ("whole", "decode") for side in sides}
        cpu_ms: list[float] = []  # the client's CPU per decode step (all `batch` streams), ms
        hf_flips = 0
        for _ in range(a.repeats):  # interleaved, so both sides see the same background load
            prompts = torch.randint(10, 32000, (batch, a.prompt_len), generator=g).tolist()
            sw, sd, sids, client_cpu = asyncio.run(served_run(port, prompts, a.new_tokens, stream, a.client))
            cpu_ms.append(1e3 * client_cpu / a.new_tokens)
            hw, hd, hids = hf_run(hf, prompts, a.new_tokens)
            ew, ed, eids = engine_run(engine, prompts, a.new_tokens)
            hf_flips += check_tokens(hf, prompts, hids, {"served": sids, "in-process": eids}, a.new_tokens)
            if port_off:
                ow, od, oids, _ = asyncio.run(served_run(port_off, prompts, a.new_tokens, stream, a.client))
                hf_flips += check_tokens(hf, prompts, hids, {"served (off)": oids}, a.new_tokens)
                samples["served_off_whole"].append(ow)
                samples["served_off_decode"].append(od)
            for k, v in (("served_whole", sw), ("hf_whole", hw), ("served_decode", sd), ("hf_decode", hd),
                         ("engine_whole", ew), ("engine_decode", ed)):
                samples[k].append(v)
        row = _row(samples)
        row["client"] = a.client
        row["client_cpu_ms_per_step_median"] = round(statistics.median(cpu_ms), 2)
        row["hf_batched_flips"] = hf_flips
        if batch == 1 and stream:
            row["served_decode_pct_roofline"] = round(100 * row["served_decode_median"] / roofline, 1)
            row["hf_decode_pct_roofline"] = round(100 * row["hf_decode_median"] / roofline, 1)
            if port_off:
                row["served_off_decode_pct_roofline"] = round(100 * row["served_off_decode_median"] / roofline, 1)
        results["batches"][batch] = row
        print(f"batch {batch:>3}: whole-request tok/s served {row['served_whole_median']:.1f} | in-process "
              f"{row['engine_whole_median']:.1f} | HF {row['hf_whole_median']:.1f} | served/HF "
              f"{row['whole_ratio_paired_median']:.2f}x (in-process/HF {row['whole_engine_hf_paired_median']:.2f}x);  "
              f"decode tok/s served {row['served_decode_median']:.1f} | in-process {row['engine_decode_median']:.1f} | "
              f"HF {row['hf_decode_median']:.1f} | served/HF {row['decode_ratio_paired_median']:.2f}x (in-process/HF "
              f"{row['decode_engine_hf_paired_median']:.2f}x)"
              + (f"; served {row['served_decode_pct_roofline']}% / HF {row['hf_decode_pct_roofline']}% of roofline"
                 if "served_decode_pct_roofline" in row else "")
              + (f"; native off: served {row['served_off_decode_median']:.1f} decode tok/s, off/HF "
                 f"{row['decode_off_hf_paired_median']:.2f}x, on/off {row['decode_on_off_paired_median']:.2f}x"
                 if port_off else "")
              + f" | {a.client} client CPU {row['client_cpu_ms_per_step_median']:.2f} ms a step"
              + (f" | HF's batched generate flipped {hf_flips} request(s) against HF alone" if hf_flips else "")
              + f" | {row['samples']}")
    return results


def _profile(a: argparse.Namespace, port: int, stream: bool, pid: int, out: Path) -> str:
    """Sample the served process (every thread; py-spy cannot take native frames without pausing it) while it
    serves batch 1 then batch 16 alone."""
    spy = subprocess.Popen([a.py_spy, "record", "--pid", str(pid), "--format", "raw", "--threads",
                            "--nonblocking", "-r", "250", "-o", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(2)  # attached
        g = torch.Generator().manual_seed(1)
        for batch in (1, 1, 16):
            prompts = torch.randint(10, 32000, (batch, a.prompt_len), generator=g).tolist()
            asyncio.run(served_run(port, prompts, a.new_tokens, stream, a.client))
    finally:
        spy.send_signal(2)  # SIGINT: py-spy writes its file and exits
        spy.wait(timeout=60)
    return _spy_table(out)


def _spy_table(path: Path, top: int = 25) -> str:
    """Self time by function over every thread of the served process, from py-spy's raw (collapsed) output."""
    if not path.exists():
        return "(py-spy wrote nothing)"
    self_time: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    by_thread: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        n = int(count)
        total += n
        by_thread[frames[0]] = by_thread.get(frames[0], 0) + n
        self_time[frames[-1]] = self_time.get(frames[-1], 0) + n
        for f in {re.sub(r":\d+\)$", ")", f) for f in frames[1:] if " (" in f and ".py" in f}:
            inclusive[f] = inclusive.get(f, 0) + n
    lines = [f"py-spy: {total} samples of the served process", "by thread:"]
    lines += [f"  {100 * n / total:5.1f}%  {t}" for t, n in sorted(by_thread.items(), key=lambda x: -x[1])[:8]]
    lines.append("inclusive time, Python functions:")
    lines += [f"  {100 * n / total:5.1f}%  {f[:150]}" for f, n in sorted(inclusive.items(), key=lambda x: -x[1])[:top]]
    lines.append("self time by function:")
    lines += [f"  {100 * n / total:5.1f}%  {f[:150]}" for f, n in sorted(self_time.items(), key=lambda x: -x[1])[:top]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
