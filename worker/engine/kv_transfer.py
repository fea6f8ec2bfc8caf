"""The disaggregation half of LLMEngine: exporting a prefill-only request's KV layer by layer as it is written,
and importing a request's KV from another worker (reserve, one layer at a time, commit or cancel).

A mixin rather than a separate object because both halves share one request table, one block manager and
one model runner: the KV connector (kv_connector.py) is the boundary other code sees, not this class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.engine.scheduler import Batch
from pdcluster.worker.engine.sequence import Sequence, SequenceStatus
from pdcluster.worker.engine.stop_text import StopText
from pdcluster.worker.engine.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from pdcluster.worker.engine.llm_engine import LLMEngine


class KVTransferMixin:
    def export_kv(self: LLMEngine, request_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[num_tokens, kv_heads, head_dim]`` (model dtype, dequantized) of a request's KV so far.

        During a prefill step's forward this covers the chunk being written too."""
        seq = self.seqs[request_id]
        n = self._inflight.get(request_id, seq.num_computed_tokens)
        table = torch.tensor(seq.block_table[: self.block_manager.blocks_for(n)], device=self.runner.device)
        return self.runner.cache.read(layer, table, n)

    def _exports(self: LLMEngine, batch: Batch) -> list[tuple[Sequence, int, int]]:
        """(seq, first token not yet sent, tokens written once this step ends) of the prefill-only requests
        in a prefill batch, when a connector is attached; also records the in-flight ends for export_kv."""
        if not batch.is_prefill or self.kv_connector is None:
            return []
        ends = {s.request_id: s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)}
        exports = [(s, s.num_exported_tokens, ends[s.request_id]) for s in batch.seqs if s.prefill_only]
        if exports:
            self._inflight = ends
        return exports

    def _save_layer(self: LLMEngine, layer: int, exports: list[tuple[Sequence, int, int]]) -> None:
        """Inside the forward, right after ``layer``'s KV is written: hand each exporting request's new token
        range to the connector (which must not block)."""
        assert self.kv_connector is not None
        for seq, start, end in exports:
            if end > start:
                k, v = self.export_kv(seq.request_id, layer)
                self.kv_connector.save_kv_layer(seq.request_id, layer, k[start:end], v[start:end], token_start=start)

    def reserve_for_import(
        self: LLMEngine, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> bool:
        """Allocate blocks for a prompt whose KV will be imported. False (nothing changed) if they are not
        free right now; raises ValueError for an invalid request."""
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_request(prompt_token_ids, params)
        grammar = self._new_grammar(prompt_token_ids, params)
        seq = Sequence(request_id, prompt_token_ids, params)
        if not self.scheduler.reserve_for_import(seq):
            return False
        seq.status = SequenceStatus.IMPORTING
        self.seqs[request_id] = seq
        if grammar is not None:
            self._grammars[request_id] = grammar
        return True

    def import_kv_layer(self: LLMEngine, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        seq = self.seqs[request_id]
        if seq.status != SequenceStatus.IMPORTING:
            raise ValueError(f"request {request_id!r} is not importing")
        n = seq.num_prompt_tokens
        if k.shape[0] != n or v.shape[0] != n:
            raise ValueError(f"expected KV for {n} tokens, got {k.shape[0]}/{v.shape[0]}")
        dev, dtype = self.runner.device, self.runner.dtype
        slots = self.runner.slots(seq, 0, n).to(dev)
        self.runner.cache.write(layer, k.to(dev, dtype), v.to(dev, dtype), slots)

    def commit_import(self: LLMEngine, request_id: str, first_token_id: int) -> None:
        """All layers are in: the request decodes from here as if it had prefilled itself. The first token
        is reported in the next step's outputs."""
        seq = self.seqs[request_id]
        if seq.status != SequenceStatus.IMPORTING:
            raise ValueError(f"request {request_id!r} is not importing")
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.commit(seq)
        if self.tokenizer is not None:
            self._detok[request_id] = StopText(IncrementalDetokenizer(self.tokenizer, seq.token_ids))
        self.counters["requests"] += 1
        out = self._append_token(seq, first_token_id)
        if not seq.is_finished:
            self.scheduler.add_running(seq)
        self._pending.append(out)

    def cancel_import(self: LLMEngine, request_id: str) -> None:
        seq = self.seqs.get(request_id)
        if seq is not None and seq.status == SequenceStatus.IMPORTING:
            self.block_manager.free_seq(seq)
            self._finish(seq, "abort")
