"""The one place that shapes generated text into OpenAI responses, for the worker and the router alike: the
non-streamed body, the SSE chunks (chat's role-only opener, deltas, usage on the final chunk) and the SSE
response around them (an error event instead of a broken stream, then `data: [DONE]`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from pdcluster.worker.api import errors
from pdcluster.worker.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    Usage,
    new_id,
)

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"
Kind = Literal["completions", "chat"]


def sse(data: dict[str, Any] | BaseModel) -> str:
    payload = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"data: {payload}\n\n"


@dataclass
class Shaper:
    """Shapes one request's output; `n_prompt` and the flags come from the validated request."""

    kind: Kind
    model: str
    n_prompt: int
    return_token_ids: bool = False
    rid: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.rid = self.rid or new_id("chatcmpl" if self.kind == "chat" else "cmpl")

    def worth_a_chunk(self, text: str, token_ids: list[int], finished: bool) -> bool:
        return bool(text or finished or (self.return_token_ids and token_ids))

    def opening(self) -> list[str]:
        """Chunks before any token: OpenAI sends chat's role alone first, and clients key off it."""
        if self.kind != "chat":
            return []
        first = ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))
        return [sse(ChatCompletionChunk(id=self.rid, model=self.model, created=self.created, choices=[first]))]

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None, completion_tokens: int | None) -> str:
        """One SSE chunk; `completion_tokens` is given on the final chunk only (it carries the usage)."""
        ids = list(token_ids) if self.return_token_ids else None
        usage = None if completion_tokens is None else Usage.of(self.n_prompt, completion_tokens)
        if self.kind == "chat":
            delta = ChatDelta(content=text) if text else ChatDelta()
            return sse(ChatCompletionChunk(id=self.rid, model=self.model, created=self.created, usage=usage,
                                           choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason,
                                                                    token_ids=ids)]))
        return sse(CompletionResponse(id=self.rid, model=self.model, created=self.created, usage=usage,
                                      choices=[CompletionChoice(text=text, finish_reason=finish_reason,
                                                                token_ids=ids)]))

    def final(self, text: str, token_ids: list[int], finish_reason: str | None,
              completion_tokens: int) -> dict[str, Any]:
        """The whole non-streamed response body."""
        ids = list(token_ids) if self.return_token_ids else None
        usage = Usage.of(self.n_prompt, completion_tokens)
        body: BaseModel
        if self.kind == "chat":
            body = ChatCompletionResponse(id=self.rid, model=self.model, created=self.created, usage=usage,
                                          choices=[ChatChoice(message=ChatMessageOut(content=text),
                                                              finish_reason=finish_reason, token_ids=ids)])
        else:
            body = CompletionResponse(id=self.rid, model=self.model, created=self.created, usage=usage,
                                      choices=[CompletionChoice(text=text, finish_reason=finish_reason,
                                                                token_ids=ids)])
        return body.model_dump()


def sse_response(events: AsyncIterator[str], cleanup: Callable[[], Awaitable[None]],
                 as_api_error: Callable[[Exception], errors.APIError | None] = lambda _: None) -> StreamingResponse:
    """SSE body: the chunks, then an error event if something failed, then `data: [DONE]`.

    A client disconnect cancels this generator (Starlette watches for http.disconnect); `cleanup` runs in
    `finally` (closing the request's stream aborts its work upstream at once). `as_api_error` maps errors the
    caller knows (e.g. a worker's error relayed by the router) onto the OpenAI error event.
    """

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in events:
                yield chunk
        except errors.APIError as e:
            yield sse(e.body())
        except Exception as e:
            mapped = as_api_error(e)
            if mapped is None:
                log.exception("stream failed")
                mapped = errors.APIError(500, f"internal error: {type(e).__name__}")
            yield sse(mapped.body())
        finally:
            await cleanup()
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)
