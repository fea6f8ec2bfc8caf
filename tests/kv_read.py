"""Test-only read-back of an engine's KV cache: a request's K/V per layer, dequantized, as the cache holds it.

The runtime engine ships KV through its connector (``export_kv_range``, layer by layer inside the forward);
tests also need the whole KV of a request after its step, to compare against what was shipped or to import
it into another engine by hand. That reader lives here so the engine carries no test-only API.
"""

from __future__ import annotations

import torch

from pdcluster.worker.engine.llm_engine import LLMEngine


def export_kv(engine: LLMEngine, request_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[num_tokens, kv_heads, head_dim]`` (model dtype, dequantized) of a request's KV so far (its
    computed tokens; call between steps)."""
    seq = engine.seqs[request_id]
    n = seq.num_computed_tokens
    table = torch.tensor(seq.block_table[: engine.block_manager.blocks_for(n)], device=engine.runner.device)
    return engine.runner.cache.read(layer, table, n)
