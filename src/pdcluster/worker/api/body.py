"""The one JSON body parser of every HTTP entry point (worker, router, `/internal/*`).

A body is read with its size capped *while reading* (a declared Content-Length over the cap is refused before
any byte is read; a chunked body is refused as soon as it crosses the cap) and with a time bound (a client
dribbling its body must not hold a connection forever). The JSON is then held to what the rest of the system
can re-encode and compute with: finite numbers only (NaN, Infinity and 1e309 are refused), integers of a sane
size (a 5,000-digit integer would otherwise make Python's int parser raise ValueError), strings without lone
surrogates (they cannot be UTF-8 encoded for the tokenizer or the router's re-encoding) and a bounded shape.
The shape (nesting depth, number of values, strings, objects and arrays: api/json_shape.py) is checked on the
raw bytes *while they arrive*, before anything is parsed, so a bomb never becomes a tree; a body that passes is
parsed and checked off the event loop when it is large (its own small pool: the tokenizer's threads and the
loop never wait behind a 32 MiB parse). Each refusal is a 400 that names the field (OpenAI's `param`), so no
bad body becomes a 500 or a traceback.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from pdcluster.worker.api import errors
from pdcluster.worker.api.json_shape import MAX_DEPTH, ShapeError, ShapeScanner

MAX_BODY_BYTES = 32 * 1024 * 1024  # far above any prompt a model can take; stops a runaway client early
BODY_TIMEOUT_S = 60.0  # a whole body must arrive within this (32 MiB at ~0.5 MiB/s)
OFF_LOOP_BYTES = 256 * 1024  # bodies above this are parsed on _PARSE_POOL (a 256 KiB parse takes ~1 ms)
MAX_INT_DIGITS = 40  # every integer field fits in 2**128; more digits is not a number a client means
M = TypeVar("M", bound=BaseModel)
# Two threads: parsing is CPU work under the GIL, more threads would not parse faster, only hold more bodies.
_PARSE_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="json-parse")


class _Refused:
    """Placeholder left in the parsed tree by a refused number, so the walk can say in which field it was."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def _float(text: str) -> float | _Refused:
    v = float(text)
    return v if v not in (float("inf"), float("-inf")) else _Refused(f"{text[:20]} is out of range")


def _int(text: str) -> int | _Refused:
    digits = len(text) - (text[0] == "-")
    return int(text) if digits <= MAX_INT_DIGITS else _Refused(f"an integer of {digits} digits is out of range")


def _constant(text: str) -> _Refused:
    return _Refused(f"{text} is not a number JSON allows")


def _key(k: str) -> str:
    # A key can itself hold a lone surrogate; the `param` we send back must stay encodable.
    return k.encode("utf-8", "backslashreplace").decode("utf-8")[:64]


def _check_str(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_tree(data: Any, max_depth: int = MAX_DEPTH) -> None:
    """Walk the parsed JSON without recursion; raise a 400 naming the first bad field's path."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while stack:
        node, path = stack.pop()
        where = ".".join(path)
        if len(path) > max_depth:
            raise errors.bad_request(f"{path[0]}: JSON nested more than {max_depth} levels deep", param=path[0],
                                     code="invalid_json")
        if isinstance(node, _Refused):
            raise errors.bad_request(f"{where}: {node.why}", param=where or None)
        if isinstance(node, str):
            if not _check_str(node):
                raise errors.bad_request(f"{where}: string holds a lone UTF-16 surrogate (invalid Unicode)",
                                         param=where or None)
        elif isinstance(node, dict):
            for k, v in node.items():
                if not _check_str(k):
                    raise errors.bad_request(f"key {_key(k)!r} holds a lone UTF-16 surrogate (invalid Unicode)",
                                             param=".".join((*path, _key(k))))
                stack.append((v, (*path, _key(k))))
        elif isinstance(node, list):
            stack.extend((v, (*path, str(i))) for i, v in enumerate(node))


def shape_refused(e: ShapeError) -> errors.APIError:
    where = f"{e.field}: " if e.field else ""
    return errors.bad_request(f"{where}{e}", param=e.field, code="invalid_json")


def decode_json(raw: bytes, max_depth: int = MAX_DEPTH, *, scanned: bool = False) -> dict[str, Any]:
    """Bytes -> a JSON object every later stage can handle, or a 400. `scanned`: the shape was checked as the
    bytes arrived (read_body), else it is checked here first."""
    if not raw.strip():
        raise errors.bad_request("request body is empty; expected a JSON object", code="invalid_json")
    if not scanned:
        try:
            ShapeScanner(max_depth).feed(raw)
        except ShapeError as e:
            raise shape_refused(e) from None
    try:
        data = json.loads(raw, parse_float=_float, parse_int=_int, parse_constant=_constant)
    except RecursionError:
        raise errors.bad_request(f"JSON nested more than {max_depth} levels deep", code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise errors.bad_request(f"request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise errors.bad_request("request body must be a JSON object", code="invalid_json")
    check_tree(data, max_depth)
    return data


def _limits(request: Request, max_bytes: int | None, timeout: float | None) -> tuple[int, float]:
    # An app may set its own bounds on `app.state` (tests, the router's flag); else the defaults above.
    state = request.app.state if "app" in request.scope else None
    return (max_bytes or getattr(state, "max_body_bytes", None) or MAX_BODY_BYTES,
            timeout or getattr(state, "body_timeout", None) or BODY_TIMEOUT_S)


async def read_body(request: Request, max_bytes: int | None = None, timeout: float | None = None,
                    shape: ShapeScanner | None = None) -> bytes:
    """The raw body, refused with 413 past `max_bytes` (before reading when declared) and 408 past `timeout`;
    with `shape`, each piece is scanned as it arrives and a body past its bounds is refused (400) at once."""
    max_bytes, timeout = _limits(request, max_bytes, timeout)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(max_bytes)
                if shape is not None:
                    shape.feed(chunk)
                chunks.append(chunk)
    except TimeoutError:
        raise errors.APIError(408, f"the request body did not arrive within {timeout:g} s",
                              code="body_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise errors.APIError(499, "client disconnected while sending the body", code="client_closed") from None
    except ShapeError as e:  # Connection: close, as for 413: the rest of the body is not worth reading
        refusal = shape_refused(e)
        refusal.headers = {"Connection": "close"}
        raise refusal from None
    return b"".join(chunks)


def _too_large(max_bytes: int) -> errors.APIError:
    # Connection: close, so the server does not have to drain (read) the rest of an oversized body.
    return errors.APIError(413, f"request body exceeds {max_bytes} bytes", code="body_too_large",
                           headers={"Connection": "close"})


def validate(model: type[M], data: Any) -> M:
    """pydantic validation whose every failure is a 400 naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = errors.format_validation_error(e)
        raise errors.bad_request(message, param=param) from None


async def json_object(request: Request) -> dict[str, Any]:
    """A capped, timed, shape-checked JSON object (see the module docstring)."""
    raw = await read_body(request, shape=ShapeScanner())
    if len(raw) <= OFF_LOOP_BYTES:
        return decode_json(raw, scanned=True)
    return await asyncio.get_running_loop().run_in_executor(_PARSE_POOL, _decode_scanned, raw)


def _decode_scanned(raw: bytes) -> dict[str, Any]:
    return decode_json(raw, scanned=True)


async def parse_body(request: Request, model: type[M]) -> M:
    return validate(model, await json_object(request))
