"""The engine's disaggregation side: KV out of a prefill-only request as each layer is written, KV into a
reserved request from another worker, and the views a transport may move in place. A mixin of
`LLMEngine`, split out because it is the one part of the engine that the transfer layer (worker/transfer/)
calls, and it reads the engine's state rather than owning any."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdcluster.worker.engine.kv_transfer import hold_nothing, slot_views, store_heads, store_layer
from pdcluster.worker.engine.parallel.runner import TPModelRunner
from pdcluster.worker.engine.sequence import Sequence, SequenceStatus
from pdcluster.worker.engine.stop_text import StopText
from pdcluster.worker.engine.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from pdcluster.worker.engine.block_manager import BlockManager
    from pdcluster.worker.engine.engine_config import EngineConfig
    from pdcluster.worker.engine.kv_connector import KVConnectorBase
    from pdcluster.worker.engine.model_runner import ModelRunner
    from pdcluster.worker.engine.outputs import FinishReason, RequestOutput
    from pdcluster.worker.engine.sampling_params import SamplingParams
    from pdcluster.worker.engine.scheduler import Batch, Scheduler
    from pdcluster.worker.engine.structured import GrammarState
    from pdcluster.worker.engine.tokenizer import Tokenizer


class EngineKVIO:
    if TYPE_CHECKING:  # what LLMEngine provides
        config: EngineConfig
        runner: ModelRunner | TPModelRunner
        seqs: dict[str, Sequence]
        kv_connector: KVConnectorBase | None
        scheduler: Scheduler
        block_manager: BlockManager
        tokenizer: Tokenizer | None
        counters: dict[str, int]
        _detok: dict[str, StopText]
        _grammars: dict[str, GrammarState]
        _pending: list[RequestOutput]

        def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
        def _new_grammar(self, prompt_token_ids: list[int], params: SamplingParams) -> GrammarState | None: ...
        def _append_token(self, seq: Sequence, token: int) -> RequestOutput: ...
        def _finish(self, seq: Sequence, reason: FinishReason | None) -> None: ...

    def _exports(self, batch: Batch) -> list[tuple[Sequence, int, int]]:
        """(seq, first token not yet sent, tokens written once this step ends) of the prefill-only requests
        in a prefill batch, when a connector is attached."""
        if not batch.is_prefill or self.kv_connector is None:
            return []
        return [(s, s.num_exported_tokens, s.num_computed_tokens + n)
                for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if s.prefill_only]

    def _save_layer(self, layer: int, exports: list[tuple[Sequence, int, int]]) -> None:
        """Inside the forward, right after ``layer``'s KV is written: hand each exporting request's new token
        range to the connector (which must not block), as the cache stores it (codes stay codes)."""
        assert self.kv_connector is not None
        for seq, start, end in exports:
            if end > start and not self._send_views(seq, layer, start, end):
                k, v, scales = self.export_kv_range(seq.request_id, layer, start, end)
                self.kv_connector.save_kv_layer(seq.request_id, layer, k, v, token_start=start, scales=scales)

    def _send_views(self, seq: Sequence, layer: int, start: int, end: int) -> bool:
        """Hand the connector the cache's own bytes of tokens ``[start, end)`` instead of a gathered copy
        (``save_kv_views``, transfer/views.py), when it takes them: a host float layer of one rank, and the
        request's last prefill chunk (from the end of this step it holds its blocks, written by no one, until
        the worker releases them after the transfer; one that finishes on its first token frees them at
        once, which ``held`` tells the sender). True when the connector took them."""
        send = getattr(self.kv_connector, "save_kv_views", None)
        cache = self.runner.cache
        if send is None or end != seq.num_prompt_tokens or self.config.tensor_parallel_size > 1 \
                or getattr(self.runner, "relay", None) is not None or cache.device.type != "cpu" \
                or cache.layer_bits[layer] is not None:
            return False
        try:
            views = slot_views(cache, layer, self.runner.slots(seq, start, end))
        except ValueError:  # a pool that is not one flat array: gather as before
            return False
        return bool(send(seq.request_id, layer, views, token_start=start, num_tokens=end - start,
                         kv_heads=cache.kv_heads, head_dim=cache.head_dim, dtype=cache.dtype,
                         held=lambda: seq.status != SequenceStatus.FINISHED))

    def export_kv_range(self, request_id: str, layer: int, start: int, end: int
                        ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Tokens ``[start, end)`` of a request's layer as stored — float values, or int8/int4 codes with their
        scales — gathered (the one copy) into memory the connector lends (``export_buffer``: e.g. NIXL's
        registered staging) or else a host buffer of ours, K and V back to back."""
        # under TP, rank 0 exports every rank's heads (a gather: parallel/kv_relay.py), as one cache would,
        # unless each rank sends its own heads itself (the direct path: the runner's `direct` requests)
        relay = getattr(self.runner, "relay", None)
        direct = request_id in getattr(self.runner, "exporting_direct", ())
        cache = relay if relay is not None and not direct else self.runner.cache
        slots = self.runner.slots(self.seqs[request_id], start, end)
        nbytes = cache.export_bytes(layer, end - start)
        conn = self.kv_connector
        buf = conn.export_buffer(request_id, layer, start, nbytes, cache.is_quantized(layer)) if conn else None
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)  # host: every wire sends from host memory
        return cache.export_into(layer, slots, buf)

    def reserve_for_import(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
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

    def import_kv_layer(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor, *,
                        token_start: int = 0, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                        head_offset: int | None = None) -> None:
        """Write tokens ``[token_start, token_start + k.shape[0])`` of a reserved request's layer: float K/V,
        or codes (int8, uint8 packed int4) with their ``scales``. Codes in this layer's own format go in as
        they are; anything else is converted here (dequantized on the cache's device, quantized on write).
        ``head_offset``: a head range of this rank's own cache (direct TP transfer), not a whole layer."""
        seq = self.seqs[request_id]
        if seq.status != SequenceStatus.IMPORTING:
            raise ValueError(f"request {request_id!r} is not importing")
        n, t = seq.num_prompt_tokens, k.shape[0]
        if v.shape[0] != t or token_start < 0 or token_start + t > n:
            raise ValueError(f"expected KV within {n} tokens, got [{token_start}, +{k.shape[0]}/{v.shape[0]})")
        if k.dtype in (torch.int8, torch.uint8) and scales is None:
            raise ValueError("KV codes need their scales")
        slots = self.runner.slots(seq, token_start, token_start + t)
        if head_offset is not None:  # this rank's heads only: the followers receive theirs themselves
            store_heads(self.runner.cache, layer, k, v, slots, head_offset, scales)
            return
        if isinstance(self.runner, TPModelRunner):  # every rank writes its heads (parallel/kv_relay.py)
            self.runner.import_layer(layer, k, v, scales, slots)
            return
        store_layer(self.runner.cache, layer, k, v, scales, slots, self.runner.device, self.runner.dtype)

    def import_views(self, request_id: str, layer: int, token_start: int, num_tokens: int,
                     dtype: torch.dtype) -> tuple[list[memoryview], Callable[[], None]] | None:
        """Where tokens ``[token_start, +num_tokens)`` of a reserved request's float layer lie in this cache,
        as byte views in the wire's order (K's runs of slots, then V's), so that a transport can receive them
        in place (transfer/placing.py) instead of into a buffer that ``import_kv_layer`` then copies. None
        unless the cache stores exactly what arrives (host memory, this layer in ``dtype``, one rank).
        Called off the engine thread: it only reads a reservation that is fixed until ``cancel_import``, which
        the transport's owner calls only after the connector's ``cancel_load``."""
        seq = self.seqs.get(request_id)
        cache = self.runner.cache
        if seq is None or seq.status != SequenceStatus.IMPORTING or self.config.tensor_parallel_size > 1 \
                or cache.device.type != "cpu" or cache.layer_bits[layer] is not None or cache.dtype != dtype \
                or not 0 <= token_start < token_start + num_tokens <= seq.num_prompt_tokens:
            return None
        return slot_views(cache, layer, self.runner.slots(seq, token_start, token_start + num_tokens)), hold_nothing

    def transfer_pools(self) -> list[torch.Tensor]:
        """The cache pools a transport may register once to move float layers from block to block with no
        copy of its own (NIXL, transfer/nixl_direct.py): K and V of every host float layer of one rank; []
        where `slot_views` and `import_views` offer no views anyway (a device cache, tensor parallelism)."""
        cache = self.runner.cache
        if self.config.tensor_parallel_size > 1 or cache.device.type != "cpu":
            return []
        return [pool for layer, bits in enumerate(cache.layer_bits) if bits is None
                for pool in (cache.k[layer], cache.v[layer]) if pool.is_contiguous()]

    def commit_import(self, request_id: str, first_token_id: int) -> None:
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

    def cancel_import(self, request_id: str) -> None:
        seq = self.seqs.get(request_id)
        if seq is not None and seq.status == SequenceStatus.IMPORTING:
            self.block_manager.free_seq(seq)
            self._finish(seq, "abort")
