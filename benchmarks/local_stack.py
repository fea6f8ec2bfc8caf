"""The I/O edge of the ratio sweep and the autoscale replay: start a real `pdcluster up` (router + worker
processes on loopback) as a child process, wait until every started worker is healthy behind the router,
run the `pdcluster bench`/`profile` CLIs against it, and stop it (SIGTERM: `up` drains its children).

The benchmarks drive the CLIs as separate processes on purpose: what is measured is the stack a user
runs, and the load generator does not share an interpreter (or a GIL) with anything it measures.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import cpu_limits as cl

PDCLUSTER = [sys.executable, "-m", "pdcluster"]


def cluster_view(router: str) -> dict | None:
    try:
        r = httpx.get(f"{router}/cluster", timeout=2.0)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def healthy(view: dict | None) -> tuple[int, int]:
    """(healthy prefill, healthy decode) in a router's /cluster answer."""
    if not view:
        return 0, 0
    return tuple(sum(1 for w in view.get(role, []) if w.get("healthy")) for role in ("prefill", "decode"))  # type: ignore[return-value]


class StartError(RuntimeError):
    """The stack never became ready (on a busy box, CPU-limited workers can miss `up`'s start deadline)."""


@dataclass
class Usage:
    """What the CPU-limited groups of one stack used: CPU seconds on demand while it runs, cpu.stat at its end."""

    groups: cl.CpuGroups | None = None
    stat: dict[str, dict[str, int]] = field(default_factory=dict)

    def cpu_seconds(self) -> dict[str, float]:
        return self.groups.cpu_seconds() if self.groups else {}


@dataclass(frozen=True)
class CpuLimit:
    """A CPU limit per process of the stack (a pod's `limits.cpu`): each worker and the router in a cgroup of
    their own (benchmarks/cpu_limits.py)."""

    worker: float
    router: float


@contextlib.contextmanager
def up(args: list[str], port: int, log: Path, want: tuple[int, int], timeout: float = 240.0,
       cpu: CpuLimit | None = None, usage: Usage | None = None) -> Iterator[str]:
    """`pdcluster up --port PORT ARGS...`; yields the router URL once `want` (P, D) workers are healthy.
    With `cpu`, every worker and the router run under their own CPU limit from their first moments; on exit
    `usage` (if given) holds the groups while the stack runs and each group's cpu.stat at its end, and the
    groups are removed whatever happened."""
    router = f"http://127.0.0.1:{port}"
    groups = cl.CpuGroups() if cpu else None  # before the stack starts: a host without cgroups fails here
    proc = None
    try:
        with log.open("w") as out:
            proc = subprocess.Popen([*PDCLUSTER, "up", "--port", str(port), "--host", "127.0.0.1",
                                     "--start-timeout", f"{timeout:g}", *args],
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if groups and cpu:
            confine(groups, proc, cpu, sum(want))
        deadline = time.monotonic() + timeout + 30  # up's own deadline is `timeout`: it reports first
        while healthy(cluster_view(router)) != want:
            if proc.poll() is not None:
                raise StartError(f"pdcluster up exited with {proc.returncode}; see {log}")
            if time.monotonic() > deadline:
                raise StartError(f"pdcluster up: {want} workers not healthy within {timeout:.0f} s; see {log}")
            time.sleep(0.5)
        if groups and cpu:
            confine(groups, proc, cpu, sum(want))  # again: anything forked between the first scan and its move
        if usage is not None:
            usage.groups = groups
        yield router
        if groups is not None and usage is not None:
            usage.stat = {name: groups.stat(name) for name in groups.groups}
    finally:
        try:
            if proc is not None:
                stop(proc)
        finally:
            if groups is not None:
                groups.close()


def confine(groups: cl.CpuGroups, proc: subprocess.Popen[bytes], cpu: CpuLimit, workers: int,
            timeout: float = 60.0) -> None:
    """Moves every worker and the router of `up` (and their children) into their groups, as soon as `up` has
    started them (it starts them all at once; they are still importing when they move)."""
    deadline = time.monotonic() + timeout
    while True:
        where = cl.assign(cl.process_table(), proc.pid)
        for name in sorted(set(where.values())):
            groups.limit(name, cpu.router if name == "router" else cpu.worker)
            groups.move(name, [pid for pid, g in where.items() if g == name])
        names = set(where.values())
        if "router" in names and len(names - {"router"}) >= workers:
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"pdcluster up: found {sorted(names)} of {workers} workers + router to limit")
        time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes], timeout: float = 40.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the workers go with it
            proc.wait(5)


