"""One OpenAI request -> the engine requests it stands for: every prompt of a batched completion times `n`.

Choice `i * n + j` is prompt i's j-th sample (vLLM's numbering). Sample j of a seeded request is seeded with
`seed + j` (as vLLM does), so each choice is reproducible on its own and on every path: the worker alone and
the router's fan-out over prefill/decode pairs compute the same sub-requests from the same body."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdcluster.worker.engine.sampling_params import SamplingParams

_SEED_SPAN = 2**64 + 2**63  # seeds live in [-2**63, 2**64)


@dataclass
class Sub:
    index: int  # the choice's index in the response
    prompt_ids: list[int]
    params: SamplingParams
    echo: str = ""  # text put before the choice's text (completions with echo=true)


def choice_seed(seed: int | None, j: int) -> int | None:
    """The seed of sample j (wrapped into the accepted range, so seed + j never fails validation)."""
    if seed is None:
        return None
    return (seed + j + 2**63) % _SEED_SPAN - 2**63


def expand(prompts: list[tuple[list[int], SamplingParams, str]], n: int) -> list[Sub]:
    """(prompt ids, params, echo text) per prompt -> the sub-requests, in choice order."""
    subs = []
    for i, (ids, params, echo) in enumerate(prompts):
        for j in range(n):
            p = params if j == 0 else dataclasses.replace(params, seed=choice_seed(params.seed, j))
            subs.append(Sub(i * n + j, ids, p, echo))
    return subs
