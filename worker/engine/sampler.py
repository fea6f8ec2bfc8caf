"""Next-token choice per sequence: greedy, or temperature + top-k + top-p sampling.

Greedy rows are one batched argmax. Sampled rows draw from their own torch.Generator when the request has
a seed, so a seeded request gives the same tokens whatever else shares its batch (and after preemption).
"""

from __future__ import annotations

import torch
from pdcluster.worker.engine.sampling_params import SamplingParams


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


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """``logits`` float32 ``[seqs, vocab]`` -> one token id per row."""
    out = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        # on the CPU: per-request generators are CPU generators (one draw per row is cheap anywhere)
        row = _filter(logits[i].cpu() / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        # Gumbel-style draw (argmax of p / Exp(1)) keeps one generator call per row and stays reproducible.
        noise = torch.empty_like(probs).exponential_(generator=generators[i])
        out[i] = int((probs / noise).argmax())
    return out
