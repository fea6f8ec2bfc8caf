"""pdcluster's engine side by side with vLLM, the peer every engine benchmark is measured against.

    python -m benchmarks.vs_vllm [--threads 2] [--rounds 3] [--device cpu|cuda] [--no-disagg] [--model DIR]
        [--json OUT]

Both engines serve the same random Llama, built with transformers from a config (hidden 512, 8 layers, 8 heads
over 4 KV heads, MLP 1376, the demo tokenizer's 8,826-token vocabulary, 4,096 positions; an fp32 checkpoint on
CPU, which vLLM computes in bf16, its CPU default; bf16 on CUDA), over their OpenAI HTTP API on loopback:

* one server each (`pdcluster serve`, vLLM's `vllm.entrypoints.openai.api_server`), both started once, loaded
  one at a time in interleaved rounds (pdcluster, vLLM, pdcluster, ...): served **decode tok/s** at batch 1 and
  16 (fresh 128-token prompts, 64 greedy tokens, EOS ignored; from SSE arrival times, prefill excluded, as
  served_vs_hf measures it) and **TTFT** of one streamed request with a fresh 512- and 2,048-token prompt (no
  prefix-cache hit). The idle server's CPU while the other is measured is reported (it shares the cores);
* then, unless `--no-disagg`, each engine disaggregated behind our router (`pdcluster up --prefill 1 --decode
  1`, and the same with `--engine vllm`), again one loaded at a time in interleaved rounds: **TTFT** and the
  **second token** through the router for 512- and 2,048-token prompts (threshold 64: both go prefill ->
  decode). Our router streams the prefill worker's first token before the KV moves; vLLM's decode worker
  produces the first token after it has read the KV, so the second token is the like-for-like figure.

Greedy token ids of the decode runs are compared across the engines (reported, not asserted: float paths
differ). Medians and [min-max] over the rounds. The vLLM interpreter is `$PDCLUSTER_VLLM_PYTHON` or the cached
environment (`scripts/setup.sh vllm`); without one that imports vllm the benchmark says so and exits 0. On CUDA
(scripts/gpu-bench.sh) both servers share the GPU at `--gpu-memory-utilization 0.4` each, and the
disaggregated part is left out (`pdcluster up --engine vllm` runs CPU workers). On CPU both engines get
`--threads` OpenMP threads, unpinned (`VLLM_CPU_OMP_THREADS_BIND=nobind`), and vLLM 1 GiB of KV.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.served_client import served_run
from pdcluster.worker.local import vllm_workers

ENGINES = ("pdcluster", "vllm")
SHAPE = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=4096, tokenizer_vocab_size=32000)
DECODE_PROMPT, DECODE_NEW = 128, 64
TTFT_LENS = (512, 2048)
MAX_LEN = 4096


def build_model(folder: Path, device: str) -> tuple[Path, int]:
    from pdcluster.worker.local.demo_model import build_demo_model

    path = build_demo_model(folder, **SHAPE, dtype="bfloat16" if device == "cuda" else "float32")
    return path, int(json.loads((path / "config.json").read_text())["vocab_size"])


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _vllm_env(threads: int, device: str) -> dict[str, str]:
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1"}
    if device == "cpu":
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   OMP_NUM_THREADS=str(threads))
    return env


def start(engine: str, model: Path, port: int, threads: int, device: str, log: Path) -> subprocess.Popen[bytes]:
    """One server of `engine` on `port` (its own session: stopped with its children)."""
    if engine == "pdcluster":
        cmd = [sys.executable, "-m", "pdcluster", "serve", "--model", str(model), "--port", str(port),
               "--threads", str(threads), "--max-batch-size", "16", "--max-batch-tokens", "4096",
               "--max-model-len", str(MAX_LEN), "--device", device, "--log-level", "warning"]
        env = dict(os.environ)
        if device == "cuda":
            cmd += ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.4"]
    else:
        cmd = [str(vllm_workers.vllm_python()), "-m", vllm_workers.VLLM_MODULE, "--model", str(model),
               "--port", str(port), "--max-model-len", str(MAX_LEN), "--max-num-seqs", "16",
               "--max-num-batched-tokens", "4096", "--disable-uvicorn-access-log"]
        env = _vllm_env(threads, device)
        if device == "cuda":
            cmd += ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.4"]
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def up(engine: str, model: Path, port: int, threads: int, log: Path) -> subprocess.Popen[bytes]:
    """`pdcluster up` with one prefill and one decode worker of `engine` behind our router."""
    cmd = [sys.executable, "-m", "pdcluster", "up", "--model", str(model), "--prefill", "1", "--decode", "1",
           "--port", str(port), "--threads", str(threads), "--disaggregation-threshold", "64",
           "--max-model-len", str(MAX_LEN), "--start-timeout", str(vllm_workers.START_TIMEOUT)]
    env = _vllm_env(threads, "cpu")
    if engine == "vllm":
        cmd += ["--engine", "vllm"]
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen[bytes], path: str, timeout: float = vllm_workers.START_TIMEOUT) -> None:
    """Until `url + path` answers 200 (for /cluster: with every worker healthy), or the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        try:
            r = httpx.get(url + path, timeout=5)
            if r.status_code == 200 and (path != "/cluster" or
                                         all(w["healthy"] for w in r.json()["prefill"] + r.json()["decode"])):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not ready within {timeout:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        freeze(proc.pid, False)  # a stopped process would hold SIGTERM until continued
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _tree(pid: int) -> dict[int, int]:
    """`pid` and every descendant -> CPU clock ticks spent (from /proc)."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d.name)], ticks[int(d.name)] = int(fields[1]), int(fields[11]) + int(fields[12])
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        out[p] = ticks.get(p, 0)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and every descendant."""
    return sum(_tree(pid).values()) / os.sysconf("SC_CLK_TCK")


def freeze(pid: int, frozen: bool) -> None:
    """SIGSTOP (SIGCONT) a server and all its processes: the server not being measured takes no CPU at all
    (an idle vLLM P/D pair polls UCX at ~0.5 core otherwise)."""
    for p in _tree(pid):
        try:
            os.kill(p, signal.SIGSTOP if frozen else signal.SIGCONT)
        except ProcessLookupError:
            pass


def prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def stream_times(url: str, prompt: list[int], new: int) -> list[float]:
    """Arrival times (s after sending) of each output token of one streamed greedy request."""
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                if "error" in ev:
                    raise RuntimeError(f"{url}: {ev['error']}")
                stamps += [time.perf_counter() - t0] * len(ev["choices"][0].get("token_ids") or [])
    if len(stamps) != new:
        raise RuntimeError(f"{url}: {len(stamps)} tokens, expected {new}")
    return stamps


def single_round(engine: str, port: int, rng: random.Random, vocab: int, ids: dict[str, Any]) -> dict[str, float]:
    """One round's figures of one server."""
    out: dict[str, float] = {}
    for batch in (1, 16):
        ps = prompts(rng, batch, DECODE_PROMPT, vocab)
        _, decode, got, _ = asyncio.run(served_run(port, ps, DECODE_NEW, True))
        out[f"decode_b{batch}_tok_s"] = decode
        ids.setdefault(f"b{batch}", {}).setdefault(engine, []).extend(got)  # rounds in order: aligned
    for n in TTFT_LENS:
        out[f"ttft_{n}_s"] = stream_times(f"http://127.0.0.1:{port}", prompts(rng, 1, n, vocab)[0], 2)[0]
    return out


def disagg_round(url: str, rng: random.Random, vocab: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for n in TTFT_LENS:
        stamps = stream_times(url, prompts(rng, 1, n, vocab)[0], 8)
        out[f"pd_ttft_{n}_s"], out[f"pd_second_{n}_s"] = stamps[0], stamps[1]
    return out


def interleaved(servers: dict[str, tuple[subprocess.Popen[bytes], Any]], rounds: int, seed: int,
                samples: dict[str, dict[str, list[float]]]) -> dict[str, list[float]]:
    """`rounds` rounds, each engine loaded in turn while the other is frozen (its CPU meanwhile is returned: 0).
    Round r gives both engines the same prompts (seeded by r), fresh in every round. `servers[e][1](rng)` runs
    one round (`None`: a warm-up request only)."""
    idle: dict[str, list[float]] = {e: [] for e in servers}
    for r in range(rounds):
        order = list(servers) if r % 2 == 0 else list(reversed(servers))
        for engine in order:
            for e, (p, _) in servers.items():
                freeze(p.pid, e != engine)
            servers[engine][1](None)  # a warm-up request after the thaw (timers, pools, probes catch up)
            others = {e: tree_cpu(p.pid) for e, (p, _) in servers.items() if e != engine}
            t0 = time.perf_counter()
            got = servers[engine][1](random.Random(seed * 1000 + r))
            wall = time.perf_counter() - t0
            for e, c in others.items():
                idle[e].append((tree_cpu(servers[e][0].pid) - c) / wall)
            for k, v in got.items():
                samples[engine].setdefault(k, []).append(v)
            print(f"round {r + 1} {engine}: " + ", ".join(f"{k} {v:.4g}" for k, v in got.items()), flush=True)
    for p, _ in servers.values():
        freeze(p.pid, False)
    return idle


def warm(url: str, vocab: int) -> dict[str, float]:
    """Each prompt length once and a short decode, unmeasured (first-use costs: compiles, connections)."""
    rng = random.Random(-1)
    for n in (16, *TTFT_LENS):
        stream_times(url, prompts(rng, 1, n, vocab)[0], 4)
    return {}


def thawed(url: str, proc: subprocess.Popen[bytes], vocab: int) -> dict[str, float]:
    """A router just thawed has missed its health polls while frozen and reports its workers unhealthy until the
    next poll: wait until its /cluster says every worker is healthy again, then warm up."""
    wait_ready(url, proc, "/cluster")
    return warm(url, vocab)


def summary(samples: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    rows = []
    for key in samples["pdcluster"]:
        row: dict[str, Any] = {"figure": key}
        for e in ENGINES:
            xs = samples[e].get(key, [])
            row[e] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None
        if row["pdcluster"] and row["vllm"]:
            row["ratio"] = row["pdcluster"]["median"] / row["vllm"]["median"]
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| figure | pdcluster median [min-max] | vLLM median [min-max] | pdcluster / vLLM |", "|---|---|---|---|"]
    for r in rows:
        scale, unit = (1.0, "tok/s") if r["figure"].endswith("tok_s") else (1000.0, "ms")

        def cell(d: dict[str, Any] | None, s: float = scale, u: str = unit) -> str:
            return "-" if d is None else f"{d['median'] * s:.4g} {u} [{d['min'] * s:.4g}-{d['max'] * s:.4g}]"
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        lines.append(f"| {r['figure']} | {cell(r['pdcluster'])} | {cell(r['vllm'])} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--no-disagg", action="store_true", help="only the single-server figures")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, help="serve this HF folder instead of building the random Llama")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    why = vllm_workers.missing_reason()
    if why is None and subprocess.run([str(vllm_workers.vllm_python()), "-c", "import vllm"],
                                      capture_output=True).returncode != 0:
        why = f"{vllm_workers.vllm_python()} cannot import vllm"
    if why:
        print(f"benchmarks.vs_vllm: skipped: {why}")
        return {"skipped": why}
    tmp = Path(tempfile.mkdtemp(prefix="vs-vllm-"))
    if a.model:
        model, vocab = a.model, int(json.loads((a.model / "config.json").read_text())["vocab_size"])
    else:
        model, vocab = build_model(tmp / "model", a.device)
    load = os.getloadavg()
    samples: dict[str, dict[str, list[float]]] = {e: {} for e in ENGINES}
    ids: dict[str, Any] = {}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        ports = {e: _port() for e in ENGINES}
        for e in ENGINES:  # one at a time: vLLM's start (compile, KV profiling) is not timed against ours
            procs[e] = start(e, model, ports[e], a.threads, a.device, tmp / f"{e}.log")
            wait_ready(f"http://127.0.0.1:{ports[e]}", procs[e], "/health")
        for e in ENGINES:
            warm(f"http://127.0.0.1:{ports[e]}", vocab)
        single = {e: (procs[e], lambda rng, e=e: warm(f"http://127.0.0.1:{ports[e]}", vocab) if rng is None
                      else single_round(e, ports[e], rng, vocab, ids)) for e in ENGINES}
        idle = interleaved(single, a.rounds, a.seed, samples)
        for e in ENGINES:
            stop(procs.pop(e))
        same = {b: sum(x == y for x, y in zip(v["pdcluster"], v["vllm"], strict=True)) / len(v["pdcluster"])
                for b, v in ids.items()}
        idle_pd: dict[str, list[float]] = {}
        if not a.no_disagg and a.device == "cpu":
            for e in ENGINES:
                procs[e] = up(e, model, ports[e], max(1, a.threads // 2), tmp / f"up-{e}.log")
                wait_ready(f"http://127.0.0.1:{ports[e]}", procs[e], "/cluster")
                warm(f"http://127.0.0.1:{ports[e]}", vocab)  # also the NIXL / KV-transfer connections
            pd = {e: (procs[e], lambda rng, e=e: thawed(f"http://127.0.0.1:{ports[e]}", procs[e], vocab)
                      if rng is None else disagg_round(f"http://127.0.0.1:{ports[e]}", rng, vocab)) for e in ENGINES}
            idle_pd = interleaved(pd, a.rounds, a.seed + 1, samples)
    finally:
        for p in procs.values():
            stop(p)
    rows = summary(samples)
    result = {"conditions": {"threads": a.threads, "rounds": a.rounds, "device": a.device, "vocab": vocab,
                             "loadavg_before": load, "loadavg_after": os.getloadavg(), "shape": SHAPE,
                             "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
              "rows": rows, "greedy_equal_fraction": same,
              "idle_cpu_of_the_other_server": {"single": idle, "disaggregated": idle_pd}, "samples": samples}
    print(table(rows))
    print(f"greedy ids equal across engines (fraction of requests): {same}; load {load} -> {os.getloadavg()}")
    print("idle server's CPU (cores) while the other was measured:",
          {k: {e: round(statistics.median(v), 2) for e, v in d.items() if v} for k, d in
           (("single", idle), ("disaggregated", idle_pd))})
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