def warm_up(router: str, out: Path) -> None:
    """A few uncounted requests so every worker has run its first (slow) prefill and decode steps."""
    subprocess.run([*PDCLUSTER, "bench", "--url", router, "--prompt-lens", "128,512", "--output-lens", "4",
                    "--requests", "8", "--concurrency", "4", "--warmup", "0", "--no-plots", "--no-progress",
                    "--out", str(out)], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=300)


def replay(router: str, trace: Path, out: Path, *, start: float, duration: float, speedup: float,
           max_model_len: int, max_output_tokens: int | None = None, timeout: float = 120.0) -> list[dict]:
    """`pdcluster bench --trace`: the records of requests.jsonl (one per trace request)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*PDCLUSTER, "bench", "--url", router, "--trace", str(trace), "--start", str(start),
           "--duration", str(duration), "--speedup", str(speedup), "--max-model-len", str(max_model_len),
           "--timeout", str(timeout), "--out", str(out)]
    if max_output_tokens:  # outputs keep their real lengths (clipped), prompts alone shrink to fit
        cmd += ["--max-output-tokens", str(max_output_tokens)]
    with (out / "bench.log").open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    path = out / "requests.jsonl"
    if not path.exists():
        raise RuntimeError(f"pdcluster bench --trace exited with {rc} and wrote no records; see {out}/bench.log")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def decode_join(router: str) -> dict[str, float | None]:
    """The live t_join of a run, read from the router's healthy decode workers at its end: mean admission
    (`pdcluster_decode_join_seconds`), mean step (`pdcluster_time_per_output_token_seconds`) and t_join as the
    autoscaler computes it (`autoscaler_rules.join_cost`); None when nothing was transferred (colocated)."""
    from pdcluster.bench.profile import JOIN_SERIES, STEP_SERIES, join_totals
    from pdcluster.operator.autoscaler_rules import join_cost

    tot: dict[str, list[tuple[float, float]]] = {JOIN_SERIES: [], STEP_SERIES: []}
    for w in (cluster_view(router) or {}).get("decode", []):
        try:
            text = httpx.get(f"{w['url']}/metrics", timeout=5.0).text
        except httpx.HTTPError:
            continue
        for series, acc in tot.items():
            acc.append(join_totals(text, series))

    def mean(series: str) -> float | None:
        n = sum(c for _, c in tot[series])
        return sum(t for t, _ in tot[series]) / n if n else None

    admit, step = mean(JOIN_SERIES), mean(STEP_SERIES)
    return {"admission_s": admit, "step_s": step, "t_join_s": join_cost(admit, step)}


def profile(router: str, batch_sizes: str = "1,2,4,8,16,32", prefill_len: int = 512,
            stream: dict | None = None) -> dict:
    """`pdcluster profile --url --json` against a 1:1 stack: per-instance capacities; with `stream` (rate,
    input_len, output_len, instance_cpus) also the stream step's per-request costs."""
    cmd = [*PDCLUSTER, "profile", "--url", router, "--batch-sizes", batch_sizes, "--prefill-len", str(prefill_len),
           "--json"]
    if stream:
        cmd += ["--stream-rate", f"{stream['rate']:.4g}", "--stream-input-len", str(stream["input_len"]),
                "--stream-output-len", str(stream["output_len"]), "--instance-cpus", f"{stream['instance_cpus']:g}"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"pdcluster profile failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout)
