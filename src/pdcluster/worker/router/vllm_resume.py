"""Decode-death resume for vLLM streams (`pdcluster router --engine vllm`).

A vLLM decode worker that dies mid-stream leaves the client with part of an answer. The router asks vLLM for the
token ids behind each streamed event (`return_token_ids: true` on the decode leg; taken out again unless the
client asked for them), so it knows exactly which output tokens the client has. On a break it sends a new
**completions** request, prompt = the prompt's token ids + those output tokens, `max_tokens` = what is left, to
another pair through the same handshake (a prefill leg when the longer prompt reaches the disaggregation
threshold, else the decode worker computes it itself); greedy decoding continues where it stopped. The new
leg's events are rewritten into the client's stream: the first leg's `id`, `created` and `model`, chat chunks for
a chat request, usage counted over both legs.

What cannot be resumed that way keeps the old behaviour (an OpenAI error event ends the stream), see
`blocker`: several choices, stop strings (vLLM holds back text that may start a stop string, so the client's
text can lag its tokens, and a stop string across the break would be missed), logprobs (offsets restart),
structured output (the grammar would restart at the break), tool calls (the parser's state is lost).
Sampled (temperature > 0) requests resume with a new draw, not the one the dead worker would have made.
"""

from __future__ import annotations

import json
from typing import Any

# Sampling fields a chat request shares with a completions request; the rest of a chat body (messages, tools,
# chat template options) has been applied already: it is in the prompt's token ids.
_SHARED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens",
           "spaces_between_special_tokens", "stream_options", "user", "logit_bias", "priority",
           "include_stop_str_in_output", "bad_words", "truncate_prompt_tokens", "allowed_token_ids")
_COMPLETIONS_DEFAULT_MAX = 16  # vLLM's default max_tokens for /v1/completions (chat: up to the context)


def blocker(kind: str, body: dict[str, Any]) -> str | None:
    """Why this streamed request cannot be resumed on another decode worker (None: it can)."""
    if int(body.get("n") or 1) != 1 or int(body.get("best_of") or 1) != 1:
        return "n > 1"
    if body.get("stop"):
        return "stop strings"
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs"):
        return "logprobs"
    if body.get("response_format") or body.get("structured_outputs") or any(k.startswith("guided_") for k in body):
        return "structured output"
    if kind == "chat" and body.get("tools") and body.get("tool_choice") != "none":
        return "tool calls"
    prompt = body.get("prompt")
    if kind == "completions" and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            return "several prompts"
    return None


def max_tokens(kind: str, body: dict[str, Any]) -> int | None:
    """The request's output budget as vLLM applies it (None: up to the context length)."""
    if kind == "chat":
        v = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        v = body.get("max_tokens", _COMPLETIONS_DEFAULT_MAX)
    return None if v is None else int(v)


