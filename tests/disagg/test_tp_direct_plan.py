"""The decisions of the direct KV path between TP layouts, without processes: which LoadSpec each decode rank
gets, when the router asks for the direct path, what the step message tells followers, and the internal
bodies' new optional fields (bad values are a validation error, i.e. a 400, never a crash)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdcluster.worker.api.internal import PrefillBody, ReserveBody
from pdcluster.worker.engine.parallel import step
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.engine.scheduler import Batch
from pdcluster.worker.engine.sequence import Sequence
from pdcluster.worker.router.pool import Worker, direct_pair
from pdcluster.worker.server.tp_direct import decode_specs


def test_decode_specs_cover_each_ranks_heads_from_the_plan() -> None:
    # 2 KV heads, prefill TP 2 -> decode TP 4: each decode rank holds one (replicated) head, from one sender
    specs = decode_specs("r", 3, 17, 2, 64, 2, 4)
    assert [(s.head_offset, s.kv_heads, s.pieces) for s in specs] == [
        (0, 1, ((0, 1),)), (0, 1, ((0, 1),)), (1, 1, ((1, 1),)), (1, 1, ((1, 1),))]
    assert all((s.request_id, s.num_layers, s.num_tokens, s.head_dim) == ("r", 3, 17, 64) for s in specs)
    # 4 KV heads, TP 2 -> TP 1: rank 0 expects two ranges (one per prefill rank), all 4 heads
    (one,) = decode_specs("r", 2, 5, 4, 8, 2, 1)
    assert (one.head_offset, one.kv_heads, one.pieces) == (0, 4, ((0, 2), (2, 2)))
    with pytest.raises(ValueError, match="prefill TP 3"):
        decode_specs("r", 2, 5, 4, 8, 3, 1)


def test_router_asks_for_direct_only_when_both_advertise_and_not_tp1_pair() -> None:
    def w(tp: int, direct: bool) -> Worker:
        return Worker("http://127.0.0.1:1", "prefill", tensor_parallel_size=tp, kv_direct=direct)

    assert direct_pair(w(2, True), w(1, True)) and direct_pair(w(1, True), w(2, True))
    assert not direct_pair(w(1, True), w(1, True))  # TP 1 -> TP 1 stays whole layers, byte for byte
    assert not direct_pair(w(2, False), w(2, True)) and not direct_pair(w(2, True), w(2, False))


def test_step_message_names_direct_exports_and_their_targets() -> None:
    a, b = Sequence("a", [1, 2, 3], SamplingParams()), Sequence("b", [4, 5], SamplingParams())
    for s in (a, b):
        s.prefill_only = True
    batch = Batch([a, b], [3, 2], True)
    targets = [("127.0.0.1", 5000), ("127.0.0.1", 5001)]
    assert step.export_ranges(batch, {"b": targets}) == [(0, 0, 3, "a", None), (1, 0, 2, "b", targets)]
    assert step.export_ranges(batch) == [(0, 0, 3, "a", None), (1, 0, 2, "b", None)]


def test_internal_bodies_take_the_optional_fields_and_refuse_bad_ones() -> None:
    run = {"request_id": "x", "prompt_token_ids": [1], "params": {"max_tokens": 1}}
    assert ReserveBody.model_validate(run).prefill_tp is None
    assert ReserveBody.model_validate({**run, "prefill_tp": 2}).prefill_tp == 2
    target = {"host": "h", "port": 9}
    assert PrefillBody.model_validate({**run, "target": target}).target.rank_ports is None
    got = PrefillBody.model_validate({**run, "target": {**target, "rank_ports": [9, 10]}})
    assert got.target.rank_ports == [9, 10]
    for bad in ({"prefill_tp": 0}, {"prefill_tp": "2"}):
        with pytest.raises(ValidationError):
            ReserveBody.model_validate({**run, **bad})
    for ports in ([], [0], [70000], ["9"]):
        with pytest.raises(ValidationError):
            PrefillBody.model_validate({**run, "target": {**target, "rank_ports": ports}})


def test_network_policy_opens_one_kv_port_per_decode_rank() -> None:
    from pdcluster.operator.models import KV_TRANSFER_PORT
    from pdcluster.operator.naming import Owner
    from pdcluster.operator.policies import render_network_policy

    owner = Owner("c", "ns", "uid")
    kv = render_network_policy(owner)["spec"]["ingress"][1]["ports"]
    assert kv == [{"protocol": "TCP", "port": KV_TRANSFER_PORT}]  # TP 1: as before
    kv = render_network_policy(owner, 4)["spec"]["ingress"][1]["ports"]
    assert kv == [{"protocol": "TCP", "port": KV_TRANSFER_PORT, "endPort": KV_TRANSFER_PORT + 3}]


class NixlConnector:  # named as the real one: DirectKV decides by the connector's class name
    pass


class TCPConnector:
    pass


@pytest.mark.parametrize(("path", "conn", "direct"), [
    ("auto", TCPConnector, True), ("auto", NixlConnector, True), ("direct", NixlConnector, True),
    ("relay", TCPConnector, False), ("auto", None, False)])
def test_which_path_auto_direct_and_relay_choose(path: str, conn: type | None, direct: bool) -> None:
    """auto and direct: the direct path over either backend (NIXL's was held back until its one-token staging
    alias was fixed and CI ran it green); relay as asked; no connector (no secret): the relay, whatever was asked."""
    from types import SimpleNamespace

    from pdcluster.worker.server.tp_direct import DirectKV

    disagg = SimpleNamespace(engine=None, num_layers=2, kv_heads=4, head_dim=8, timeout=5.0, transfer_port=None,
                             connector=conn() if conn else None)
    kv = DirectKV(disagg, path=path)
    assert kv.enabled is direct
    assert direct or kv.reason
