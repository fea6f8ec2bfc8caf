"""End-to-end latency of a long prompt through router -> prefill -> KV transfer -> decode, per transfer backend.

    python -m benchmarks.disagg_ttft [--prompt-len 2048] [--requests 5] [--backends tcp,nixl] [--json OUT]

A backend may say `+fabric` (`tcp+fabric`, `nixl+fabric`): its workers run `--kv-transfer-integrity fabric`.

For each backend, `pdcluster up --prefill 1 --decode 1 --kv-transfer-backend B` (router and workers as their own
processes on loopback) serves a random Llama shaped like the `up` demo model but with 4,096 positions, and
streams `--requests` completions of a `--prompt-len`-token prompt (different prompts: no prefix-cache hits),
one at a time, 8 new tokens each. Client-side, per request:
  * TTFT: the first token, which the router streams as soon as the prefill worker has it (before the KV moves);
  * second token: what the KV transfer delays (the decode worker starts once every layer is in);
  * whole request.
Medians over the requests, after one warm-up request per backend. Both backends run in the same process one
after the other, with the same model and prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pdcluster.worker.transfer.secret import internal_headers

NEW_TOKENS = 8


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_model(folder: Path) -> Path:
    from pdcluster.worker.local.demo_model import build_demo_model

    # the `up` demo model's shape (launcher.ensure_demo_model), with room for a 2,048-token prompt and its output
    return build_demo_model(folder, num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=8,
                            num_key_value_heads=4, max_position_embeddings=4096)


def prompts(n: int, length: int, vocab: int = 1000) -> list[list[int]]:
    return [[(97 * r + 31 * i + 7) % vocab + 3 for i in range(length)] for r in range(n)]


def one(client: httpx.Client, prompt: list[int]) -> dict[str, float]:
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if "error" in d:
                raise RuntimeError(str(d["error"]))
            for _ in d["choices"][0].get("token_ids") or []:
                stamps.append(time.perf_counter() - t0)
    if len(stamps) < 2:
        raise RuntimeError(f"expected {NEW_TOKENS} tokens, got {len(stamps)}")
    return {"ttft_s": stamps[0], "second_token_s": stamps[1], "total_s": time.perf_counter() - t0}


def run_backend(backend: str, model: Path, ps: list[list[int]], logdir: Path, threads: int) -> dict[str, Any]:
    port = _free_port()
    name, _, integrity = backend.partition("+")  # "tcp+fabric": --kv-transfer-integrity fabric
    cmd = [sys.executable, "-m", "pdcluster", "up", "--model", str(model), "--prefill", "1", "--decode", "1",
           "--port", str(port), "--threads", str(threads), "--kv-transfer-backend", name,
           "--kv-transfer-integrity", integrity or "mac", "--disaggregation-threshold", "64"]
    env = {**os.environ, "PDCLUSTER_KV_SECRET": os.environ.get("PDCLUSTER_KV_SECRET", "bench-ttft-secret-0123456789")}
    log = (logdir / f"up-{backend}.log").open("ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"pdcluster up exited with {proc.returncode} (see {logdir}/up-{backend}.log)")
            try:
                c = httpx.get(f"{url}/cluster", timeout=2).json()
                if all(w.get("healthy") for w in c["prefill"] + c["decode"]) and c["prefill"] and c["decode"]:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("cluster not ready within 300 s")
            time.sleep(0.5)
        with httpx.Client(base_url=url, timeout=300) as client:
            one(client, ps[0])  # warm-up: first prefill of this length, agent connections, allocator
            rows = [one(client, p) for p in ps[1:]]
        # which backend each worker actually runs (its /internal/load; the router does not report it)
        workers = c["prefill"] + c["decode"]
        headers = internal_headers(env["PDCLUSTER_KV_SECRET"].encode())
        loads = [httpx.get(f"{w['url']}/internal/load", params={"ranks": 1}, headers=headers, timeout=5).json()
                 for w in workers]
        used = {f"{ld.get('transfer_backend')}{'+fabric' if ld.get('transfer_integrity') == 'fabric' else ''}"
                for ld in loads}
        # NIXL: layers READ cache to cache, as each worker counts them (nixl_direct.py); the rest went staged
        regs = [(rank.get("registrations") or {}) for ld in loads for rank in ld.get("kv_ranks", [])]
        direct = {"sent": sum(r.get("direct_sent", 0) for r in regs),
                  "received": sum(r.get("direct_received", 0) for r in regs)} if name == "nixl" else None
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        return {"backend": backend, "requests": len(rows), "workers_report": sorted(str(u) for u in used),
                "direct_layers": direct, **med, "rows": rows}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--requests", type=int, default=5, help="measured requests per backend (plus one warm-up)")
    p.add_argument("--backends", default="tcp,nixl")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    ps = prompts(a.requests + 1, a.prompt_len)
    out: dict[str, Any] = {"prompt_len": a.prompt_len, "new_tokens": NEW_TOKENS, "load_avg": os.getloadavg(),
                           "results": []}
    with tempfile.TemporaryDirectory(prefix="pdc-ttft-") as tmp:
        model = build_model(Path(tmp) / "model")
        for backend in a.backends.split(","):
            try:
                out["results"].append(run_backend(backend, model, ps, Path(tmp), a.threads))
            except RuntimeError as e:
                out["results"].append({"backend": backend, "error": str(e)})
    out["load_avg_after"] = os.getloadavg()
    print(f"{a.prompt_len}-token prompt, {NEW_TOKENS} new tokens, router -> prefill -> transfer -> decode "
          f"(load avg {out['load_avg'][0]:.1f} -> {out['load_avg_after'][0]:.1f})")
    for r in out["results"]:
        if "error" in r:
            print(f"  {r['backend']:>10}: {r['error']}")
            continue
        print(f"  {r['backend']:>10} (workers report {','.join(r['workers_report'])}): TTFT {r['ttft_s'] * 1e3:.0f} ms, "
              f"2nd token {r['second_token_s'] * 1e3:.0f} ms, whole {r['total_s'] * 1e3:.0f} ms "
              f"(median of {r['requests']})"
              + (f"; layers cache to cache: {r['direct_layers']['sent']} sent, {r['direct_layers']['received']} "
                 "received" if r.get("direct_layers") else ""))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
