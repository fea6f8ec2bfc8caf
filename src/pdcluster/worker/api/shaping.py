"""The one place that shapes generated text into OpenAI responses, for the worker and the router alike: the
non-streamed body, the SSE chunks (chat's role-only opener, deltas, logprobs, and the usage chunk when asked
for), the merge of several choices' streams, and the SSE response around them (an error event instead of a broken stream, then `data: [DONE]`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from pdcluster.worker.api import errors
from pdcluster.worker.api.responses import (
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
from pdcluster.worker.api.tool_calls import ToolCallStream, ToolPlan, parse_whole
from pdcluster.worker.api.tool_calls import finish_reason as tool_finish

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"
Kind = Literal["completions", "chat"]
T = TypeVar("T")


_js = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # a JSON string as pydantic writes it


def sse(data: dict[str, Any] | BaseModel) -> str:
    payload = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"data: {payload}\n\n"


def completion_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """The legacy completions shape (tokens, token_logprobs, top_logprobs, text_offset) of some tokens'
    entries (see RequestOutput.logprobs); `offset` is where their text starts in the choice's text."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [_top_dict(e) for e in entries], "text_offset": offsets}


def _top_dict(entry: dict[str, Any]) -> dict[str, float]:
    """One token's top alternatives as the legacy shape's {text: logprob}. Two tokens can decode to the same
    text (byte-level pieces of one character both read "\ufffd"): the key keeps the higher value, and the chosen
    token's own text always maps to the chosen token's value (never a rival's that shares its text)."""
    top: dict[str, float] = {}
    for t in entry.get("top") or []:
        if t["token"] not in top or t["logprob"] > top[t["token"]]:
            top[t["token"]] = t["logprob"]
    if entry["token"] in top:
        top[entry["token"]] = entry["logprob"]
    return top


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI chat's logprobs object of some tokens' entries."""
    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": e.get("bytes")}

    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e.get("top") or []]} for e in entries],
            "refusal": None}


@dataclass
class ChoiceResult:
    """One whole choice of a non-streamed response."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[str, Any]] | None = None  # entries, one per token, when asked for


