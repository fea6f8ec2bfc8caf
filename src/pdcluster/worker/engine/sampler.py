"""Next-token choice per sequence: greedy, or temperature + top-k + top-p sampling, after the logits are shaped
by min_tokens, logit_bias and the repetition / frequency / presence penalties (vLLM's order and formulas), and
masked to what a structured-output grammar allows next.

Greedy rows are one batched argmax. A seeded row's randomness is a pure function of (seed, index of the token
in the output): each draw uses a fresh generator seeded from that pair. So a seeded request gives the same
tokens whatever else shares its batch, after preemption, and on whichever worker produces output token k
(a decode worker continuing after a prefill worker's first token, or after a resume) — no RNG state has to
travel between workers.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from pdcluster.kernels import native
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


@dataclass
class History:
    """What a row's logits shaping depends on besides its params. ``output_ids`` are all the tokens of the
    request's output so far, including those another worker produced (a resume's prompt ends with them), so
    penalties are the same on every path."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    stop_ids: Collection[int]  # masked while fewer than min_tokens are out (EOS unless ignore_eos, stop ids)
    allowed: torch.Tensor | None = None  # bool [vocab]: the tokens the request's grammar takes next (structured)


def shape_logits(row: torch.Tensor, p: SamplingParams, h: History, index: int) -> torch.Tensor:
    """One row of float32 logits after min_tokens, logit_bias and the penalties (a new tensor)."""
    row = row.clone()
    vocab = row.shape[-1]
    allowed = None if h.allowed is None else h.allowed[:vocab].to(row.device)
    if index < p.min_tokens and h.stop_ids:
        ids = torch.tensor([t for t in h.stop_ids if 0 <= t < vocab], dtype=torch.long, device=row.device)
        # a grammar that can only end here wins over min_tokens (masking both would leave no token at all)
        if allowed is None or allowed.clone().index_fill_(0, ids, False).any():
            row[ids] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long, device=row.device)
        row[ids] += torch.tensor([p.logit_bias[t] for t in p.logit_bias if t < vocab], device=row.device)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*h.prompt_ids, *h.output_ids}), dtype=torch.long, device=row.device)
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and len(h.output_ids):
        counts = torch.bincount(torch.tensor(list(h.output_ids), dtype=torch.long), minlength=vocab)[:vocab]
        counts = counts.to(row.device, row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if allowed is not None:  # last: no bias or penalty can bring back a token the grammar refuses
        row = row.masked_fill(~allowed, float("-inf"))
    return row


def sample(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int],
           histories: Sequence[History | None] | None = None) -> list[int]:
    """``logits`` float32 ``[seqs, vocab]`` -> one token id per row. ``output_indices[i]``: the position in
    its request's output of the token row i draws (0 = the first generated token). ``histories[i]`` is
    needed for rows whose params shape the logits (``SamplingParams.shapes_logits``)."""
    out = native.argmax(logits).tolist()
    for i, p in enumerate(params):
        h = histories[i] if histories is not None else None
        shaped = p.shapes_logits and h is not None
        if p.greedy and not shaped:
            continue
        # on the CPU: per-token generators are CPU generators (one draw per row is cheap anywhere)
        base = logits[i].cpu().float()
        if shaped:
            assert h is not None
            base = shape_logits(base, p, h, output_indices[i])
        if p.greedy:
            out[i] = int(base.argmax())
            continue
        row = _filter(base / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        gen = None if p.seed is None else torch.Generator().manual_seed(token_seed(p.seed, output_indices[i]))
        # Gumbel-style draw (argmax of p / Exp(1)) keeps one generator call per row and stays reproducible.
        noise = torch.empty_like(probs).exponential_(generator=gen)
        out[i] = int((probs / noise).argmax())
    return out


def logprobs_of(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability and the k most likely (id, logprob), from the model's raw logits
    (vLLM's default "raw_logprobs": before penalties, bias and temperature)."""
    lp = torch.log_softmax(logits.float(), -1)
    top: list[tuple[int, float]] = []
    if k:
        vals, ids = torch.topk(lp, min(k, lp.shape[-1]))
        top = [(int(t), float(v)) for t, v in zip(ids.tolist(), vals.tolist(), strict=True)]
    return float(lp[token]), top
