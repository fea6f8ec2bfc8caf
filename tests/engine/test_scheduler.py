"""Scheduler: prefill token budget, chunked prefill, batch size, FCFS order, prefill/decode alternation."""

from __future__ import annotations

from pdcluster.worker.engine.block_manager import BlockManager
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.engine.scheduler import Scheduler
from pdcluster.worker.engine.sequence import Sequence


def make(num_blocks=64, **kw) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 8), None, **kw)


def seq(n: int, rid: str) -> Sequence:
    base = 1000 * sum(map(ord, rid))  # distinct tokens: no accidental prefix-cache hits between requests
    return Sequence(rid, list(range(base, base + n)), SamplingParams())


def run_prefill(s: Scheduler, batch) -> None:
    for q, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        if s.finish_prefill_chunk(q, n):
            q.token_ids.append(0)
            s.start_decoding(q)


def test_prefill_respects_token_budget_and_chunks_long_prompts():
    s = make(max_batch_tokens=32)
    a, b, c = seq(20, "a"), seq(30, "b"), seq(5, "c")
    for q in (a, b, c):
        s.add(q)
    batch = s.schedule()
    assert batch.is_prefill and batch.seqs == [a, b] and batch.num_new_tokens == [20, 12]  # b is chunked
    run_prefill(s, batch)
    assert s.running == [a] and s.waiting[0] is b and b.num_computed_tokens == 12
    assert not s.schedule().is_prefill  # a decodes between prefill steps
    batch = s.schedule()
    assert batch.is_prefill and batch.seqs == [b, c] and batch.num_new_tokens == [18, 5]


def test_decode_batch_bounded_by_max_batch_size():
    s = make(max_batch_size=2)
    qs = [seq(4, f"r{i}") for i in range(3)]
    for q in qs:
        s.add(q)
    batch = s.schedule()
    assert batch.seqs == qs[:2]  # the third waits for a slot
    run_prefill(s, batch)
    batch = s.schedule()
    assert not batch.is_prefill and batch.seqs == qs[:2]


def test_fcfs_head_of_line_is_not_overtaken():
    s = make(num_blocks=6, watermark=0.0)
    big, small = seq(60, "big"), seq(4, "small")  # big needs 8 blocks: more than there are
    s.add(big)
    s.add(small)
    assert s.schedule() is None  # small does not jump the queue
    assert big.block_table == [] and small.block_table == []


def test_watermark_keeps_free_blocks_for_running_sequences():
    s = make(num_blocks=10, watermark=0.2)  # keep 2 blocks free while anything runs
    a = seq(20, "a")
    s.add(a)
    run_prefill(s, s.schedule())
    b = seq(40, "b")  # 5 blocks; 3 used + 5 = 8 leaves 2: allowed
    s.add(b)
    s.schedule()  # decode turn for a
    assert s.schedule().seqs == [b]
    c = seq(8, "c")
    s.add(c)
    s.schedule()
    batch = s.schedule()
    assert batch is not None and c not in batch.seqs  # 1 more block would dip into the watermark


def test_decode_preempts_latest_arrival_first():
    s = make(num_blocks=4, watermark=0.0, preemption_mode="recompute")
    a, b = seq(16, "a"), seq(16, "b")
    s.add(a)
    s.add(b)
    run_prefill(s, s.schedule())  # 4 blocks used; each needs a 3rd block to decode
    batch = s.schedule()
    assert batch.seqs == [a] and s.waiting == [b] and b.block_table == [] and s.num_preemptions == 1


def test_imported_sequences_wait_for_a_batch_slot():
    s = make(max_batch_size=1)
    a, b = seq(4, "a"), seq(4, "b")
    for q in (a, b):
        assert s.bm.allocate(q, len(q))
        q.num_computed_tokens = len(q)
        q.token_ids.append(7)  # the first token, sampled by the prefill worker
        s.add_running(q)
    assert s.running == [a] and s.swapped == [b]
    assert s.schedule().seqs == [a]
    s.remove(a)
    assert s.schedule().seqs == [b]  # b takes the freed slot, keeping the blocks it imported into
    s.remove(b)
    s.bm.check_no_leaks()


def test_partial_prefill_yields_blocks_to_an_earlier_request_when_nothing_runs():
    s = make(num_blocks=6, watermark=0.0, max_batch_tokens=32)
    early, late = seq(30, "early"), seq(40, "late")  # early arrived first but is queued after late's chunk
    s.add(late)
    batch = s.schedule()
    assert batch.seqs == [late] and batch.num_new_tokens == [32]
    s.finish_prefill_chunk(late, 32)  # late holds 4 of 6 blocks, part-way through its prompt
    s.add(early)
    batch = s.schedule()
    assert batch.seqs == [early]  # FCFS: the earlier request gets the blocks, late starts over
    assert late.block_table == [] and late.num_computed_tokens == 0
    for q in (early, late):
        s.remove(q)
    s.bm.check_no_leaks()


def test_mixed_step_decodes_first_and_fills_the_rest_of_the_budget():
    s = make(max_batch_tokens=16, mixed=True)
    a, b = seq(6, "a"), seq(40, "b")
    s.add(a)
    run_prefill(s, s.schedule())  # a decodes from here
    s.add(b)
    batch = s.schedule()
    assert batch.is_prefill and batch.num_decode == 1
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 15]  # the decode token comes off the budget
    a.num_computed_tokens += 1
    s.finish_prefill_chunk(b, 15)
    batch = s.schedule()  # no decode-only turn in between
    assert batch.num_decode == 1 and batch.seqs == [a, b] and batch.num_new_tokens == [1, 15]


def test_mixed_step_admits_no_prefill_when_decode_had_to_preempt():
    s = make(num_blocks=4, max_batch_tokens=64, mixed=True, watermark=0.0, preemption_mode="recompute")
    a, b = seq(16, "a"), seq(15, "b")  # 2 blocks each
    s.add(a)
    s.add(b)
    run_prefill(s, s.schedule())
    a.num_computed_tokens += 1  # a's next token needs a third block: only by preempting b (the latest)
    a.token_ids.append(0)
    s.add(seq(3, "c"))
    batch = s.schedule()
    assert s.num_preemptions == 1 and b in s.waiting
    assert not batch.is_prefill and batch.seqs == [a]  # neither the victim nor c prefilled in that step
