"""Drives KV re-sharding between tensor-parallel layouts with real processes on loopback: one process per
prefill and per decode rank slot (`reshard_rank.py`); senders export from a real paged cache holding their
heads and send them through the plan's head routes, receivers import into theirs and check every value.
tests/transfer/test_reshard_procs.py runs its cases through `run`.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import Any

from tests.transfer import reshard_rank


def _spawn(cfg: dict[str, Any]) -> tuple[Any, Connection]:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.transfer.reshard_rank"])  # torch imported once, not once per rank
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=reshard_rank.child, args=(cfg, child), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def _recv(pipe: Connection, deadline: float) -> dict[str, Any]:
    """The rank's next message; {"died": True} if it died, {"hung": True} past the deadline."""
    try:
        if not pipe.poll(max(0.0, deadline - time.monotonic())):
            return {"hung": True}
        msg: dict[str, Any] = pipe.recv()
        return msg
    except (EOFError, OSError):
        return {"died": True}


def case(heads: int, a: int, b: int, *, layers: int = 3, tokens: int = 37, dim: int = 16, kv_dtype: str = "auto",
         whole: bool = False, chunks: list[int] | None = None, die: tuple[int, int] | None = None,
         seed: int = 1) -> dict[str, Any]:
    """One request of a run: `heads` KV heads from prefill TP `a` to decode TP `b`. `die` = (decode rank,
    layer): that receiver SIGKILLs itself while importing that layer."""
    return {"rid": f"{heads}h-{a}to{b}-{kv_dtype}-{seed}{'-whole' if whole else ''}", "heads": heads, "a": a, "b": b, "layers": layers,
            "tokens": tokens, "dim": dim, "kv_dtype": kv_dtype, "whole": whole, "chunks": chunks,
            "die": list(die) if die else None, "seed": seed}


def run(cases: list[dict[str, Any]], *, backend: str = "tcp", compression: str = "none", timeout: float = 20.0,
        wait: float = 180.0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every case through one set of processes (one per prefill and per decode rank slot, each with one
    connector); (sender results, receiver results) per slot, each with its per-case results by request id."""
    base = {"backend": backend, "compression": compression, "timeout": timeout, "wait": wait, "cases": cases}
    recv = [_spawn({**base, "role": "recv", "slot": r}) for r in range(max(c["b"] for c in cases))]
    send = [_spawn({**base, "role": "send", "slot": r}) for r in range(max(c["a"] for c in cases))]
    try:
        deadline = time.monotonic() + wait
        ports = [_recv(pipe, deadline).get("port") for _, pipe in recv]
        if None in ports:
            raise RuntimeError(f"a receiver did not start: ports {ports}")
        for _, pipe in send:
            pipe.send(ports)
        for c in cases:  # one case at a time, every sender of it at once: timings side by side, no overlap
            for _, pipe in send[:c["a"]]:
                pipe.send("go")
            for _, pipe in send[:c["a"]]:
                _recv(pipe, deadline)
        senders = [_recv(pipe, deadline) for _, pipe in send]
        receivers = [_recv(pipe, deadline) for _, pipe in recv]
        return senders, receivers
    finally:
        for proc, pipe in recv + send:
            proc.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            if proc.is_alive():
                proc.kill()
                proc.join()
            pipe.close()