class StreamState:
    """What the client has seen of one streamed request, and the rewriting of later legs' events into it."""

    def __init__(self, kind: str, body: dict[str, Any], prompt: list[int]) -> None:
        self.kind, self.body, self.prompt = kind, body, prompt
        self.blocker = blocker(kind, body)
        self.client_ids = bool(body.get("return_token_ids"))  # else the router's own request for them is hidden
        self.sent: list[int] = []
        self.finished = False  # a choice's finish_reason went out
        self.done = False  # `data: [DONE]` went out
        self.error: str | None = None  # the current leg ended with a worker's error event (held back)
        self.head: dict[str, Any] | None = None  # the first event's id, created, model: the stream's identity
        self.resumed = 0  # legs after the first
        self._leg_start = 0  # output tokens in the current leg's prompt
        self._skip = 0  # tokens the current leg generates again before it reaches new ones (not sent twice)

    def leg_body(self) -> dict[str, Any]:
        """The body of the first decode leg: the client's, asking for token ids when a resume may need them."""
        return self.body if self.blocker or self.client_ids else {**self.body, "return_token_ids": True}

    def resume_body(self) -> dict[str, Any]:
        """The next leg: a completions request continuing after the tokens already sent."""
        if self.kind == "chat":
            out = {k: self.body[k] for k in _SHARED if k in self.body}
        else:
            out = {k: v for k, v in self.body.items() if k not in ("prompt", "echo", "suffix")}
        left, start = max_tokens(self.kind, self.body), self._leg_start
        out.update(prompt=self.prompt + self.sent[:start], stream=True, return_token_ids=True,
                   max_tokens=None if left is None else left - start)
        out.pop("max_completion_tokens", None)
        if "min_tokens" in self.body:
            out["min_tokens"] = max(0, int(self.body["min_tokens"] or 0) - start)
        return out

    def all_sent(self) -> bool:
        left = max_tokens(self.kind, self.body)
        return left is not None and len(self.sent) >= left

    def line(self, line: str) -> tuple[str | None, int]:
        """One SSE line of the current leg: (what goes to the client, None for nothing; the new output tokens
        in it)."""
        if not line.startswith("data: "):
            return line, 0
        data = line[6:]
        if data.strip() == "[DONE]":
            if self.error is not None:  # the end of a broken leg: not the client's
                return None, 0
            self.done = True
            return line, 0
        if not self.resumed and self.blocker:  # not resumable: relayed as it is, counted by events
            return line, 1 if '"choices":[{' in data.replace(" ", "") else 0
        try:
            ev = json.loads(data)
        except ValueError:
            return line, 0
        if isinstance(ev, dict) and "error" in ev and _server_error(ev["error"]) and not self.finished:
            # vLLM ends a request that failed in its engine (a KV read under policy `fail`, a dead engine) with
            # an error event, then [DONE]: a broken leg like a dead worker's, resumed on another pair.
            err = ev["error"]
            self.error = str(err.get("message") if isinstance(err, dict) else err)[:200]
            return None, 0
        if not isinstance(ev, dict) or "error" in ev:
            return line, 0
        if self.head is None:
            self.head = {k: ev.get(k) for k in ("id", "created", "model")}
        n = 0
        for ch in ev.get("choices") or []:
            ids = [int(t) for t in ch.get("token_ids") or []]
            if self._skip and ids:  # generated again from a clean boundary: the client has these already
                dup = min(self._skip, len(ids))
                self._skip -= dup
                if dup == len(ids) and ch.get("finish_reason") is None:
                    return None, 0
                ids = ids[dup:]
            self.sent.extend(ids)
            n += len(ids)
            self.finished = self.finished or ch.get("finish_reason") is not None
        if self.resumed:
            ev = self._rewrite(ev)
        elif self.client_ids:
            return line, n
        else:
            _hide_ids(ev)
        return "data: " + json.dumps(ev, separators=(",", ":"), ensure_ascii=False), n

    def _rewrite(self, ev: dict[str, Any]) -> dict[str, Any]:
        """A resumed leg's event (a completions event) as the first leg would have written it."""
        ev.update(self.head or {})
        usage = ev.get("usage")
        if isinstance(usage, dict) and "prompt_tokens" in usage:  # counted over the client's prompt and all legs
            usage["prompt_tokens"] = int(usage["prompt_tokens"]) - self._leg_start
            usage["completion_tokens"] = int(usage.get("completion_tokens", 0)) + self._leg_start
        if self.kind == "chat":
            ev["object"] = "chat.completion.chunk"
            chat = []
            for ch in ev.get("choices") or []:
                text = ch.get("text") or ""
                c = {"index": ch.get("index", 0), "delta": {"content": text} if text else {}, "logprobs": None,
                     "finish_reason": ch.get("finish_reason")}
                if "stop_reason" in ch:
                    c["stop_reason"] = ch["stop_reason"]
                if "token_ids" in ch:
                    c["token_ids"] = ch["token_ids"]
                chat.append(c)
            ev["choices"] = chat
        for ch in ev.get("choices") or []:
            ch.pop("prompt_token_ids", None)  # the resumed prompt is not the client's
        if not self.client_ids:
            _hide_ids(ev)
        return ev

    def start_leg(self, clean: int | None = None) -> None:
        """A resumed leg begins. Its prompt holds the first `clean` tokens sent (default: all): a prompt that
        ends inside a character (a byte-level token of a multi-byte character) makes vLLM's detokenizer emit
        the whole prompt's text with the first new token, so the leg starts at the last character boundary and
        the tokens after it, generated again (greedy: the same), are not sent twice."""
        self.resumed += 1
        self.error = None
        self._leg_start = len(self.sent) if clean is None else clean
        self._skip = len(self.sent) - self._leg_start

    def closing(self) -> list[str]:
        """The stream's end when the break came after its last token: `data: [DONE]` (a length finish first when
        only that event was lost)."""
        out = []
        if not self.finished and self.head is not None:
            ch: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if self.kind == "chat":
                ch["delta"] = {}
            else:
                ch["text"] = ""
            obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
            out.append("data: " + json.dumps({**self.head, "object": obj, "choices": [ch]}, separators=(",", ":"), ensure_ascii=False))
            out.append("")
        out += ["data: [DONE]", ""]
        return out


def _server_error(err: Any) -> bool:
    """An error event the worker's engine raised (5xx or uncoded), not a verdict on the request (4xx)."""
    if not isinstance(err, dict):
        return True
    try:
        return int(err.get("code") or 500) >= 500
    except (TypeError, ValueError):
        return True


def _hide_ids(ev: dict[str, Any]) -> None:
    """Token ids the router asked for, written as vLLM writes them for a client that did not (null)."""
    if "prompt_token_ids" in ev:
        ev["prompt_token_ids"] = None
    for ch in ev.get("choices") or []:
        for k in ("token_ids", "prompt_token_ids"):
            if k in ch:
                ch[k] = None
