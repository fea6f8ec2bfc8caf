"""Scheduler fairness between client requests (issue 38 row 7): one request's n sibling sequences keep to a fair
share of the batch while another request is queued, so a plain request gets its first token within a step or
two instead of after the whole fan-out; the fan-out still progresses and finishes every sequence."""

from __future__ import annotations

import uuid

import pytest

from pdcluster.worker.engine.block_manager import BlockManager
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.engine.scheduler import Batch, Scheduler
from pdcluster.worker.engine.sequence import Sequence, SequenceStatus, request_group

from .conftest import prompt_of

MAX_TOKENS = 40


def api_id(kind: str = "cmpl") -> str:
    return f"{kind}-{uuid.uuid4().hex}"  # what the API names a client request (api/responses.new_id)


def fan_out(rid: str, n: int, prompt: list[int] | None = None) -> list[Sequence]:
    """A request's n choices, named as the worker's API (and, with `-<attempt>`, the router) names them."""
    return [Sequence(f"{rid}-{i}", prompt or [7, 8, 9, 10], SamplingParams(max_tokens=MAX_TOKENS)) for i in range(n)]


def plain() -> Sequence:
    return Sequence(api_id(), [1, 2, 3], SamplingParams(max_tokens=MAX_TOKENS))


class Driver:
    """Plays the engine's part after each forward: prefill chunks complete, every computed sequence gets one
    token, a sequence with max_tokens outputs finishes. Records the step at which each got its first token."""

    def __init__(self, s: Scheduler) -> None:
        self.s, self.steps = s, 0
        self.first_token: dict[str, int] = {}
        self.finished: list[Sequence] = []

    def step(self) -> Batch | None:
        batch = self.s.schedule()
        self.steps += 1
        if batch is None:
            return None
        decoding = batch.seqs[: batch.num_decode] if batch.is_prefill else batch.seqs
        for seq in decoding:
            seq.num_computed_tokens += 1
            self._token(seq)
        if batch.is_prefill:
            for seq, n in zip(batch.seqs[batch.num_decode:], batch.num_new_tokens[batch.num_decode:], strict=True):
                if self.s.finish_prefill_chunk(seq, n):
                    self._token(seq)
                    if not seq.is_finished:
                        self.s.start_decoding(seq)
        return batch

    def _token(self, seq: Sequence) -> None:
        seq.token_ids.append(5)
        self.first_token.setdefault(seq.request_id, self.steps)
        if seq.num_output_tokens >= seq.params.max_tokens:
            self.s.remove(seq)
            seq.status = SequenceStatus.FINISHED
            self.finished.append(seq)


def make(mixed: bool = True, **kw) -> Scheduler:
    return Scheduler(BlockManager(2048, 8), BlockManager(256, 8), max_batch_size=16, mixed=mixed, **kw)


def test_request_group_is_the_api_id_its_sequences_derive_from():
    rid = api_id("chatcmpl")
    assert request_group(f"{rid}-3") == rid  # the worker's n choices
    assert request_group(f"{rid}-3-2") == rid  # the router's choice 3, attempt 2
    assert request_group(rid) == rid
    assert request_group("req-1") == "req-1"  # any other id is its own request
    assert Sequence("x", [1], SamplingParams(), group="g").group == "g"


@pytest.mark.parametrize(("mixed", "mode"), [(True, "recompute"), (False, "recompute"), (True, "swap")])
def test_plain_request_beside_a_big_fan_out_gets_its_first_token_promptly(mixed, mode):
    s = make(mixed, preemption_mode=mode)
    d = Driver(s)
    big = fan_out(api_id(), 64)
    for q in big:
        s.add(q)
    for _ in range(4):
        d.step()
    assert len(s.running) == 16 and all(q.group == big[0].group for q in s.running)  # alone, it fills the batch
    p = plain()
    s.add(p)
    arrived = d.steps
    while p.request_id not in d.first_token:
        d.step()
        assert d.steps - arrived <= 3, "the plain request waits behind the fan-out"
    # Strict FCFS would have made it wait until a sibling finished: about MAX_TOKENS steps.
    assert d.first_token[p.request_id] - arrived <= 3 < MAX_TOKENS
    assert s.num_preemptions == 1  # one sibling made room, the way the scheduler preempts for blocks
    assert sum(q.status == SequenceStatus.SWAPPED for q in big) == (mode == "swap")
    # the fan-out keeps running beside it, and every sibling still finishes with all its tokens
    while s.has_work():
        left = sum(not q.is_finished for q in big)
        batch = d.step()
        assert batch is not None  # and the plain request never costs the fan-out its share of a step
        if batch.num_decode or not batch.is_prefill:  # a step that decodes (a prefill-only one may not)
            assert sum(q.group == big[0].group for q in batch.seqs) >= min(left, 8)  # half: 2 requests
            assert len(batch.seqs) >= min(16, left + (not p.is_finished))  # and no slot is left idle
    assert sorted(q.request_id for q in d.finished) == sorted(q.request_id for q in [*big, p])
    assert all(q.num_output_tokens == MAX_TOKENS for q in d.finished)


