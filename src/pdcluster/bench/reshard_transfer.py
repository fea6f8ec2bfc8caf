"""KV re-sharding between tensor-parallel layouts, measured with real processes on loopback: bytes moved per
rank and time per layer for prefill TP a -> decode TP b next to a same-layout transfer, in one run.

    python -m pdcluster.bench.reshard_transfer [--backend tcp|nixl|both] [--tokens 2048] [--layers 4]

Each rank is its own OS process (`reshard_rank.py`): senders export from a real paged cache holding their
heads and send them through the plan's head routes; receivers import into theirs and check every value.
`run` is also what tests/transfer/test_reshard_procs.py drives.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

from pdcluster.bench import reshard_rank
from pdcluster.worker.transfer import reshard

# (a, b, today's path): TP 1 -> 1 both ways (start_save vs one head route of all heads), then re-sharding
CASES = [(1, 1, True), (1, 1, False), (2, 2, False), (2, 1, False), (1, 2, False), (2, 4, False)]


def _spawn(cfg: dict[str, Any]) -> tuple[Any, Connection]:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["pdcluster.bench.reshard_rank"])  # torch imported once, not once per rank
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=["tcp", "nixl", "both"], default="both")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--compression", choices=["none", "int8"], default="none")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.1f}; {args.heads} KV heads x {args.dim}, {args.tokens} tokens, "
          f"{args.layers} layers, f32 cache, wire {args.compression}")
    print("| backend | layout | path | MiB sent per prefill rank per layer | MiB received per decode rank per layer "
          "| time per layer, slowest sender: median (runs) | max error |")
    print("|---|---|---|---|---|---|---|")
    wire = "int8" if args.compression == "int8" else "f32"
    # a warm-up request first (connections, page faults, NIXL peers), then the layouts interleaved, repeated
    warm = case(args.heads, 1, 1, layers=1, tokens=args.tokens, dim=args.dim, seed=99)
    cases = [warm] + [case(args.heads, a, b, layers=args.layers, tokens=args.tokens, dim=args.dim, whole=whole,
                           seed=rep + 1) for rep in range(args.repeat) for a, b, whole in CASES]
    for backend in (["tcp", "nixl"] if args.backend == "both" else [args.backend]):
        senders, receivers = run(cases, backend=backend, compression=args.compression, timeout=120.0, wait=900.0)
        for a, b, whole in CASES:
            times, errs = [], []
            for c in cases[1:]:
                if (c["a"], c["b"], c["whole"]) != (a, b, whole):
                    continue
                got = [s["cases"][c["rid"]] for s in senders if c["rid"] in s.get("cases", {})]
                put = [r["cases"][c["rid"]] for r in receivers if c["rid"] in r.get("cases", {})]
                if len(got) != a or len(put) != b or not all(x.get("ok") for x in got + put):
                    print(f"| {backend} | TP {a} -> TP {b} | FAILED: {got} {put} |")
                    break
                times.append(max(x["seconds"] for x in got) / c["layers"])
                errs.append(max(x["max_err"] for x in put))
            else:
                lb = reshard.layer_bytes(reshard.plan(args.heads, a, b), a, args.tokens, args.dim, wire)
                mib = [", ".join(f"{x / 2**20:.1f}" for x in xs) for xs in (lb.sent, lb.received)]
                path = "start_save (today)" if whole else "head routes"
                runs = " / ".join(f"{t * 1e3:.0f}" for t in times)
                print(f"| {backend} | TP {a} -> TP {b} | {path} | {mib[0]} | {mib[1]} "
                      f"| {statistics.median(times) * 1e3:.0f} ms ({runs}) | {max(errs):g} |", flush=True)
    print(f"load average after {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
