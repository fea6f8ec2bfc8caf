"""`pdcluster profile --url ROUTER --stream-rate R`: each pool's cost per request under a stream of arrivals.

Why: C_d is measured on a closed batch (B sequences already decoding) and t_join one request at a time on an
idle pair. Under a stream, the decode worker also imports every prompt's KV, takes every request into its
batch and answers its HTTP stream, work neither figure sees: the 6x ratio sweep (docs/benchmarks/
ratio_sweep.md at 5f904a5, §00) had a lone decode worker at 0.4 CPU with 125-151 ms steps while the profile promised
it a sixth of that load. So this step sends requests of the workload's mean lengths through a real
prefill -> decode transfer, open-loop (Poisson) at a realistic rate, and reads each worker's CPU seconds
(`process_cpu_seconds_total` of its /metrics) before and after, less what it burns idle. With every worker
under a CPU limit of `--instance-cpus` (a pod's `limits.cpu`), the CPU seconds a pool spent per request,
divided by that limit, are the instance-seconds per request the formula means: prefill `I/C_p`, decode
`O/C_d + t_join`. From them: the prefill capacity under the stream (I / prefill seconds) and the decode
join cost under the stream (decode seconds - O/C_d, C_d from the closed-batch step), which `pdcluster
plan --prefill-capacity/--decode-join-seconds` and the autoscaler take as they are.

This needs CPU-bound instances with a known limit (the dev box, CPU pods); on a GPU the CPU seconds are not
what bounds an instance, and the closed-batch figures stay the ones to use.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

CPU_SERIES = "process_cpu_seconds_total"
POOLS = ("prefill", "decode")


def cpu_seconds(metrics_text: str) -> float | None:
    """The process's CPU seconds in one /metrics answer (None when the series is missing)."""
    for line in metrics_text.splitlines():
        if line.startswith(CPU_SERIES + " ") or line.startswith(CPU_SERIES + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def instance_seconds_per_request(busy_cpu_s: float, idle_cpu_per_s: float, wall_s: float, requests: int,
                                 instance_cpus: float) -> float | None:
    """A pool's instance-seconds per request: the CPU seconds its workers used during the stream, less their
    idle burn over the same wall time, per request served, over one instance's CPU limit. None without
    requests or time; never below 0 (an idle baseline measured on a noisier second can exceed the work)."""
    if requests <= 0 or wall_s <= 0:
        return None
    if not (instance_cpus > 0 and math.isfinite(instance_cpus)):
        raise ValueError(f"instance CPUs must be > 0 (got {instance_cpus})")
    return max(0.0, busy_cpu_s - idle_cpu_per_s * wall_s) / requests / instance_cpus


def stream_costs(stream: dict[str, Any], decode_capacity: float | None) -> dict[str, float | None]:
    """The formula's inputs from a stream measurement: per-request instance-seconds of each pool, the prefill
    capacity they imply (I / prefill seconds) and t_join (decode seconds - O/C_d, at least 0; C_d the
    closed-batch capacity, whose O/C_d the formula keeps)."""
    sp, sd = stream.get("prefill_seconds"), stream.get("decode_seconds")
    i, o = stream["input_len"], stream["output_len"]
    join = None
    if sd is not None and decode_capacity:
        join = max(0.0, sd - o / decode_capacity)
    return {"prefill_seconds": sp, "decode_seconds": sd,
            "prefill_tokens_per_second": i / sp if sp else None, "decode_join_seconds": join}


Reader = Callable[[str], Awaitable[str]]  # URL -> its /metrics text
Sender = Callable[[int, int, int, float], Awaitable[tuple[list[Any], float]]]  # n, in, out, rate -> results, wall


async def _pool_cpu(read: Reader, urls: dict[str, list[str]]) -> dict[str, float]:
    out = {}
    for pool in POOLS:
        vals = [cpu_seconds(await read(u)) for u in urls[pool]]
        if any(v is None for v in vals):
            raise ConnectionError(f"a {pool} worker's /metrics has no {CPU_SERIES}")
        out[pool] = sum(v for v in vals if v is not None)
    return out


async def measure(read: Reader, send: Sender, urls: dict[str, list[str]], *, rate: float, requests: int,
                  input_len: int, output_len: int, instance_cpus: float, idle_s: float = 5.0, warmup: int = 20,
                  clock: Callable[[], float] | None = None) -> dict[str, Any]:
    """`warmup` uncounted arrivals (the first requests of a shape cost a worker more: measured 2.3 vs 1.2
    prefill CPU seconds for the same 60 requests, first stream vs second), an idle baseline over `idle_s`,
    then `requests` arrivals at `rate` req/s of `input_len` prompt and `output_len` output tokens; each
    pool's CPU seconds around the last two. `urls`: the router's healthy prefill and decode workers (a
    disaggregated stack: the colocated one has no transfer to measure)."""
    loop = asyncio.get_running_loop()
    now = clock or loop.time
    if warmup:
        await send(warmup, input_len, output_len, rate)
    c0, t0 = await _pool_cpu(read, urls), now()
    await asyncio.sleep(idle_s)
    c1, t1 = await _pool_cpu(read, urls), now()
    results, _ = await send(requests, input_len, output_len, rate)
    c2, t2 = await _pool_cpu(read, urls), now()
    ok = sum(1 for r in results if r.ok)
    idle = {p: (c1[p] - c0[p]) / (t1 - t0) if t1 > t0 else 0.0 for p in POOLS}
    out: dict[str, Any] = {"rate": rate, "requests": len(results), "ok": ok, "input_len": input_len,
                           "output_len": output_len, "instance_cpus": instance_cpus, "wall_s": t2 - t1,
                           "workers": {p: len(urls[p]) for p in POOLS}}
    for p in POOLS:
        busy = c2[p] - c1[p]
        out[f"{p}_cpu_seconds"] = busy
        out[f"{p}_idle_cpu_per_second"] = idle[p]
        out[f"{p}_seconds"] = instance_seconds_per_request(busy, idle[p], t2 - t1, ok, instance_cpus)
    return out
