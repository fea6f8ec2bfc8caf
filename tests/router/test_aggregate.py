"""Load-driven aggregation (issue 37 item 4): the pure decision, every branch, and the Flow placing a request by
it over scripted workers (the real-worker test is tests/disagg/test_load_aggregation.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from pdcluster.worker.router import aggregate as agg
from pdcluster.worker.router.aggregate import DecodeSlack, PrefillBacklog, decide
from pdcluster.worker.router.tokenized import Tokenized

from .fakes import DECODE, DECODE2, PREFILL, Lines, Script, make_flow, tokens

SLO = 1.0
SLOW = PrefillBacklog(queued_tokens=9000, tokens_per_s=1000.0)  # 9 s of queue before this prompt
FAST = PrefillBacklog(queued_tokens=100, tokens_per_s=1000.0)


def slack(url: str = "d", **kw: Any) -> DecodeSlack:
    base: dict[str, Any] = dict(free_blocks=100, blocks_needed=10, running=2, waiting=0, max_batch=16,
                                tokens_per_s=1000.0)
    return DecodeSlack(url, **{**base, **kw})


def test_off_without_a_target() -> None:
    p = decide(1000, SLOW, [slack()], slo_s=0.0, engaged=True)
    assert (p.aggregate, p.reason, p.engaged) == (False, agg.PROMPT_LENGTH, False)


def test_no_measurement_no_evidence_of_a_backlog() -> None:
    p = decide(1000, PrefillBacklog(9000, None), [slack()], SLO, engaged=False)
    assert (p.aggregate, p.reason, p.remote_s) == (False, agg.PROMPT_LENGTH, None)


def test_a_prefill_pool_that_keeps_up_gets_the_prompt() -> None:
    p = decide(500, FAST, [slack()], SLO, engaged=False)
    assert (p.aggregate, p.reason, p.engaged) == (False, agg.PROMPT_LENGTH, False)
    assert p.remote_s == pytest.approx(0.6)


def test_a_backlog_goes_to_the_first_decode_worker_with_slack() -> None:
    cands = [slack("full", running=16), slack("queued", waiting=1), slack("ok"), slack("also")]
    p = decide(100, SLOW, cands, SLO, engaged=False)
    assert (p.aggregate, p.reason, p.decode, p.engaged) == (True, agg.PREFILL_BACKLOG, "ok", True)
    assert p.remote_s == pytest.approx(9.1) and p.local_s == pytest.approx(0.1)


def test_never_a_decode_worker_without_the_kv_room() -> None:
    for lacking in (slack(free_blocks=9), slack(free_blocks=None)):
        p = decide(100, SLOW, [lacking], SLO, engaged=False)
        assert (p.aggregate, p.reason, p.engaged) == (False, agg.NO_DECODE_SLACK, True)


def test_local_prefill_must_beat_the_queue() -> None:
    # the decode worker prefills at 5 tok/s: 20 s for the prompt, worse than the 9.1 s queue
    p = decide(100, SLOW, [slack(tokens_per_s=5.0)], SLO, engaged=False)
    assert (p.aggregate, p.reason) == (False, agg.NO_DECODE_SLACK)


def test_a_decode_worker_lends_at_most_its_budget_of_the_target_to_one_prompt() -> None:
    # 0.2 s of prefill fits LOCAL_BUDGET x 1 s; 0.3 s would stall its streams longer: the prompt stays remote
    assert decide(200, SLOW, [slack()], SLO, engaged=False).aggregate
    p = decide(300, SLOW, [slack()], SLO, engaged=False)
    assert (p.aggregate, p.reason, p.engaged) == (False, agg.NO_DECODE_SLACK, True)
    # a prompt no single instance prefills within the target never stalls a decode batch
    p = decide(5000, PrefillBacklog(0, 1000.0), [slack()], SLO, engaged=False)
    assert p.remote_s == pytest.approx(5.0) and not p.aggregate


def test_an_unmeasured_decode_worker_is_estimated_at_the_prefill_pools_speed() -> None:
    p = decide(100, SLOW, [slack(tokens_per_s=None)], SLO, engaged=False)
    assert p.aggregate and p.local_s == pytest.approx(0.1)


def test_cached_prefixes_count_on_both_sides() -> None:
    # 1500 of the prompt cached on the prefill worker: 100 queued + 500 uncached = 0.6 s, under the target
    p = decide(2000, PrefillBacklog(100, 1000.0, cached_tokens=1500), [slack()], SLO, engaged=False)
    assert p.remote_s == pytest.approx(0.6) and not p.aggregate
    # a decode worker holding most of the prompt prefills only the rest
    p = decide(2000, SLOW, [slack(cached_tokens=1850)], SLO, engaged=False)
    assert p.aggregate and p.local_s == pytest.approx(0.15)


def test_hysteresis_engages_above_the_target_and_disengages_under_the_exit_ratio() -> None:
    def at(remote_s: float, engaged: bool) -> agg.Placement:
        # 100-token prompt, queue sized for the wanted estimate at 1000 tok/s
        return decide(100, PrefillBacklog(int(remote_s * 1000) - 100, 1000.0), [slack()], SLO, engaged)

    assert not at(0.9, engaged=False).engaged  # under the target: stays off
    assert at(1.1, engaged=False).engaged  # over it: on
    between = at(0.9, engaged=True)  # between exit ratio and target: the previous state holds
    assert between.engaged and between.aggregate
    off = at(0.7, engaged=True)  # under EXIT_RATIO x target: off again
    assert not off.engaged and not off.aggregate and off.reason == agg.PROMPT_LENGTH


def test_placements_count_and_describe() -> None:
    ps = agg.Placements()
    ps.count(agg.AGGREGATED, agg.PREFILL_BACKLOG)
    ps.count(agg.AGGREGATED, agg.PREFILL_BACKLOG)
    ps.count(agg.DISAGGREGATED, agg.PROMPT_LENGTH)
    d = ps.describe()
    assert d["placements"] == [{"placement": "aggregated", "reason": "prefill_backlog", "count": 2},
                               {"placement": "disaggregated", "reason": "prompt_length", "count": 1}]


# ---- the Flow, over scripted workers --------------------------------------------------------------------

def _flow(script: Script, slo: float) -> Any:
    flow = make_flow(script, decode=(DECODE, DECODE2), threshold=16, ttft_slo=slo)
    p = flow.pool.get("prefill", PREFILL)
    p.prefill_tokens_per_s, p.outstanding_prompt_tokens = 1000.0, 5000  # 5 s of queue
    for url, free in ((DECODE, 1), (DECODE2, 500)):  # DECODE has no KV room for the request
        d = flow.pool.get("decode", url)
        d.block_size, d.free_blocks, d.total_blocks, d.max_batch_size = 16, free, 512, 16
    return flow


def _generate_answers(script: Script) -> None:
    async def gen(_: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, stream=Lines(tokens(7, int(body["params"]["max_tokens"]))))

    for url in (DECODE, DECODE2):
        script.on(url, "/internal/generate", gen)


async def _run(flow: Any, n_prompt: int) -> list[int]:
    tok = Tokenized(prompt_token_ids=list(range(1, n_prompt + 1)), params={"max_tokens": 3}, model="m")
    out: list[int] = []
    async for c in flow.run("r", tok):
        out.extend(c.token_ids)
    return out


def test_flow_prefills_on_the_decode_worker_with_room_when_the_queue_misses_the_target() -> None:
    script = Script()
    _generate_answers(script)
    flow = _flow(script, slo=1.0)
    assert asyncio.run(_run(flow, 100)) == [7, 8, 9]
    assert script.paths(DECODE2) == ["/internal/generate"] and not script.paths(PREFILL)
    assert not script.paths(DECODE)  # no room there: never asked
    assert flow.placements.counts == {("aggregated", "prefill_backlog"): 1}
    assert flow.placements.engaged and flow.placements.last.remote_s == pytest.approx(5.1)


def test_flow_keeps_the_length_rule_without_a_target_and_counts_short_prompts() -> None:
    script = Script()
    _generate_answers(script)
    flow = _flow(script, slo=0.0)
    # a short prompt: on a decode worker by the length rule
    assert asyncio.run(_run(flow, 8)) == [7, 8, 9]
    assert flow.placements.counts == {("aggregated", "short_prompt"): 1}
    assert not flow.placements.engaged and flow.placements.last is None
