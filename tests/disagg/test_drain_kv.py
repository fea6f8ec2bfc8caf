"""A prefill worker whose KV is still on its way to a decode worker is not idle for a drain: /drain counts the
prefill's stream as in flight until the KV is delivered (or its transfer failed), and /drain?wait=true returns
only then. The operator asks exactly that before it lowers a pool, so the scale-in of a prefill pod waits
until no decode worker still needs its KV (operator/drain.py)."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from .harness import AUTH, SECRET, make_worker, serve


async def operator_drain(url: str, wait_s: float) -> Any:
    """The operator's drain call (operator/drain.py) against this worker, as if it were a pod at its address."""
    from pdcluster.operator import drain

    port = int(url.rsplit(":", 1)[1])
    pod = {"metadata": {"name": "prefill-0"}, "status": {"podIP": "127.0.0.1"}}
    async with httpx.AsyncClient(trust_env=False) as http:
        return await drain.drain_and_wait(pod, http, wait_s=wait_s, port=port, secret=SECRET)


@pytest.mark.timeout(180)
def test_prefill_drain_waits_for_its_kv_in_flight(tiny_model_dir: Path) -> None:
    app, _ = make_worker(tiny_model_dir, "prefill")
    # A decode peer that takes the connection and never answers (a hung decode node): the KV send waits on
    # it, so the prefill stream stays open for as long as this socket does.
    peer = socket.create_server(("127.0.0.1", 0))
    body = {"request_id": "held-1", "prompt_token_ids": [(7 * i) % 200 + 3 for i in range(40)],
            "params": {"max_tokens": 4, "temperature": 0}, "target": {"host": "127.0.0.1",
                                                                      "port": peer.getsockname()[1]}}
    with serve(app) as url, httpx.Client(timeout=120) as h:
        with h.stream("POST", f"{url}/internal/prefill", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = json.loads(next(lines))
            assert first["event"] == "first_token" and first["finished"] is False, first  # KV held for the send
            d = h.post(f"{url}/drain", headers=AUTH).json()
            assert d["status"] == "draining" and d["in_flight"] == 1 and d["idle"] is False, d
            held = asyncio.run(operator_drain(url, wait_s=0.5))  # what the operator asks before a scale-down
            assert held.answered and not held.idle and held.in_flight_at_drain == 1, held  # the KV send is held
            assert "not drained" in held.message("prefill")
            assert h.get(f"{url}/health").json()["status"] == "draining"
            peer.close()  # the decode side goes away: the send fails and the stream ends
            rest = [json.loads(line) for line in lines if line]
        assert rest and rest[-1]["event"] == "error" and rest[-1]["stage"] == "transfer", rest
        done = asyncio.run(operator_drain(url, wait_s=60))
        assert done.answered and done.idle and done.in_flight_at_drain == 0, done
        assert h.get(f"{url}/health").json()["in_flight"] == 0
        load = h.get(f"{url}/internal/load", headers=AUTH).json()
        assert load["in_flight"] == 0 and load["ready"] is False, load  # draining: the router keeps away
