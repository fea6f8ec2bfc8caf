"""The router's view of its workers: static URLs and/or Kubernetes Service names resolved via DNS, an active
health/load probe loop, and passive failure marking from the request path."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

from pdcluster.worker.engine.block_hash import prompt_block_hashes
from pdcluster.worker.router import options
from pdcluster.worker.router.picking import BUSY_DROP_AFTER, DROP_AFTER, WorkerView, health_transition
from pdcluster.worker.router.prefix_index import PrefixIndex, parse_report
from pdcluster.worker.transfer.secret import internal_headers

log = logging.getLogger(__name__)


@dataclass
class Worker:
    url: str
    role: str  # the pool it is in: prefill | decode
    healthy: bool = False  # not until the first successful probe
    failures: int = 0
    node: str | None = None
    # its TP size, and whether its ranks send/receive their own KV heads (/internal/load: tp_direct.py)
    tensor_parallel_size: int = 1
    kv_direct: bool = False
    free_blocks: int | None = None
    total_blocks: int | None = None
    used_blocks: int | None = None
    block_size: int | None = None
    running: int = 0
    waiting: int = 0
    # its engine's measured prefill tokens/s (None: not measured yet) and decode batch bound (router/aggregate.py)
    prefill_tokens_per_s: float | None = None
    max_batch_size: int | None = None
    outstanding_prompt_tokens: int = 0
    in_flight: int = 0
    last_error: str | None = None
    last_probe: float = 0.0
    source: str = "static"  # or the Service name it was resolved from
    # position in the worker's prefix-cache eviction log (see prefix_index); None: ask for the whole set
    prefix_epoch: str | None = None
    prefix_seq: int = 0
    prefix_synced: float = float("-inf")  # when the last whole-set report was asked for

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or "127.0.0.1"

    def view(self) -> WorkerView:
        return WorkerView(url=self.url, role=self.role, healthy=self.healthy, node=self.node,
                          outstanding_prompt_tokens=self.outstanding_prompt_tokens, in_flight=self.in_flight,
                          free_blocks=self.free_blocks, total_blocks=self.total_blocks, running=self.running,
                          waiting=self.waiting)

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "node": self.node, "in_flight": self.in_flight,
                "outstanding_prompt_tokens": self.outstanding_prompt_tokens, "free_blocks": self.free_blocks,
                "total_blocks": self.total_blocks, "used_blocks": self.used_blocks, "running": self.running,
                "waiting": self.waiting, "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "max_batch_size": self.max_batch_size, "consecutive_failures": self.failures, "last_error": self.last_error,
                "source": self.source}


def direct_pair(prefill: Worker, decode: Worker) -> bool:
    """Whether the prefill worker's ranks send their own KV heads straight to the decode worker's ranks: both
    advertise it and the pair is not TP 1 -> TP 1 (which keeps whole layers, as before)."""
    return prefill.kv_direct and decode.kv_direct and \
        (prefill.tensor_parallel_size, decode.tensor_parallel_size) != (1, 1)


def _positive_int(v: Any) -> int | None:
    """A reported size, or None when it is missing or nonsense (it feeds hashing and LRU bounds)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _positive_float(v: Any) -> float | None:
    """A reported rate, or None when it is missing, zero (not measured yet) or nonsense."""
    ok = isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < float("inf")
    return float(v) if ok else None


def parse_service(spec: str, default_port: int = 8000) -> tuple[str, str, int]:
    """(scheme, host, port) of `name[:port]` or `http://name[:port]` (the operator renders the URL form)."""
    if "://" in spec:
        u = urlparse(spec)
        return u.scheme or "http", u.hostname or "", u.port or default_port
    head, _, tail = spec.rpartition(":")
    if head and tail.isdigit():
        return "http", head, int(tail)
    return "http", spec, default_port


