"""Next-token choice per sequence: greedy, or temperature + top-k + top-p sampling.

Greedy rows are one batched argmax. A seeded row's randomness is a pure function of (seed, index of the token
in the output): each draw uses a fresh generator seeded from that pair. So a seeded request gives the same
tokens whatever else shares its batch, after preemption, and on whichever worker produces output token k
(a decode worker continuing after a prefill worker's first token, or after a resume) — no RNG state has to
travel between workers.
"""

from __future__ import annotations

import torch
from pdcluster.worker.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def token_seed(seed: int, index: int) -> int:
    """The generator seed of output token ``index`` of a request seeded with ``seed`` (splitmix64 of the
    pair, so neighbouring seeds/indices give unrelated streams). In [0, 2**63): what manual_seed takes."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and the top-p nucleus of one row of logits."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep a token if the mass strictly before it is below top_p (the first token always survives)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]) -> list[int]:
    """``logits`` float32 ``[seqs, vocab]`` -> one token id per row. ``output_indices[i]``: the position in
    its request's output of the token row i draws (0 = the first generated token)."""
    out = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        # on the CPU: per-token generators are CPU generators (one draw per row is cheap anywhere)
        row = _filter(logits[i].cpu() / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        gen = None if p.seed is None else torch.Generator().manual_seed(token_seed(p.seed, output_indices[i]))
        # Gumbel-style draw (argmax of p / Exp(1)) keeps one generator call per row and stays reproducible.
        noise = torch.empty_like(probs).exponential_(generator=gen)
        out[i] = int((probs / noise).argmax())
    return out
