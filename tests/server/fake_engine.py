"""A tiny deterministic stand-in for AsyncEngine: same async contract, no torch.

It models what the server's guarantees depend on: a bounded running batch with a waiting queue,
KV blocks held per request until it finishes or is aborted, stop/length finishing, and a
per-token delay so tests can hold requests in flight.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

from pdcluster.worker.engine.outputs import RequestOutput
from pdcluster.worker.engine.sampling_params import SamplingParams

VOCAB = 128
EOS = 0


class CharTokenizer:
    """Byte-level: token id = character code (ASCII only), id 0 is EOS."""

    chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


class FakeEngine:
    def __init__(
        self,
        *,
        max_batch_size: int = 4,
        block_size: int = 4,
        total_blocks: int = 256,
        step_delay: float = 0.002,
        max_model_len: int = 64,
        tokenizer: Any = None,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.block_size = block_size
        self.total_blocks = total_blocks
        self.step_delay = step_delay
        self.vocab_size = VOCAB
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer if tokenizer is not None else CharTokenizer()
        self.waiting: list[str] = []
        self.running: set[str] = set()
        self.blocks: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.fail_after: int | None = None  # make every request end with an error after N tokens
        self._slot_free = asyncio.Condition()

    def stats(self) -> dict[str, Any]:
        used = sum(self.blocks.values())
        return {  # the real engine's keys
            "requests_waiting": len(self.waiting),
            "requests_running": len(self.running),
            "requests_swapped": 0,
            "kv_cache_used_blocks": used,
            "kv_cache_total_blocks": self.total_blocks,
            "kv_cache_usage_ratio": used / self.total_blocks,
            "preemptions_total": 0,
        }

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)
        self._release(request_id)

    def _release(self, rid: str) -> None:
        self.blocks.pop(rid, None)
        self.running.discard(rid)
        if rid in self.waiting:
            self.waiting.remove(rid)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        params.validate()
        self.waiting.append(request_id)
        try:
            async with self._slot_free:
                await self._slot_free.wait_for(
                    lambda: request_id in self.aborted or (
                        len(self.running) < self.max_batch_size and self.waiting[0] == request_id
                    )
                )
            if request_id in self.aborted:
                return
            self.waiting.remove(request_id)
            self.running.add(request_id)
            n_prompt = len(prompt_token_ids)
            text = ""
            for i in range(params.max_tokens):
                await asyncio.sleep(self.step_delay)
                if request_id in self.aborted:
                    return
                self.blocks[request_id] = math.ceil((n_prompt + i + 1) / self.block_size)
                if self.fail_after is not None and i >= self.fail_after:
                    yield RequestOutput(request_id, [], "", True, "error", n_prompt, i, error="boom")
                    return
                tok = ord("a") + (prompt_token_ids[0] + i) % 26
                piece = chr(tok)
                text += piece
                done_stop = any(s in text for s in params.stop)
                done_len = i + 1 == params.max_tokens
                finished = done_stop or done_len
                reason = "stop" if done_stop else ("length" if done_len else None)
                yield RequestOutput(request_id, [tok], "" if done_stop else piece, finished, reason, n_prompt, i + 1)
                if finished:
                    return
        finally:
            self._release(request_id)
            async with self._slot_free:
                self._slot_free.notify_all()