# getaddrinfo's answers that mean "this name has no address" (a headless Service without ready pods reads
# NXDOMAIN): its workers left. Any other failure (EAI_AGAIN: the DNS server did not answer in time, as when
# CoreDNS is starved on a busy node) says nothing about the Service: its workers stay, and the health probes
# still take out any that are really gone.
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def resolve_service(spec: str, default_port: int = 8000) -> list[str] | None:
    """A Service -> worker URLs, one per address: a headless Service's DNS name returns every ready pod's IP,
    which is how the router discovers (and forgets) workers as pods come and go. None: the lookup failed
    without an answer (the members are unknown, not gone)."""
    scheme, host, port = parse_service(spec, default_port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        log.warning("cannot resolve %s: %s", spec, e)
        return [] if e.errno in _NO_ADDRESS else None
    except UnicodeError as e:  # a name no DNS server can be asked for
        log.warning("cannot resolve %s: %s", spec, e)
        return []
    addrs = sorted({str(info[4][0]) for info in infos})
    return [f"{scheme}://[{a}]:{port}" if ":" in a else f"{scheme}://{a}:{port}" for a in addrs]


def busy(w: Worker) -> bool:
    """Requests from this router in flight on it, or a running or waiting batch at its last answer: a probe
    that times out then counts BUSY_DROP_AFTER times before it drops."""
    return w.in_flight > 0 or w.running > 0 or w.waiting > 0


@dataclass
class Pool:
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    prefill_services: list[str] = field(default_factory=list)
    decode_services: list[str] = field(default_factory=list)
    interval: float = options.default("health_interval")  # the flag's default (router/options.py)
    probe_timeout: float = 2.0
    secret: bytes | None = None  # shared KV secret: authenticates /internal/* calls (None: local dev)
    # prefer workers believed to hold the prompt's prefix (see prefix_index)
    prefix_routing: bool = options.default("routing") == "prefix"
    # seconds between whole-set reports from each worker (eviction reports come every probe round)
    prefix_resync: float = 30.0
    engine: str = "pdcluster"  # what the workers run: pdcluster | vllm (how they are probed)

    def __post_init__(self) -> None:
        self.workers: dict[tuple[str, str], Worker] = {}
        for url in self.prefill_urls:
            self._add(url.rstrip("/"), "prefill")
        for url in self.decode_urls:
            self._add(url.rstrip("/"), "decode")
        self.headers = internal_headers(self.secret)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.probe_timeout), headers=self.headers)
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self.prefix = PrefixIndex()

    def _add(self, url: str, role: str, source: str = "static") -> Worker:
        key = (role, url)
        if key not in self.workers:
            self.workers[key] = Worker(url=url, role=role, source=source)
        return self.workers[key]

    def pool(self, role: str) -> list[Worker]:
        return [w for (r, _), w in self.workers.items() if r == role]

    def views(self, role: str) -> list[WorkerView]:
        return [w.view() for w in self.pool(role)]

    def get(self, role: str, url: str) -> Worker:
        w = self.workers.get((role, url))
        if w is None:  # it changed pools (a role flip) since the caller looked: the same worker, in its new pool
            w = next((x for (_, u), x in self.workers.items() if u == url), None)
        if w is None:
            raise KeyError((role, url))
        return w

    def _moved(self, w: Worker, role: Any) -> str | None:
        """The worker reports another role than its pool's (a role flip): a statically listed one changes
        pools here; one resolved from a role's Service stays out of rotation in the old pool (an error) until
        that Service drops it and the new role's Service lists it (the pod's role label follows the flip)."""
        if role not in ("prefill", "decode") or role == w.role:
            return None
        if w.source != "static":
            return f"now a {role} worker"
        log.info("%s worker %s now serves as %s: moved to the %s pool", w.role, w.url, role, role)
        self.workers.pop((w.role, w.url), None)
        w.role = role
        self.workers.setdefault((role, w.url), w)  # its prefix-index entry stays: a flip keeps the KV cache
        self._changed.set()
        return None

    def any_healthy(self) -> bool:
        return any(w.healthy for w in self.workers.values())

    # ------------------------------------------------------------------ prefix affinity
    def cached_tokens(self, role: str, prompt: list[int]) -> dict[str, int]:
        """url -> prompt tokens each worker of `role` is believed to hold (empty when prefix routing is off).
        Hashed once per block size in use: the same blocks the worker's engine will look up."""
        if not self.prefix_routing:
            return {}
        by_size: dict[int, list[int]] = {}
        out: dict[str, int] = {}
        for w in self.pool(role):
            if not w.healthy or not w.block_size or not self.prefix.size(w.url):
                continue
            hashes = by_size.get(w.block_size)
            if hashes is None:
                hashes = by_size[w.block_size] = prompt_block_hashes(prompt, w.block_size)
            n = self.prefix.match(w.url, hashes) * w.block_size
            if n:
                out[w.url] = n
        return out

    def remember(self, w: Worker, prompt: list[int]) -> None:
        """`w` is about to prefill `prompt`: from now on it holds its blocks (bounded by its KV cache size)."""
        if self.prefix_routing and w.block_size:
            self.prefix.record(w.url, prompt_block_hashes(prompt, w.block_size), w.total_blocks, time.monotonic())

    async def sync_prefix(self, w: Worker) -> bool:
        """Correct `w`'s entry in the prefix index from the worker's own report: the blocks it evicted since
        the last poll, or the whole set it holds (first contact, a restart, a lost position, or every
        `prefix_resync` seconds). Best effort: a worker that cannot answer keeps its (approximate) entry, and
        this never affects its health. True when a report was applied."""
        if not self.prefix_routing or not w.healthy or self.engine != "pdcluster":
            return False  # vLLM publishes its evictions over ZMQ KV events, not HTTP: the index stays approximate
        sent = time.monotonic()
        whole = w.prefix_epoch is None or sent - w.prefix_synced >= self.prefix_resync
        params = {} if whole else {"epoch": w.prefix_epoch, "since": str(w.prefix_seq)}
        try:
            r = await self.client.get(f"{w.url}/internal/prefix-events", params=params)
            report = parse_report(r.json()) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as e:
            log.debug("prefix events of %s: %s", w.url, e)
            return False
        if report is None:
            log.debug("prefix events of %s: no usable report (HTTP %d)", w.url, r.status_code)
            return False
        self.prefix.apply(w.url, report, sent, w.total_blocks)
        if report.resident is not None:
            w.prefix_synced = sent
        w.prefix_epoch, w.prefix_seq = report.epoch, report.seq
        return True

    async def sync_prefixes(self) -> None:
        if self.prefix_routing:
            await asyncio.gather(*(self.sync_prefix(w) for w in list(self.workers.values()) if w.healthy))

    # ------------------------------------------------------------------ passive + active health
    def mark_failed(self, role: str, url: str, error: str) -> None:
        """A request saw this worker fail: take it out of rotation now; the probe loop re-admits it."""
        w = self.workers.get((role, url))
        if w is not None and w.healthy:
            log.warning("%s worker %s failed a request (%s): dropping it until it answers probes", role, url, error)
            w.healthy, w.last_error = False, error
            w.failures = max(w.failures, 1)

    async def probe(self, w: Worker) -> None:
        try:
            ok, err = await self._ask(w)
        except httpx.TimeoutException as e:  # late, not refused: weighed by the worker's load (_probed)
            self._probed(w, False, f"{type(e).__name__}: {e}", slow=True)
            return
        self._probed(w, ok, err)

    async def _ask(self, w: Worker) -> tuple[bool, str | None]:
        """(ready, error) of one probe, filling in the worker's load; a timeout is raised."""
        if self.engine == "vllm":  # vLLM workers: /health and their Prometheus series (router/vllm_probe.py)
            from pdcluster.worker.router import vllm_probe

            return await vllm_probe.probe(self.client, w)
        try:
            r = await self.client.get(f"{w.url}/internal/load")
        except httpx.TimeoutException:
            raise
        except httpx.HTTPError as e:
            return False, f"{type(e).__name__}: {e}"
        if r.status_code != 200:
            return False, f"HTTP {r.status_code}"
        try:
            d = r.json()
            ok = bool(d.get("ready", True))
            moved = self._moved(w, d.get("role"))
            ok = ok and moved is None
            w.node, w.block_size = d.get("node"), _positive_int(d.get("block_size"))
            w.tensor_parallel_size = _positive_int(d.get("tensor_parallel_size")) or 1
            w.kv_direct = d.get("kv_direct") is True
            w.free_blocks, w.total_blocks = d.get("free_blocks"), _positive_int(d.get("total_blocks"))
            w.used_blocks = d.get("used_blocks")
            w.running, w.waiting = int(d.get("running", 0)), int(d.get("waiting", 0))
            w.prefill_tokens_per_s = _positive_float(d.get("prefill_tokens_per_s"))
            w.max_batch_size = _positive_int(d.get("max_batch_size"))
        except ValueError as e:
            return False, f"{type(e).__name__}: {e}"
        return ok, None if ok else moved or "not ready"

    def _probed(self, w: Worker, ok: bool, err: str | None, slow: bool = False) -> None:
        """One probe's outcome. `slow`: it timed out, which on a worker busy with requests is no sign of an
        outage (BUSY_DROP_AFTER)."""
        was = w.healthy
        drop_after = BUSY_DROP_AFTER if slow and busy(w) else DROP_AFTER
        w.healthy, w.failures = health_transition(w.healthy, w.failures, ok, drop_after)
        w.last_error, w.last_probe = err, time.monotonic()
        if w.healthy and not was:
            self.prefix.forget(w.url)  # back from down (maybe restarted): assume its prefix cache is empty
            w.prefix_epoch = None  # and ask it for what it really holds
        if w.healthy != was:
            log.info("%s worker %s is now %s%s", w.role, w.url, "healthy" if w.healthy else "unhealthy",
                     f" ({err})" if err else "")
            self._changed.set()

    def refresh_services(self) -> None:
        for role, services in (("prefill", self.prefill_services), ("decode", self.decode_services)):
            for svc in services:
                found = resolve_service(svc)
                if found is None:  # no answer this round: keep its workers as they are
                    continue
                urls = set(found)
                for url in urls:
                    self._add(url, role, source=svc)
                for (r, url), w in list(self.workers.items()):
                    if r == role and w.source == svc and url not in urls:
                        log.info("%s worker %s left service %s", role, url, svc)
                        del self.workers[(r, url)]
                        self.prefix.forget(url)

    async def probe_all(self) -> None:
        if self.prefill_services or self.decode_services:
            await asyncio.to_thread(self.refresh_services)
        await asyncio.gather(*(self.probe(w) for w in list(self.workers.values())))

    async def wait_changed(self, timeout: float) -> None:
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._changed.wait()

    async def _run(self) -> None:
        while True:
            try:
                await self.probe_all()
                await self.sync_prefixes()
            except Exception:  # the loop must survive anything a probe throws
                log.exception("health probe round failed")
            await asyncio.sleep(self.interval)

    async def start(self) -> None:
        await self.probe_all()
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.client.aclose()

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        return {role: [w.describe() for w in self.pool(role)] for role in ("prefill", "decode")}
