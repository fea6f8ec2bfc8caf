"""OpenAI-shaped HTTP errors: `{"error": {"message", "type", "code"}}`.

Every invalid input is a 400 (never FastAPI's 422), so clients written against the OpenAI API
see the status codes they expect. The router reuses `install_error_handlers` for the same reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

# status -> OpenAI error type
_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error that becomes an OpenAI-shaped JSON response (or an SSE error event mid-stream)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "internal_error" if status >= 500 else "invalid_request_error")
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "code": code, "param": param}}


# The words engine/structured.py's GrammarState.accept fails a request with when the request's own grammar left
# no token to take (a pattern that dead-ends past what the compile-time check follows): the client's constraint,
# not the worker, so a 400 and no retry elsewhere. tests/engine/test_grammar_bounds.py keeps the two in step.
GRAMMAR_MISFIT = "does not fit the request's grammar"


def engine_failure(message: str | None) -> APIError:
    """The error for a request the engine ended with finish_reason "error"."""
    if message and GRAMMAR_MISFIT in message:
        return APIError(400, f"the request's output constraint admits no continuation here ({message[:200]})",
                        code="grammar_dead_end")
    return APIError(500, f"generation failed: {message or 'unknown error'}", code="engine_error")


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_request") -> APIError:
    return APIError(400, message, code=code, param=param)


def queue_full(retry_after_s: int = 1) -> APIError:
    return APIError(
        429,
        "server is at capacity: the waiting queue is full, retry later",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def unavailable(message: str, code: str = "not_ready") -> APIError:
    # Retry-After lets well-behaved clients back off while a worker starts or drains.
    return APIError(503, message, code=code, headers={"Retry-After": "1"})


def timeout(seconds: float) -> APIError:
    return APIError(504, f"request timed out after {seconds:g} s", code="timeout")


def format_validation_error(err: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, plus the offending field (OpenAI's `param`)."""
    errors = err.errors()
    if not errors:
        return "invalid request", None
    parts: list[str] = []
    first_param: str | None = None
    for e in errors[:3]:
        # FastAPI prefixes locations with "body"; a message is clearer without it.
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if first_param is None and where:
            first_param = where
        msg = str(e.get("msg", "invalid value"))
        parts.append(f"{where}: {msg}" if where else msg)
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more, first_param


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """Map every error path of a FastAPI app onto the OpenAI error shape.

    `on_error(status)` is told about each error response (the worker counts 400s as rejected).
    """

    def _seen(status: int) -> None:
        if on_error is not None:
            try:
                on_error(status)
            except Exception:
                log.exception("error hook failed")

    async def _api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        _seen(exc.status)
        return exc.response()

    async def _validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError | ValidationError)
        message, param = format_validation_error(exc)
        _seen(400)
        return bad_request(message, param=param).response()

    async def _http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        # Our own words, not the framework's ("Not Found"): name the route the client asked for.
        path = request.url.path[:200]
        message = {404: f"no route {request.method} {path}",
                   405: f"method {request.method} is not allowed on {path}"}.get(status, str(exc.detail))
        code = {404: "unknown_route", 405: "method_not_allowed"}.get(status)
        err = APIError(status, message, code=code, headers=dict(exc.headers or {}))
        return err.response()

    async def _unhandled(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}").response()

    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(ValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _unhandled)