@dataclass
class Shaper:
    """Shapes one request's output; `n_prompt` (all prompts' tokens) and the flags come from the validated
    request. Choices are numbered by the caller (prompt i, sample j -> i * n + j, as vLLM does)."""

    kind: Kind
    model: str
    n_prompt: int
    return_token_ids: bool = False
    rid: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    include_usage: bool = False  # streaming: a last chunk with `choices: []` and the usage, only when asked
    logprobs: bool = False
    tools: ToolPlan | None = None  # chat: the output becomes tool calls (api/tool_calls.py)
    _offsets: dict[int, int] = field(default_factory=dict)
    _tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)
    _head: str | None = None  # a plain chunk's JSON up to its choice index (_plain_chunk)

    def __post_init__(self) -> None:
        self.rid = self.rid or new_id("chatcmpl" if self.kind == "chat" else "cmpl")

    def worth_a_chunk(self, text: str, token_ids: list[int], finished: bool) -> bool:
        return bool(text or finished or ((self.return_token_ids or self.logprobs) and token_ids))

    def opening(self, choices: int = 1) -> list[str]:
        """Chunks before any token: OpenAI sends chat's role alone first, and clients key off it."""
        if self.kind != "chat":
            return []
        return [sse(ChatCompletionChunk(id=self.rid, model=self.model, created=self.created,
                                        choices=[ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))]))
                for i in range(choices)]

    def _lp(self, index: int, text_before: str, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        if entries is None or not self.logprobs:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries)
        return completion_logprobs(entries, self._offsets.get(index, 0) + len(text_before))

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None, index: int = 0,
              logprobs: list[dict[str, Any]] | None = None) -> str:
        """One SSE chunk of choice `index`."""
        ids = list(token_ids) if self.return_token_ids else None
        lp = self._lp(index, "", logprobs if token_ids else None)
        self._offsets[index] = self._offsets.get(index, 0) + len(text)
        if lp is None and self.tools is None:
            return self._plain_chunk(text, ids, finish_reason, index)
        if self.kind == "chat" and self.tools is not None:
            return self._tool_chunks(text, ids, finish_reason, index, lp)
        if self.kind == "chat":
            delta = ChatDelta(content=text) if text else ChatDelta()
            return sse(ChatCompletionChunk(id=self.rid, model=self.model, created=self.created,
                                           choices=[ChatChunkChoice(index=index, delta=delta, logprobs=lp,
                                                                    finish_reason=finish_reason, token_ids=ids)]))
        return sse(CompletionResponse(id=self.rid, model=self.model, created=self.created,
                                      choices=[CompletionChoice(index=index, text=text, logprobs=lp,
                                                                finish_reason=finish_reason, token_ids=ids)]))

    def _plain_chunk(self, text: str, ids: list[int] | None, finish_reason: str | None, index: int) -> str:
        """A chunk without logprobs or tool calls (nearly every token of a stream), written straight as the
        models' JSON would be (tests/server/test_shaping_fast.py holds them equal): building and dumping the
        pydantic models cost 5-10 us a token, on the event loop every streamed token passes through."""
        if self._head is None:
            obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
            self._head = (f'data: {{"id":{_js(self.rid)},"object":"{obj}","created":{self.created},'
                          f'"model":{_js(self.model)},"choices":[{{"index":')
        if self.kind == "chat":
            body = f'"delta":{{"content":{_js(text)}}}' if text else '"delta":{}'
        else:
            body = f'"text":{_js(text)}'
        reason = "null" if finish_reason is None else _js(finish_reason)
        tail = "" if ids is None else f',"token_ids":[{",".join(map(str, ids))}]'
        return f'{self._head}{index},{body},"logprobs":null,"finish_reason":{reason}{tail}}}]}}\n\n'

    def _tool_chunks(self, text: str, ids: list[int] | None, finish_reason: str | None, index: int,
                     lp: dict[str, Any] | None) -> str:
        """Choice `index`'s text through its tool-call parser: zero or more chunks (content and tool_calls
        deltas; text that may still become a call is held back). Token ids and logprobs ride on the first,
        the finish reason (`tool_calls` after a call) on the last."""
        st = self._tool_streams.setdefault(index, ToolCallStream(self.tools))  # type: ignore[arg-type]
        deltas = st.feed(text) + (st.finish() if finish_reason else [])
        pieces = [ChatDelta(content=d) if kind == "content" else ChatDelta(tool_calls=[d]) for kind, d in deltas]
        if not pieces:
            if not (finish_reason or ids or lp):
                return ""
            pieces = [ChatDelta()]
        reason = tool_finish(finish_reason, st.made_calls)
        return "".join(sse(ChatCompletionChunk(
            id=self.rid, model=self.model, created=self.created, choices=[ChatChunkChoice(
                index=index, delta=d, logprobs=lp if j == 0 else None, token_ids=ids if j == 0 else None,
                finish_reason=reason if j == len(pieces) - 1 else None)])) for j, d in enumerate(pieces))

    def _message(self, c: ChoiceResult) -> tuple[ChatMessageOut, str | None]:
        if self.tools is None:
            return ChatMessageOut(content=c.text), c.finish_reason
        content, calls = parse_whole(self.tools, c.text)
        return ChatMessageOut(content=content, tool_calls=calls), tool_finish(c.finish_reason, calls is not None)

    def usage_chunk(self, completion_tokens: int) -> list[str]:
        """The stream's last chunk, `choices: []` + usage, when the client asked (stream_options.include_usage)."""
        if not self.include_usage:
            return []
        usage = Usage.of(self.n_prompt, completion_tokens)
        if self.kind == "chat":
            return [sse(ChatCompletionChunk(id=self.rid, model=self.model, created=self.created, choices=[],
                                            usage=usage))]
        return [sse(CompletionResponse(id=self.rid, model=self.model, created=self.created, choices=[],
                                       usage=usage))]

    def final(self, choices: list[ChoiceResult], completion_tokens: int, echo: list[str] | None = None) -> dict[str, Any]:
        """The whole non-streamed response body; `echo[i]` is prepended to choice i's text (completions)."""
        usage = Usage.of(self.n_prompt, completion_tokens)
        body: BaseModel
        if self.kind == "chat":
            body = ChatCompletionResponse(id=self.rid, model=self.model, created=self.created, usage=usage, choices=[
                ChatChoice(index=c.index, message=m, finish_reason=reason, logprobs=self._lp(c.index, "", c.logprobs),
                           token_ids=list(c.token_ids) if self.return_token_ids else None)
                for c in choices for m, reason in [self._message(c)]])
        else:
            out = []
            for c in choices:
                head = echo[c.index] if echo else ""
                out.append(CompletionChoice(index=c.index, text=head + c.text, finish_reason=c.finish_reason,
                                            logprobs=self._lp(c.index, head, c.logprobs),
                                            token_ids=list(c.token_ids) if self.return_token_ids else None))
            body = CompletionResponse(id=self.rid, model=self.model, created=self.created, usage=usage, choices=out)
        return body.model_dump()


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several streams as they come, tagged with the stream's index (n > 1, batched prompts). The
    first failure ends the merge (and with it the others: every stream is closed on the way out)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for x in only:
                yield 0, x
        return
    q: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    end = object()

    async def pump(i: int, s: AsyncIterator[T]) -> None:
        try:
            async for x in s:
                q.put_nowait((i, x))
            q.put_nowait((i, end))
        except Exception as e:  # handed to the consumer, which raises it
            q.put_nowait((i, e))
        finally:
            aclose = getattr(s, "aclose", None)
            if aclose is not None:
                await aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, x = await q.get()
            if x is end:
                left -= 1
            elif isinstance(x, Exception):
                raise x
            else:
                yield i, x
    finally:
        for t in tasks:
            t.cancel()  # each closes its stream (aborting its work upstream) as it unwinds


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
