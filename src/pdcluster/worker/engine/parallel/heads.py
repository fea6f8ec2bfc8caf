"""Which KV heads a tensor-parallel rank holds (stdlib only: the operator imports it too): the one rule the engine's sharded cache and the KV transfer's
re-sharding both follow, so a prefill at TP ``a`` and a decode at TP ``b`` agree on where every head lives.

Megatron's rule: with ``kv_heads >= tp`` the KV heads are split into ``tp`` equal contiguous slices; with
``kv_heads < tp`` each KV head is replicated on ``tp // kv_heads`` consecutive ranks (rank r holds head
``r * kv_heads // tp``), so every rank still owns whole query groups.
"""

from __future__ import annotations


def check_layout(num_kv_heads: int, num_heads: int | None, tp: int) -> None:
    """Raise ValueError unless ``tp`` can shard a model with these head counts (``num_heads`` None: the KV
    heads alone, as `kv-budget` checks them when the attention head count is not given)."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    if num_heads is not None and num_heads % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the attention head count {num_heads}")
    if num_kv_heads >= tp and num_kv_heads % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the KV head count {num_kv_heads}")
    if num_kv_heads < tp and tp % num_kv_heads:
        raise ValueError(
            f"KV head count {num_kv_heads} must divide tensor parallel size {tp} when it is smaller (replication)"
        )


def kv_heads_of_rank(num_kv_heads: int, tp: int, rank: int) -> range:
    """The global KV head indices rank ``rank`` of ``tp`` holds in its cache, in cache order."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} out of range for tensor parallel size {tp}")
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank * num_kv_heads // tp
    return range(head, head + 1)


def ranks_holding_head(num_kv_heads: int, tp: int, head: int) -> list[int]:
    """Every rank of a TP ``tp`` layout that holds global KV head ``head`` (several when replicated)."""
    if not 0 <= head < num_kv_heads:
        raise ValueError(f"KV head {head} out of range for {num_kv_heads} heads")
    return [r for r in range(tp) if head in kv_heads_of_rank(num_kv_heads, tp, r)]
