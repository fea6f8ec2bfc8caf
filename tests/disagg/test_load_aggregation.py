"""Load-driven aggregation on real workers (issue 37 item 4): with the prefill worker's engine frozen behind
a queued prompt, the router's own estimate of the prefill queue (its exact count of the prompt tokens it sent
there / the throughput the worker measured and reported) misses the TTFT target, so the next long prompt is
prefilled on the decode worker, and `pdcluster_router_placements_total` says so. Every step waits on state
the router or a worker reports, none on time."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdcluster.worker.router import aggregate as agg

from .harness import AUTH, cluster, idle_everywhere

WARM = 256  # tokens of the request that has the prefill worker measure its speed
PROMPT = 64  # the request placed by load
BACKLOG = 352  # 5.5 x PROMPT: within the target alone, past it with PROMPT behind it
PLACEMENTS = "pdcluster_router_placements_total"


def _cluster_state(router: str) -> dict[str, Any]:
    return httpx.get(f"{router}/cluster", timeout=10).json()  # type: ignore[no-any-return]


def _wait_for(router: str, what: str, ok: Any, limit: int = 600) -> dict[str, Any]:
    """/cluster until `ok(state)`; the states waited for cannot be missed (they hold until the test moves)."""
    for _ in range(limit):
        state = _cluster_state(router)
        if ok(state):
            return state
        threading.Event().wait(0.05)
    raise AssertionError(f"the router never reported {what}: {state}")


def _completion(router: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    return httpx.post(f"{router}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def _series(router: str, placement: str, reason: str) -> float:
    want = {f'placement="{placement}"', f'reason="{reason}"', 'role="router"'}
    for line in httpx.get(f"{router}/metrics", timeout=5).text.splitlines():
        if line.startswith(PLACEMENTS + "{"):
            labels, value = line[len(PLACEMENTS) + 1:].rsplit("} ", 1)
            if set(labels.split(",")) == want:
                return float(value)
    return 0.0


class Freeze:
    """Holds a worker's engine thread between steps (a command that blocks until released): the worker still
    answers /internal/load, its queue just makes no progress, like a prefill pool that has fallen behind."""

    def __init__(self, engine: Any) -> None:
        self.frozen, self.gate = threading.Event(), threading.Event()

        def hold(_: Any) -> None:
            self.frozen.set()
            self.gate.wait(120)

        self.thread = threading.Thread(target=lambda: asyncio.run(engine.call(hold)), daemon=True)
        self.thread.start()
        assert self.frozen.wait(60), "the engine thread never took the command"

    def release(self) -> None:
        self.gate.set()
        self.thread.join(60)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_backlogged_prefill_worker_sends_the_next_long_prompt_to_decode(tiny_model_dir: Path) -> None:
    with cluster(tiny_model_dir, threshold=0) as c:
        prefill_engine = c.engines[0]
        assert agg.LOCAL_BUDGET == 0.2  # the sizes below are chosen around it
        # 1. one long prompt through the pair: the prefill worker measures its prefill speed and reports it
        warm = _completion(c.router, [3 + i % 200 for i in range(WARM)], 2)
        assert warm.status_code == 200, warm.text
        assert _series(c.router, "disaggregated", "prompt_length") == 1
        state = _wait_for(c.router, "the prefill worker's measured speed",
                          lambda s: s["prefill"][0]["prefill_tokens_per_s"] is not None)
        tps = state["prefill"][0]["prefill_tokens_per_s"]
        # the target: BACKLOG alone meets it (0.92 x target), BACKLOG + PROMPT does not (1.08 x), and PROMPT on
        # the decode worker takes 0.17 x target, within the share a decode worker lends (LOCAL_BUDGET, 0.2)
        c.state.flow.ttft_slo = 6 * PROMPT / tps
        freeze = Freeze(prefill_engine)
        backlog: list[httpx.Response] = []
        try:
            # 2. a long prompt queued on the frozen prefill worker: the router counts its tokens there
            t = threading.Thread(target=lambda: backlog.append(
                _completion(c.router, [7 + i % 150 for i in range(BACKLOG)], 4)), daemon=True)
            t.start()
            state = _wait_for(c.router, "the queued prompt at the prefill worker",
                              lambda s: s["prefill"][0]["outstanding_prompt_tokens"] == BACKLOG)
            assert _series(c.router, "disaggregated", "prompt_length") == 2  # it was within the target
            assert not state["router"]["load_aggregation_engaged"]
            # 3. the next long prompt would wait behind it past the target: the decode worker prefills it
            prompt = [11 + i % 170 for i in range(PROMPT)]
            r = _completion(c.router, prompt, 6)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 6
            state = _cluster_state(c.router)
            assert state["prefill"][0]["outstanding_prompt_tokens"] == BACKLOG  # still frozen behind the first
            assert _series(c.router, "aggregated", "prefill_backlog") == 1
            assert state["router"]["load_aggregation_engaged"] is True
            assert state["router"]["prefill_wait_estimate_s"] > c.state.flow.ttft_slo
            # the same tokens the decode worker gives on its own (greedy)
            alone = httpx.post(f"{c.decode[0]}/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
            assert r.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
        finally:
            freeze.release()
        t.join(120)
        assert [b.status_code for b in backlog] == [200], backlog
        assert _series(c.router, "disaggregated", "prompt_length") == 2
        loads = idle_everywhere(c)
        assert all(d["used_blocks"] == 0 for d in loads), loads
        assert httpx.get(f"{c.prefill[0]}/internal/load", headers=AUTH, timeout=5).json()["prefill_tokens_per_s"] > 0
