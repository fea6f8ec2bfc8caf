"""Issue 37 item 3: a worker changes role (prefill <-> decode) without a restart, over real HTTP with real
engines on the tiny model: `POST /internal/role` takes the /internal/* token, refuses bad bodies with a 400,
finishes what the worker holds before it flips (a held KV reservation keeps it draining; a flip that cannot
finish in time leaves the worker as it was), is idempotent, and the router moves the worker to its new pool
with no request failing under continuous traffic."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from .harness import AUTH, cluster, idle_everywhere
from .test_drain import wait_for

PARAMS = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": [],
          "stop_token_ids": [], "ignore_eos": True}


def roles(h: httpx.Client, router: str) -> dict[str, list[str]]:
    """The router's pools: the healthy workers' urls by role (its /cluster snapshot)."""
    pools = h.get(f"{router}/cluster").json()
    return {role: sorted(w["url"] for w in pools[role] if w["healthy"]) for role in ("prefill", "decode")}


@pytest.mark.timeout(240)
def test_role_flip_auth_bad_input_holding_and_idempotence(tiny_model_dir: Path) -> None:
    with cluster(tiny_model_dir, prefill_blocks=(8,), decode_blocks=(16,), threshold=0) as c, \
            httpx.Client(timeout=60) as h:
        decode = c.decode[0]
        for headers in ({}, {"Authorization": "Bearer nope"}):
            r = h.post(f"{decode}/internal/role", json={"role": "prefill"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_internal_token"
        for bad in ({}, {"role": "both"}, {"role": "PREFILL"}, {"role": 1}, {"role": "prefill", "x": 1},
                    {"role": "prefill", "timeout_s": 0}, {"role": "prefill", "timeout_s": "5"},
                    {"role": "prefill", "max_batch_size": 0}, {"role": "prefill", "max_batch_tokens": -1}, [], "prefill"):
            r = h.post(f"{decode}/internal/role", json=bad, headers=AUTH)
            assert r.status_code == 400, (bad, r.text)
        r = h.post(f"{decode}/internal/role", content=b"{not json", headers=AUTH)
        assert r.status_code == 400
        assert h.get(f"{decode}/health").json() == {"status": "ok", "role": "decode", "model": "tiny", "in_flight": 0}

        same = h.post(f"{decode}/internal/role", json={"role": "decode"}, headers=AUTH)
        assert same.status_code == 200 and same.json()["changed"] is False  # already that role: nothing to do

        # A reservation whose KV never comes is work the decode worker holds: a flip waits for it, and one that
        # cannot finish in time is abandoned, the worker still decode and admitting again.
        reserve = {"request_id": "held-1", "prompt_token_ids": [5, 6, 7, 8, 9], "params": PARAMS}
        assert h.post(f"{decode}/internal/reserve", json=reserve, headers=AUTH).status_code == 200
        r = h.post(f"{decode}/internal/role", json={"role": "prefill", "timeout_s": 0.2}, headers=AUTH)
        assert r.status_code == 503 and r.json()["error"]["code"] == "flip_timeout", r.text
        assert "kv_loads" in r.json()["error"]["message"]
        assert h.get(f"{decode}/health").json()["status"] == "ok"
        assert h.get(f"{decode}/health").json()["role"] == "decode"

        # Now a flip that waits: the worker drains (new work refused, another flip direction refused) until
        # the reservation is released, then serves as prefill.
        answers: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: answers.append(
            h.post(f"{decode}/internal/role", json={"role": "prefill", "max_batch_size": 7, "max_batch_tokens": 96},
                   headers=AUTH)))
        waiter.start()
        assert wait_for(lambda: h.get(f"{decode}/health").json()["status"] == "draining")  # stays until cancel
        body = {"prompt": [5, 6, 7], "max_tokens": 2}
        refused = h.post(f"{decode}/v1/completions", json=body)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        other = h.post(f"{decode}/internal/role", json={"role": "decode"}, headers=AUTH)
        assert other.status_code == 409 and other.json()["error"]["code"] == "flip_in_progress"
        assert h.post(f"{decode}/internal/cancel", json={"request_id": "held-1"}, headers=AUTH).status_code == 200
        waiter.join(timeout=60)
        assert answers and answers[0].status_code == 200, answers
        done = answers[0].json()
        assert done["role"] == "prefill" and done["previous"] == "decode" and done["changed"] is True
        assert h.get(f"{decode}/health").json()["role"] == "prefill"
        sched = c.engines[1].engine.scheduler  # the new pool's batch limits, on the same engine (no reload)
        assert (sched.max_batch_size, sched.max_batch_tokens) == (7, 96)
        load = h.get(f"{decode}/internal/load", headers=AUTH).json()
        assert load["role"] == "prefill" and load["ready"] is True
        metrics = h.get(f"{decode}/metrics").text
        assert 'pdcluster_requests_total{model_name="tiny",role="prefill"}' in metrics
        assert 'role="decode"' not in metrics  # the old role's series ended with the flip
        again = h.post(f"{decode}/internal/role", json={"role": "prefill"}, headers=AUTH)
        assert again.status_code == 200 and again.json()["changed"] is False  # idempotent
        # no weights reloaded, no restart: the same process serves at once
        assert h.post(f"{decode}/v1/completions", json={**body, "temperature": 0}).status_code == 200


@pytest.mark.timeout(300)
def test_flips_under_traffic_fail_no_request_and_the_router_follows(tiny_model_dir: Path) -> None:
    """Two prefill and two decode workers behind the router, clients sending all along: one prefill worker
    becomes a decode worker and back, one decode worker becomes a prefill worker; every request succeeds,
    and the router moves each flipped worker to its new pool (it reads the role the worker reports)."""
    with cluster(tiny_model_dir, prefill_blocks=(8, 8), decode_blocks=(16, 16), threshold=0) as c, \
            httpx.Client(timeout=120) as h:
        assert wait_for(lambda: h.get(f"{c.router}/health").status_code == 200)
        stop = threading.Event()
        results: list[tuple[int, Any]] = []

        def client(seed: int) -> None:
            with httpx.Client(timeout=120) as ch:
                i = 0
                while not stop.is_set():
                    i += 1
                    prompt = [(seed * 31 + i * 7 + k) % 200 + 3 for k in range(24)]
                    r = ch.post(f"{c.router}/v1/completions",
                                json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
                    results.append((r.status_code, r.json().get("usage") if r.status_code == 200 else r.text))

        clients = [threading.Thread(target=client, args=(s,)) for s in range(3)]
        for t in clients:
            t.start()
        try:
            def flip(url: str, role: str) -> None:
                r = h.post(f"{url}/internal/role", json={"role": role}, headers=AUTH)
                assert r.status_code == 200 and r.json()["role"] == role, r.text
                # the router follows on its next probe (the worker reports its role in /internal/load)
                assert wait_for(lambda: url in roles(h, c.router)[role], timeout=30), roles(h, c.router)

            n0 = len(results)
            flip(c.prefill[1], "decode")
            flip(c.decode[1], "prefill")
            assert sorted(roles(h, c.router)["prefill"]) == sorted([c.prefill[0], c.decode[1]])
            flip(c.prefill[1], "prefill")
            # traffic kept flowing through the flips (the clients are still running: wait for more answers)
            assert wait_for(lambda: len(results) > n0 + 6, timeout=60)
        finally:
            stop.set()
            for t in clients:
                t.join(timeout=120)
        failed = [r for r in results if r[0] != 200]
        assert not failed and len(results) > 6, failed[:5]
        assert all(u["completion_tokens"] == 6 for _, u in results)
        loads = idle_everywhere(c)
        assert all(d["used_blocks"] == 0 and d["pending_loads"] == 0 for d in loads), loads  # no KV stranded
