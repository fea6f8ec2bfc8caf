"""How the router probes a vLLM worker (`pdcluster router --engine vllm`): `/health` says whether it serves,
its Prometheus page (`/metrics`) what load it carries and how its KV cache is laid out. The pool's probe loop
(`pool.py`) calls `probe`; the request path is `vllm_pd.py`."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import httpx

from pdcluster.worker.router.upstream import describe

if TYPE_CHECKING:
    from pdcluster.worker.router.pool import Worker


def parse_metrics(text: str) -> dict[str, Any]:
    """The few vLLM series the router picks by: running, waiting, KV use, block size and KV blocks."""
    out: dict[str, Any] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        labels, _, value = rest.rpartition("}") if rest else ("", "", line.split()[-1])
        if not rest:
            name = line.split()[0]
        try:
            v = float(value.split()[0])
        except (ValueError, IndexError):
            continue
        if name == "vllm:num_requests_running":
            out["running"] = out.get("running", 0) + int(v)
        elif name == "vllm:num_requests_waiting":
            out["waiting"] = out.get("waiting", 0) + int(v)
        elif name == "vllm:kv_cache_usage_perc":
            out["kv_usage"] = v
        elif name == "vllm:cache_config_info":
            info = dict(kv.split("=", 1) for kv in _label_pairs(labels))
            for key, field in (("block_size", "block_size"), ("num_gpu_blocks", "total_blocks"),
                               ("num_cpu_blocks", "cpu_blocks")):
                with contextlib.suppress(KeyError, ValueError):
                    out[field] = int(info[key].strip('"'))
    return out


def _label_pairs(labels: str) -> list[str]:
    pairs, cur, quoted = [], "", False
    for ch in labels:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            pairs.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        pairs.append(cur)
    return [p for p in pairs if "=" in p]


async def probe(client: httpx.AsyncClient, w: Worker) -> tuple[bool, str | None]:
    """(ready, error) of a vLLM worker, filling in its load: the pool's probe for `--engine vllm`. /health
    alone says whether it serves; /metrics only refreshes its load (a large page, slow on a busy server: one
    that /health answered stays in rotation with the load of its last page). A /health timeout is raised
    (httpx.TimeoutException): the pool weighs a late answer by the worker's load (pool.BUSY_DROP_AFTER)."""
    try:
        r = await client.get(f"{w.url}/health")
    except httpx.TimeoutException:
        raise
    except httpx.HTTPError as e:
        return False, describe(e)
    if r.status_code != 200:
        return False, f"HTTP {r.status_code}"
    try:
        m = await client.get(f"{w.url}/metrics")
    except httpx.HTTPError:
        return True, None
    if m.status_code == 200:
        d = parse_metrics(m.text)
        w.running, w.waiting = int(d.get("running", 0)), int(d.get("waiting", 0))
        w.block_size = d.get("block_size") or w.block_size
        total = d.get("total_blocks") or d.get("cpu_blocks")
        if total:
            w.total_blocks = total
            if "kv_usage" in d:
                w.used_blocks = int(round(d["kv_usage"] * total))
                w.free_blocks = total - w.used_blocks
    return True, None
