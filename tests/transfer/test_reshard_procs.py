"""KV re-sharding between tensor-parallel layouts with real OS processes on 127.0.0.1: one process per
prefill rank and per decode rank (`reshard_rank.py`), each with its own connector and a real paged
cache holding its rank's heads; every decode rank's cache must end up equal to its heads of the full KV
(bit-exact floats or codes; within int8 error with int8 on the wire), over TCP and NIXL. A decode rank
killed mid-transfer: its senders fail cleanly, nothing leaks."""

from __future__ import annotations

from typing import Any

import pytest

from pdcluster.worker.transfer import reshard
from pdcluster.worker.transfer.nixl_agent import availability
from tests.transfer.reshard_procs import case, run

NIXL = availability()
BACKENDS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not NIXL.ok, reason=NIXL.reason))]
TIMEOUT = 15.0

CASES = [
    case(4, 2, 1),  # prefill TP 2 -> decode TP 1: both halves into one cache
    case(4, 1, 2, chunks=[20, 17]),  # TP 1 -> TP 2: one rank splits its heads; chunked prefill
    case(4, 2, 4, kv_dtype="int8"),  # TP 2 -> TP 4, an int8 cache: codes travel as stored
    case(2, 1, 4),  # 2 KV heads at decode TP 4: each head replicated on two decode ranks
    case(2, 4, 2, seed=2),  # 2 KV heads at prefill TP 4: replicas, the load dealt over them
    case(4, 1, 1, whole=True),  # today's path, next to them
]


def assert_clean(slot: dict[str, Any]) -> None:
    assert slot.get("pending_loads", 0) == 0 and slot.get("outboxes", 0) == 0, slot
    reg, closed = slot["registrations"], slot["closed"]
    if reg:  # NIXL: no staging region, no outgoing transfer left; after close nothing registered, no peer
        assert (reg["staging_regions"], reg["staging_used_bytes"], reg["outgoing"]) == (0, 0, 0), reg
        assert (closed["registered"], closed["remote_agents"]) == (0, 0), closed
    assert all(c["blocks_leaked"] == 0 for c in slot["cases"].values()), slot


def check_run(cases: list[dict[str, Any]], senders: list[dict[str, Any]], receivers: list[dict[str, Any]],
              compression: str) -> None:
    for slot in senders + receivers:
        assert "cases" in slot, slot  # neither died nor hung
        assert_clean(slot)
    for c in cases:
        rid, plan = c["rid"], reshard.plan(c["heads"], c["a"], c["b"])
        wire = "int8" if compression == "int8" or c["kv_dtype"] == "int8" else "f32"
        want = reshard.layer_bytes(plan, c["a"], c["tokens"], c["dim"], wire)
        for r in range(c["a"]):
            got = senders[r]["cases"][rid]
            assert got["ok"], got
            assert got["bytes"] == want.sent[r] * c["layers"] and got["routes"] == len(reshard.sends(plan, r))
        for r in range(c["b"]):
            got = receivers[r]["cases"][rid]
            assert got["ok"], got
            assert got["bytes"] == want.received[r] * c["layers"]
            # codes as stored, or floats: bit-exact; int8 on the wire: half a step of the largest |x| / 127
            assert got["max_err"] <= (0.0 if compression == "none" else 0.03), (rid, r, got)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_decode_rank_gets_exactly_its_heads(backend: str) -> None:
    senders, receivers = run(CASES, backend=backend, timeout=TIMEOUT)
    check_run(CASES, senders, receivers, "none")


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_on_the_wire(backend: str) -> None:
    cases = [case(4, 2, 1, seed=3), case(4, 1, 2, seed=3)]
    senders, receivers = run(cases, backend=backend, compression="int8", timeout=TIMEOUT)
    check_run(cases, senders, receivers, "int8")


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_rank_killed_mid_transfer(backend: str) -> None:
    """Decode rank 0 of a TP 2 -> TP 1 transfer SIGKILLs itself while importing layer 1: both prefill ranks
    fail with a transfer error well within their deadline (no hang) and hold nothing afterwards."""
    c = case(4, 2, 1, layers=6, tokens=200, die=(0, 1), seed=4)
    senders, receivers = run([c], backend=backend, timeout=TIMEOUT, wait=120.0)
    assert receivers == [{"died": True}]
    for slot in senders:
        got = slot["cases"][c["rid"]]
        assert not got["ok"] and "kv transfer to 127.0.0.1" in got["error"], got
        assert got["seconds"] < TIMEOUT
        assert_clean(slot)
