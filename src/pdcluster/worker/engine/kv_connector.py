"""The engine's KV connector interface: how KV leaves and enters the engine for prefill/decode
disaggregation (after vLLM's KVConnectorBase_V1, reduced to what a two-stage pipeline needs).

The engine owns and calls the connector; a transfer backend implements it (`pdcluster.worker.transfer`'s TCP
connector; an RDMA/NIXL one would plug in the same way). Nothing outside the engine reaches into engine
internals to move KV, and nothing patches the engine.

Export (prefill worker): a request added with ``prefill_only=True`` sends its KV through the attached
connector. The engine calls ``save_kv_layer`` on its own thread, inside the forward, right after each layer's
KV of a prefill chunk is written, with only the token range that chunk wrote (a chunked prefill calls it
once per chunk and layer; tokens served from the prefix cache go with the first chunk). The connector must
not block: it hands the tensors to its own threads and returns.

Import (decode worker): the engine's public methods, called between steps (``AsyncEngine`` queues them onto
the engine thread): ``reserve_for_import`` (blocks are allocated before any KV moves), ``import_kv_layer``
(any order, any token range; codes of the same format as the cache's layer are written as they are), ``commit_import`` (the request decodes from here, continuing after the prefill worker's first
token), ``cancel_import`` (frees the reservation).

This module imports no torch at run time: ``pdcluster.worker.engine`` must stay importable without it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVLayout:
    """Shape of one request's KV as it travels: per layer, K and V of ``[tokens, kv_heads, head_dim]`` (model
    dtype, or a quantized layer's own codes and scales), whatever the cache's block size."""

    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int  # of this engine's cache (informational: transfers are block-size independent)


class KVConnectorBase(abc.ABC):
    """What the engine calls to export KV. Implemented by transfer backends."""

    def export_buffer(self, request_id: str, layer: int, token_start: int, nbytes: int,
                      quantized: bool) -> torch.Tensor | None:
        """Optional: ``nbytes`` of uint8 memory (host or device) where the engine should lay out the next
        ``save_kv_layer`` of this (request, layer, token_start) — K then V as stored, then K then V scales
        for a ``quantized`` layer — so a backend that sends from registered memory (NIXL) gets it there with
        no copy of its own. None (the default): the engine uses a host buffer of its own. Engine thread; the
        memory is lent until the matching ``save_kv_layer``, which always follows."""
        return None

    @abc.abstractmethod
    def save_kv_layer(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor,
                      token_start: int = 0, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """KV of tokens ``[token_start, token_start + k.shape[0])`` of ``layer``, just written: float values
        ``[tokens, kv_heads, head_dim]``, or a quantized layer's codes as its cache stores them (int8, or
        uint8 packed int4 ``[.., head_dim // 2]``) with their float32 ``scales`` ``[tokens, kv_heads]``.
        Engine thread; must not block. A request the connector does not know (never started, or aborted) is
        ignored."""
