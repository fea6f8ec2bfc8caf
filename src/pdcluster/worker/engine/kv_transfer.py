"""The disaggregation half of LLMEngine: exporting a prefill-only request's KV layer by layer as it is written,
and importing a request's KV from another worker (reserve, one layer at a time, commit or cancel).

A mixin rather than a separate object because both halves share one request table, one block manager and
one model runner: the KV connector (kv_connector.py) is the boundary other code sees, not this class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdcluster.kernels import native, quantize_kv
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.engine.scheduler import Batch
from pdcluster.worker.engine.sequence import Sequence, SequenceStatus
from pdcluster.worker.engine.stop_text import StopText
from pdcluster.worker.engine.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from pdcluster.worker.engine.kv_cache import PagedKVCache
    from pdcluster.worker.engine.llm_engine import LLMEngine


def store_layer(cache: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor,
                scales: tuple[torch.Tensor, torch.Tensor] | None, slots: torch.Tensor, dev: torch.device,
                dtype: torch.dtype) -> None:
    """Write received KV of ``slots`` into one layer of ``cache``: float K/V, or codes with their scales. Codes
    in the layer's own format go in as they are; anything else is converted (dequantized on the cache's
    device, quantized on write)."""
    slots = slots.to(dev)
    bits = {torch.int8: 8, torch.uint8: 4}.get(k.dtype)
    if bits is None:
        cache.write(layer, k.to(dev, dtype), v.to(dev, dtype), slots)
        return
    if scales is None:
        raise ValueError("KV codes need their scales")
    if bits == cache.layer_bits[layer]:
        cache.write_codes(layer, k, v, scales, slots)  # the sender's bytes, untouched
        return
    k, v = (native.dequantize(x.to(dev), s.to(dev), bits, dtype) for x, s in zip((k, v), scales, strict=True))
    cache.write(layer, k, v, slots)


def store_heads(cache: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                head_offset: int, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Store a head range (as the wire carried it: float values, or codes with their scales) into heads
    ``[head_offset, +k.shape[1])`` of ``slots`` of one layer of ``cache``: codes of the layer's own format as
    they are; anything else converted (per-vector scales: quantizing a head range alone gives the codes
    quantizing the whole layer would). What each rank of a TP worker runs for the heads it receives itself."""
    n = k.shape[1]
    if not 0 <= head_offset <= head_offset + n <= cache.kv_heads:
        raise ValueError(f"heads [{head_offset}, +{n}) outside this cache's {cache.kv_heads}")
    bits, got = cache.layer_bits[layer], {torch.int8: 8, torch.uint8: 4}.get(k.dtype)
    if got is not None and scales is None:
        raise ValueError("KV codes need their scales")
    if got is not None and got != bits:
        assert scales is not None
        k, v = (native.dequantize(x, s, got, torch.float32) for x, s in zip((k, v), scales, strict=True))
        got, scales = None, None
    if bits is None:
        pairs = [(cache.k[layer], k), (cache.v[layer], v)]
    else:
        if got is None:
            (k, sk), (v, sv) = quantize_kv(k.float(), bits), quantize_kv(v.float(), bits)
            scales = (sk, sv)
        assert scales is not None and cache.k_scale[layer] is not None and cache.v_scale[layer] is not None
        pairs = [(cache.k[layer], k), (cache.v[layer], v), (cache.k_scale[layer], scales[0]),
                 (cache.v_scale[layer], scales[1])]
    slots = slots.to(cache.device)
    for pool, new in pairs:
        flat = pool.view(-1, *pool.shape[2:])  # [slots, heads(, width)]
        flat.narrow(1, head_offset, n).index_copy_(0, slots, new.to(pool.device, pool.dtype))


def slot_views(cache: PagedKVCache, layer: int, slots: torch.Tensor) -> list[memoryview]:
    """Byte views of ``slots`` of one float layer, K then V, one view per run of consecutive slots (a run
    spans blocks that happen to be adjacent)."""
    breaks = (torch.nonzero(slots[1:] != slots[:-1] + 1).flatten() + 1).tolist()
    bounds = list(zip([0, *breaks], [*breaks, int(slots.numel())], strict=True))
    starts = slots.tolist()
    views = []
    for pool in (cache.k[layer], cache.v[layer]):
        if not pool.is_contiguous():
            raise ValueError("slot_views needs a contiguous pool (a reshape would copy)")
        flat = pool.view(-1, cache.kv_heads * cache.head_dim)
        arr = (flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat).numpy()
        views += [memoryview(arr[starts[a]:starts[a] + b - a]).cast("B") for a, b in bounds]
    return views


def _nothing() -> None:
    """The engine holds nothing for a placed receive: the reservation itself keeps the blocks."""


class KVTransferMixin:
    def _exports(self: LLMEngine, batch: Batch) -> list[tuple[Sequence, int, int]]:
        """(seq, first token not yet sent, tokens written once this step ends) of the prefill-only requests
        in a prefill batch, when a connector is attached."""
        if not batch.is_prefill or self.kv_connector is None:
            return []
        return [(s, s.num_exported_tokens, s.num_computed_tokens + n)
                for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if s.prefill_only]

    def _save_layer(self: LLMEngine, layer: int, exports: list[tuple[Sequence, int, int]]) -> None:
        """Inside the forward, right after ``layer``'s KV is written: hand each exporting request's new token
        range to the connector (which must not block), as the cache stores it (codes stay codes)."""
        assert self.kv_connector is not None
        for seq, start, end in exports:
            if end > start and not self._send_views(seq, layer, start, end):
                k, v, scales = self.export_kv_range(seq.request_id, layer, start, end)
                codes = {"scales": scales} if scales is not None else {}  # float layers: the original call
                self.kv_connector.save_kv_layer(seq.request_id, layer, k, v, token_start=start, **codes)

    def _send_views(self: LLMEngine, seq: Sequence, layer: int, start: int, end: int) -> bool:
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

    def export_kv_range(self: LLMEngine, request_id: str, layer: int, start: int, end: int
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

    def import_kv_layer(self: LLMEngine, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor, *,
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
        if self.config.tensor_parallel_size > 1:  # every rank writes its heads (parallel/kv_relay.py)
            self.runner.import_layer(layer, k, v, scales, slots)  # type: ignore[union-attr]
            return
        store_layer(self.runner.cache, layer, k, v, scales, slots, self.runner.device, self.runner.dtype)

    def import_views(self: LLMEngine, request_id: str, layer: int, token_start: int, num_tokens: int,
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
        return slot_views(cache, layer, self.runner.slots(seq, token_start, token_start + num_tokens)), _nothing

    def transfer_pools(self: LLMEngine) -> list[torch.Tensor]:
        """The cache pools a transport may register once to move float layers from block to block with no
        copy of its own (NIXL, transfer/nixl_direct.py): K and V of every host float layer of one rank; []
        where `slot_views` and `import_views` offer no views anyway (a device cache, tensor parallelism)."""
        cache = self.runner.cache
        if self.config.tensor_parallel_size > 1 or cache.device.type != "cpu":
            return []
        return [pool for layer, bits in enumerate(cache.layer_bits) if bits is None
                for pool in (cache.k[layer], cache.v[layer]) if pool.is_contiguous()]

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