def test_two_fan_outs_converge_to_half_the_batch_each():
    s = make(mixed=True)
    d = Driver(s)
    a, b = fan_out(api_id(), 32), fan_out(api_id(), 32)
    for q in a:
        s.add(q)
    d.step()
    for q in b:
        s.add(q)
    for _ in range(MAX_TOKENS + 4):  # a's first wave finishes; its later siblings no longer take b's share
        d.step()
    held = {g: sum(q.group == g for q in s.running) for g in (a[0].group, b[0].group)}
    assert held == {a[0].group: 8, b[0].group: 8}


def test_plain_request_beside_two_fan_outs_still_gets_a_slot():
    """The share is the batch split between the requests with work: two fan-outs holding 8 slots each are both
    above a third of it, so a plain request does not wait for either to finish."""
    s = make()
    d = Driver(s)
    a, b = fan_out(api_id(), 32), fan_out(api_id(), 32)
    for q in a:
        s.add(q)
    d.step()
    for q in b:
        s.add(q)
    for _ in range(MAX_TOKENS + 4):
        d.step()
    p = plain()
    s.add(p)
    arrived = d.steps
    while p.request_id not in d.first_token:
        d.step()
        assert d.steps - arrived <= 2, "the plain request waits behind two fan-outs"
    while s.has_work():
        d.step()
    assert len(d.finished) == 65 and all(q.num_output_tokens == MAX_TOKENS for q in d.finished)


def test_a_lone_fan_out_is_not_capped():
    s = make(mixed=True)
    d = Driver(s)
    for q in fan_out(api_id(), 40):
        s.add(q)
    for _ in range(3):
        d.step()
    assert len(s.running) == 16 and s.num_preemptions == 0


def test_imported_plain_request_overtakes_parked_siblings():
    """Disaggregated decode: imported sequences beyond the batch wait in the swapped queue, in arrival order;
    a plain request imported after a big fan-out still gets a slot at the next step."""
    s = make(mixed=True)
    d = Driver(s)

    def imported(seq: Sequence) -> Sequence:
        assert s.reserve_for_import(seq)
        seq.num_computed_tokens = len(seq)
        s.bm.commit(seq)
        seq.token_ids.append(5)  # the first token came from the prefill worker
        s.add_running(seq)
        return seq

    big = [imported(q) for q in fan_out(api_id(), 24)]
    assert len(s.running) == 16 and len(s.swapped) == 8
    d.step()
    p = imported(plain())
    assert p.status == SequenceStatus.SWAPPED
    batch = d.step()
    assert batch is not None and p in batch.seqs
    while s.has_work():
        d.step()
    assert len(d.finished) == len(big) + 1 and all(q.num_output_tokens == MAX_TOKENS for q in d.finished)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_engine_outputs_unchanged_when_fairness_preempts(make_engine, mode):
    """The real engine: a fan-out filling the batch gives a plain request a slot at once, by preempting a
    sibling; every sequence still produces exactly the tokens it produces alone (greedy, seeded)."""
    prompts = [prompt_of(n, seed=n) for n in (12, 7, 19, 9, 15, 11)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)]
    for p in params:
        expected = make_engine(block_size=8).generate(prompts, p)
        engine = make_engine(block_size=8, max_batch_size=4, preemption_mode=mode)
        rid = api_id()
        ids = [f"{rid}-{i}" for i in range(len(prompts) - 1)]
        for i, prompt in zip(ids, prompts, strict=False):
            engine.add_request(i, prompt, p)
        got: dict[str, list[int]] = {}
        for _ in range(3):
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert engine.stats()["requests_running"] == 4
        lone = api_id()
        engine.add_request(lone, prompts[-1], p)
        for _ in range(2):  # the plain request's first token within two steps of its arrival
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert got.get(lone), "the plain request waits behind the fan-out"
        assert engine.stats()["preemptions_total"] == 1
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert [got[i] for i in [*ids, lone]] == expected
    if mode == "swap":
        assert engine.runner._host_cache is not None  # the sibling really went through host memory


def test_long_prompts_of_a_fan_out_leave_prefill_budget_for_a_plain_request():
    """A fan-out of long prompts takes at most half of a prefill step's tokens while another request waits
    (beyond a prompt already part-way in), so the plain prompt is not queued behind share x prompt tokens."""
    s = Scheduler(BlockManager(2048, 8), None, max_batch_size=16, max_batch_tokens=64, mixed=True)
    d = Driver(s)
    for q in fan_out(api_id(), 8, list(range(100, 140))):
        s.add(q)
    d.step()
    p = plain()
    s.add(p)
    batch = d.step()
    assert batch is not None and p in batch.seqs
