"""Chained hashes of a prompt's full KV blocks, shared by the engine's prefix cache and the router's prefix index.

A full block is identified by hash(previous block's hash, its token ids), so equal hashes mean equal prefixes.
Pure and torch-free: the router (which never imports torch) hashes a prompt exactly as the engine will, so
"the router sent these blocks to worker W" and "W's cache holds these blocks" speak about the same keys.

The root of the chain is a fixed integer, not None: on Python 3.11 hash(None) depends on the process's
address layout, and hashes of tuples of ints are the same in every process (only str/bytes are salted).
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT = 0x5EED  # the "previous hash" of a prompt's first block


def chain_hash(prev: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((ROOT if prev is None else prev, token_ids))


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks a prompt of `num_tokens` could take from a prefix cache: the last prompt token is always
    computed (its logits are needed to sample), so a block ending at the last token is not counted."""
    if block_size <= 0 or num_tokens <= 1:
        return 0
    return (num_tokens - 1) // block_size


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's cacheable blocks, first block first."""
    out: list[int] = []
    prev: int | None = None
    for i in range(cacheable_blocks(len(token_ids), block_size)):
        prev = chain_hash(prev, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(prev)
    return out
