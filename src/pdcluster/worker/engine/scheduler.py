"""Continuous batching: which sequences run in the next step, and who makes room when blocks run out.

A step is a prefill step (chunks of waiting prompts, bounded by ``max_batch_tokens``; a prompt longer than
what is left of the budget is cut, and continues next time), a decode step (one token for each running
sequence, at most ``max_batch_size``), or, with ``mixed`` (the engine's default), a mixed step: every running
sequence's next token plus prefill chunks in what is left of the token budget, in one forward. Mixed steps
read the weights once for both, and a waiting prompt never waits for a decode-only turn. Without ``mixed``,
after a prefill step a decode step runs whenever anything is decoding (so long prompts slow decoding by at
most half but never stop it).

Order is strictly FCFS by arrival: a request that cannot get blocks blocks those behind it (no starvation
of big requests), swapped-out requests come back before new ones are admitted, and the victim of a
preemption is always the latest arrival. New work is only admitted while a watermark of free blocks
remains, so decoding sequences can grow into that reserve instead of preempting each other at once.

FCFS is by client request, not by sequence. The sequences of one request (its ``n`` choices, its batched
prompts: one ``Sequence.group``) have a fair share of the batch's slots, the batch split evenly between the
requests with work, and half of a prefill step's tokens. While another request is queued, a request's
sequences past its share wait until the others' have had their turn, then fill what room is left (FCFS
within each pass); when the batch is full and a queued request has nothing running, the largest request
above its share gives up its latest sequence (swapped or recomputed, as for blocks). So a plain request
beside an ``n: 128`` one gets a slot within a step instead of after all 128; a request is never cut below
its share, so the big one keeps progressing, and alone it still fills the whole batch.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from pdcluster.worker.engine.block_manager import BlockManager
from pdcluster.worker.engine.sequence import Sequence, SequenceStatus

PreemptionMode = Literal["swap", "recompute", "auto"]


@dataclass
class Batch:
    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool
    # ("out", device ids, host ids) / ("in", host ids, device ids), to run in this order before the forward
    copies: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    # A mixed step (is_prefill and num_decode > 0): its first num_decode sequences decode one token each and
    # the rest are prefill chunks. 0 for a prefill step; a decode step has is_prefill False.
    num_decode: int = 0


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        host_blocks: BlockManager | None,
        *,
        max_batch_size: int = 16,
        max_batch_tokens: int = 2048,
        watermark: float = 0.15,
        preemption_mode: PreemptionMode = "auto",
        choose_mode: Callable[[Sequence], Literal["swap", "recompute"]] | None = None,
        mixed: bool = False,
    ) -> None:
        self.bm, self.host = block_manager, host_blocks
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.preemption_mode = preemption_mode
        self.choose_mode = choose_mode
        self.mixed = mixed
        self.waiting: list[Sequence] = []  # sorted by arrival; the head may be part-way through prefill
        self.running: list[Sequence] = []  # sorted by arrival
        self.swapped: list[Sequence] = []  # sorted by arrival
        self.last_was_prefill = False
        self.num_preemptions = 0
        self._fair_victims: list[Sequence] = []  # preempted for fairness in this step

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already complete (imported) joins decoding, or waits for a batch slot."""
        seq.status = (
            SequenceStatus.SWAPPED if len(self.running) >= self.max_batch_size else SequenceStatus.RUNNING
        )
        queue = self.running if seq.status == SequenceStatus.RUNNING else self.swapped
        bisect.insort(queue, seq, key=lambda s: s.arrival)

    def remove(self, seq: Sequence) -> None:
        """Drop ``seq`` from whatever queue holds it and free its blocks (abort or finish)."""
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.block_table:
            self.bm.free_seq(seq)
        if seq.host_block_table and self.host is not None:
            self.host.free_blocks(seq.host_block_table)
            seq.host_block_table = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _reserve(self) -> int:
        # Admission keeps the watermark free, except when nothing runs: then the head must get its chance.
        return self.watermark_blocks if self.running else 0

    def reserve_for_import(self, seq: Sequence) -> bool:
        """Allocate blocks for ``seq``'s whole prompt (its KV will be imported), under the same admission
        watermark as a local prefill. False, and nothing allocated, when they are not free now."""
        return self.bm.allocate(seq, len(seq), reserve=self._reserve())

    # -- scheduling -------------------------------------------------------------------------------------

    def schedule(self) -> Batch | None:
        copies: list[tuple[str, list[int], list[int]]] = []
        self._make_fair_room(copies)
        self._swap_in(copies)
        if self.mixed and self.running and self.waiting and not self._swap_pending():
            return self._schedule_mixed(copies)
        prefill_turn = not (self.last_was_prefill and self.running)
        if prefill_turn and not self._swap_pending() and self.waiting:
            batch = self._schedule_prefill()
            if batch is not None:
                batch.copies = copies
                self.last_was_prefill = True
                return batch
        self.last_was_prefill = False
        if not self.running:
            return Batch([], [], False, copies) if copies else None
        return self._schedule_decode(copies)

    # -- fairness between client requests (see the module docstring) ----------------------------------

    def _shares(self) -> tuple[Counter[str], Counter[str], int]:
        """Running sequences per client request, queued ones per request, and the fair share of slots: the
        batch split evenly between the requests that have work (at least one each)."""
        slots = Counter(s.group for s in self.running)
        queued = Counter(s.group for s in (*self.waiting, *self.swapped))
        return slots, queued, max(1, self.max_batch_size // max(1, len(slots.keys() | queued.keys())))

    @staticmethod
    def _contested(group: str, queued: Counter[str]) -> bool:
        return len(queued) > (1 if group in queued else 0)  # another request is queued

    def _over_share(self, seq: Sequence, slots: Counter[str], queued: Counter[str], share: int) -> bool:
        """``seq``'s request already holds its share of slots while another request is queued."""
        return slots[seq.group] >= share and self._contested(seq.group, queued)

    def _swap_pending(self) -> bool:
        """A swapped sequence is owed its slot before new prefills: one its request's share still allows."""
        if not self.swapped:
            return False
        slots, queued, share = self._shares()
        return any(not self._over_share(s, slots, queued, share) for s in self.swapped)

    def _make_fair_room(self, copies: list[tuple[str, list[int], list[int]]]) -> None:
        """With every slot taken, the largest request above its share gives up its latest sequence (swap or
        recompute, as for blocks) for each queued request that has nothing running; without this, a request
        with n >= max_batch_size would hold the whole batch until its siblings finish (max_tokens steps)."""
        self._fair_victims = []
        if len(self.running) < self.max_batch_size:
            return
        slots, queued, share = self._shares()
        for _ in [g for g in queued if not slots[g]]:
            group, held = slots.most_common(1)[0]
            if held <= share:
                return
            victim = next(s for s in reversed(self.running) if s.group == group)
            self._preempt(victim, copies)
            self._fair_victims.append(victim)  # not prefilled again in the step that evicted it
            slots[group] -= 1

    def _swap_in(self, copies: list[tuple[str, list[int], list[int]]]) -> None:
        slots, queued, share = self._shares()
        while len(self.running) < self.max_batch_size:
            seq = next((s for s in self.swapped if not self._over_share(s, slots, queued, share)), None)
            if seq is None:
                break
            # blocks for every computed token plus the one this step's decode will write
            need = self.bm.blocks_for(len(seq)) - len(seq.block_table)  # imported ones already hold blocks
            host_ids = seq.host_block_table
            if self.bm.num_free_blocks - need < self._reserve():
                if self.running or need > self.bm.num_free_blocks + self._partial_prefill_blocks():
                    break
                self._free_partial_prefills(keep=None)  # nothing runs: only they can stand in the way
            dev_ids = self.bm.allocate_blocks(need)
            assert dev_ids is not None
            if host_ids:
                copies.append(("in", list(host_ids), dev_ids[: len(host_ids)]))
                assert self.host is not None
                self.host.free_blocks(host_ids)
            seq.block_table, seq.host_block_table = seq.block_table + dev_ids, []
            self.swapped.remove(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            slots[seq.group] += 1
            queued[seq.group] -= 1
            queued += Counter()  # drops groups with nothing left queued

    def _schedule_mixed(self, copies: list[tuple[str, list[int], list[int]]]) -> Batch:
        """Decode every running sequence, then fill what is left of the token budget with prefill chunks.
        A step that had to preempt admits no prefill: blocks are short, and a recompute victim must not be
        prefilled again in the step that just evicted it."""
        preemptions = self.num_preemptions
        decode = self._schedule_decode(copies)
        self.last_was_prefill = False
        if self.num_preemptions != preemptions or not self.waiting:
            return decode
        prefill = self._schedule_prefill(self.max_batch_tokens - len(decode.seqs))
        if prefill is None:
            return decode
        return Batch(decode.seqs + prefill.seqs, decode.num_new_tokens + prefill.num_new_tokens, True, copies,
                     num_decode=len(decode.seqs))

    def _schedule_prefill(self, budget: int | None = None) -> Batch | None:
        seqs: list[Sequence] = []
        counts: list[int] = []
        budget = self.max_batch_tokens if budget is None else budget
        slots, queued, share = self._shares()
        tokens: Counter[str] = Counter()  # this step's prefill tokens per request
        half = budget // 2
        deferred: list[Sequence] = []

        def candidates() -> Iterator[Sequence]:
            # Fairness: past its share of slots, or of this step's tokens (long prompts), a request's next
            # sequence waits until the other requests' have had their turn, then fills what room is left.
            # One part-way through its prefill keeps its place.
            for seq in list(self.waiting):
                if not seq.block_table and (self._over_share(seq, slots, queued, share) or
                                            (tokens[seq.group] >= half and self._contested(seq.group, queued))):
                    deferred.append(seq)
                else:
                    yield seq
            yield from (s for s in deferred if s not in self._fair_victims)

        for seq in candidates():
            if budget <= 0 or len(self.running) + len(seqs) >= self.max_batch_size:
                break
            prefix = self.bm.lookup_prefix(seq) if not seq.block_table else []
            start = len(prefix) * self.bm.block_size if prefix else seq.num_computed_tokens
            n = min(len(seq) - start, budget)
            if not self.bm.allocate(seq, start + n, prefix, reserve=self._reserve()):
                if seqs or self.running:
                    break  # FCFS: nobody overtakes the head
                self._free_partial_prefills(keep=seq)  # nothing runs, so only they can hold blocks
                if not self.bm.allocate(seq, start + n, prefix):
                    break
            seqs.append(seq)
            counts.append(n)
            budget -= n
            slots[seq.group] += 1
            tokens[seq.group] += n
        return Batch(seqs, counts, True) if seqs else None

    def _partial_prefill_blocks(self) -> int:
        return sum(len(s.block_table) for s in self.waiting)

    def _free_partial_prefills(self, keep: Sequence | None) -> None:
        for other in self.waiting:
            if other is not keep and other.block_table:
                self.bm.free_seq(other)  # it restarts its prefill later (prefix cache permitting, cheaply)

    def _schedule_decode(self, copies: list[tuple[str, list[int], list[int]]]) -> Batch:
        scheduled: list[Sequence] = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            need = self.bm.blocks_for(len(seq)) - len(seq.block_table)
            while need > self.bm.num_free_blocks:
                victim = self.running[-1]
                self._preempt(victim, copies)
                if victim is seq:
                    break
            else:
                if need:
                    more = self.bm.allocate_blocks(need)
                    assert more is not None
                    seq.block_table.extend(more)
                scheduled.append(seq)
                i += 1
        return Batch(scheduled, [1] * len(scheduled), False, copies)

    def _preempt(self, seq: Sequence, copies: list[tuple[str, list[int], list[int]]]) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1
        mode = self.preemption_mode
        if mode == "auto":
            mode = self.choose_mode(seq) if self.choose_mode else "recompute"
        host_ids = None
        if mode == "swap" and self.host is not None:
            host_ids = self.host.allocate_blocks(len(seq.block_table))
        if host_ids is not None:
            copies.append(("out", list(seq.block_table), host_ids))
            computed = seq.num_computed_tokens
            self.bm.free_seq(seq)
            seq.num_computed_tokens = computed  # the KV survives in host memory
            seq.host_block_table = host_ids
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=lambda s: s.arrival)
        else:  # recompute: drop the KV; the prompt and the tokens so far are prefilled again
            self.bm.free_seq(seq)
            self.add(seq)

    # -- bookkeeping after the forward ------------------------------------------------------------------

    def finish_prefill_chunk(self, seq: Sequence, n: int) -> bool:
        """Account ``n`` computed tokens; True when the whole prompt is in (the sequence starts decoding)."""
        seq.num_computed_tokens += n
        self.bm.commit(seq)
        if seq.num_computed_tokens < len(seq):
            return False
        self.waiting.remove(seq)
        return True

    def start_decoding(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)
