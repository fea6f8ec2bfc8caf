"""Reading OpenAI-style server-sent events in tests.

httpx allows iterating a response only once, and a half-consumed line iterator that gets
garbage-collected closes the connection; so each response gets one reader that keeps it.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator
from typing import Any

import httpx

_READERS: weakref.WeakKeyDictionary[httpx.Response, Iterator[str]] = weakref.WeakKeyDictionary()


def _lines(response: httpx.Response) -> Iterator[str]:
    if response not in _READERS:
        _READERS[response] = response.iter_lines()
    return _READERS[response]


def _payload(line: str) -> Any:
    data = line[len("data: "):]
    return data if data == "[DONE]" else json.loads(data)


def events(response: httpx.Response) -> list[Any]:
    """All remaining `data:` payloads of an SSE response; `[DONE]` stays a string."""
    out = [_payload(ln) for ln in _lines(response) if ln.startswith("data: ")]
    _READERS.pop(response, None)
    return out


def first_event(response: httpx.Response) -> Any:
    """The next event, leaving the stream open for `events` to read the rest."""
    for line in _lines(response):
        if line.startswith("data: "):
            return _payload(line)
    raise AssertionError("stream ended without an event")


def parse(text: str) -> list[Any]:
    return [_payload(ln) for ln in text.splitlines() if ln.startswith("data: ")]
