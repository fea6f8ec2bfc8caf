"""The router's pure decisions."""

from __future__ import annotations

from pdcluster.worker.router.picking import (
    WorkerView,
    admit,
    blocks_needed,
    health_transition,
    pick_decode,
    pick_prefill,
    rank_decode,
    retry_after_seconds,
    should_disaggregate,
)


def w(url: str, **kw: object) -> WorkerView:
    return WorkerView(url=url, role=str(kw.pop("role", "decode")), **kw)  # type: ignore[arg-type]


def test_prefill_least_outstanding_prompt_tokens() -> None:
    ws = [w("a", role="prefill", outstanding_prompt_tokens=900), w("b", role="prefill", outstanding_prompt_tokens=10),
          w("c", role="prefill", outstanding_prompt_tokens=10, in_flight=3)]
    assert pick_prefill(ws).url == "b"  # type: ignore[union-attr]
    assert pick_prefill(ws, exclude={"b"}).url == "c"  # type: ignore[union-attr]


def test_prefill_skips_unhealthy_and_none_left() -> None:
    ws = [w("a", role="prefill", healthy=False)]
    assert pick_prefill(ws) is None
    assert pick_prefill([]) is None


def test_decode_prefers_same_node_then_load_then_free_blocks() -> None:
    ws = [w("far", node="n2", free_blocks=1000), w("near", node="n1", free_blocks=10, running=5),
          w("near2", node="n1", free_blocks=50, running=5)]
    assert pick_decode(ws, prefer_node="n1").url == "near2"  # type: ignore[union-attr]
    assert pick_decode(ws).url == "far"  # type: ignore[union-attr]  # no node known: least loaded
    idle = [w("x", free_blocks=10), w("y", free_blocks=90)]
    assert pick_decode(idle).url == "y"  # type: ignore[union-attr]


def test_decode_router_in_flight_spreads_a_burst() -> None:
    ws = [w("x", free_blocks=100, in_flight=2), w("y", free_blocks=100, in_flight=1)]
    assert pick_decode(ws).url == "y"  # type: ignore[union-attr]


def test_decode_respects_needed_blocks_but_allows_unknown() -> None:
    ws = [w("full", free_blocks=2), w("unknown")]
    assert pick_decode(ws, need_blocks=8).url == "unknown"  # type: ignore[union-attr]
    assert pick_decode([w("full", free_blocks=2)], need_blocks=8) is None


def test_rank_decode_orders_all_usable() -> None:
    ws = [w("a", running=3), w("b", running=1), w("c", healthy=False), w("d", running=0)]
    assert [v.url for v in rank_decode(ws, exclude={"d"})] == ["b", "a"]


def test_conditional_disaggregation() -> None:
    assert should_disaggregate(300, 256, True)
    assert not should_disaggregate(100, 256, True)
    assert not should_disaggregate(10_000, 256, False)  # no prefill pool: decode workers prefill
    assert should_disaggregate(1, 0, True)


def test_blocks_and_admission() -> None:
    assert blocks_needed(17, 16, 16) == 3
    assert blocks_needed(16, 0, 16) == 1
    assert admit(3, 4) and not admit(4, 4)
    assert admit(10_000, None) and admit(5, 0)
    assert retry_after_seconds(10, 0) == 1
    assert retry_after_seconds(100, 2.0) == 30  # capped
    assert retry_after_seconds(10, 2.0) == 5


def test_health_transitions_drop_after_two_and_readmit_on_one() -> None:
    h, f = health_transition(True, 0, ok=False)
    assert (h, f) == (True, 1)  # one lost probe is not an outage
    h, f = health_transition(h, f, ok=False)
    assert (h, f) == (False, 2)
    assert health_transition(False, 5, ok=True) == (True, 0)


def test_rank_decode_exclusion_is_a_preference_when_nothing_else_is_healthy() -> None:
    # one decode worker that failed this request, then came back (restarted): it is the only choice
    ws = [WorkerView("a", "decode"), WorkerView("b", "decode", healthy=False)]
    assert [v.url for v in rank_decode(ws, exclude={"a"})] == ["a"]
    assert rank_decode([WorkerView("a", "decode", healthy=False)], exclude=set()) == []
