"""Greedy tokens without the whole fp32 LM head: the bf16 screen (``kernels/cpu/screen.py``) answers each
row with the token ``argmax(compute_logits(h))`` would give, bit for bit; rows it cannot decide (a
non-finite value, a near-tie across many tokens) run the fp32 head, and so do steps of more rows than
``native.screen_max_rows()`` (where the bf16 product is slower than the fp32 one).

Only where the head is the packed fp32 kernel's (``PackedLinear``) with no bias and no soft-capping: the
screen reproduces that kernel's arithmetic exactly, nothing else. It costs half the head's bytes again in
memory (the bf16 copy), built when the model is loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from pdcluster.kernels import native
from pdcluster.worker.engine.cpu_linear import MAX_KERNEL_ROWS, PackedLinear

log = logging.getLogger("pdcluster.engine")


def unusable_reason(lm_head: nn.Module, softcapping: float | None) -> str | None:
    """Why this model's head cannot be screened, or None."""
    if type(lm_head) is not PackedLinear:
        return "the LM head is not the packed fp32 kernel's"
    if lm_head.bias is not None:
        return "the LM head has a bias"
    if softcapping is not None:
        return "the logits are soft-capped"
    return native.screen_unavailable_reason()


class GreedyHead:
    """``tokens(hidden)`` = ``argmax(logits(hidden))`` per row, through the screen where it can run."""

    def __init__(self, lm_head: nn.Module, softcapping: float | None,
                 logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._logits = logits  # the model's compute_logits: the fp32 head, for what the screen leaves
        self._head: native.ScreenedHead | None = None
        self.max_rows = min(native.screen_max_rows(), MAX_KERNEL_ROWS)
        reason = unusable_reason(lm_head, softcapping)
        if reason is None:
            assert isinstance(lm_head, PackedLinear)
            self._head = native.ScreenedHead.build(lm_head.wp.data, lm_head.out_features)
            ratio = native.screen_dot_rate_ratio()
            log.info("greedy steps of up to %d rows screen the LM head in bf16 (+%.1f MiB; this core's bf16 dot "
                     "product retires at %s the FMA's rate)", self.max_rows, self._head.nbytes / 2**20,
                     "?" if ratio is None else f"{ratio:.2f}x")
        else:
            log.info("greedy steps run the whole fp32 LM head: %s", reason)

    @property
    def screened(self) -> bool:
        return self._head is not None

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """int64 ``[rows]`` for ``hidden [rows, K]``."""
        head = self._head
        if (head is None or not native.enabled("screen") or hidden.dtype is not torch.float32
                or hidden.dim() != 2 or hidden.shape[0] > self.max_rows):
            return native.argmax(self._logits(hidden))
        ids = head.argmax(hidden, native.SCREEN_MAX_CANDIDATES)
        missed = (ids < 0).nonzero().flatten()
        if missed.numel():
            ids[missed] = native.argmax(self._logits(hidden[missed].contiguous()))
        return ids
