"""argparse value types shared by the command lines that start servers (`pdcluster router`, `pdcluster up`):
a bad port, count or worker URL is refused at parse time with one `error: argument --x: ...` line and exit
code 2, instead of surfacing later as a traceback (a port of 99999 reaching `socket.bind`) or a process that
starts and then cannot do anything (a router whose only decode worker is "notaurl")."""

from __future__ import annotations

import argparse
import math
from typing import Any
from urllib.parse import urlsplit


def _number(text: str, kind: type[int] | type[float]) -> Any:
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return v


def _require(text: str, ok: bool, rule: str) -> None:
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r} {rule}")


def positive_int(text: str) -> int:
    v: int = _number(text, int)
    _require(text, v >= 1, "must be >= 1")
    return v


def non_negative_int(text: str) -> int:
    v: int = _number(text, int)
    _require(text, v >= 0, "must be >= 0")
    return v


def positive_float(text: str) -> float:
    v: float = _number(text, float)
    _require(text, v > 0, "must be > 0")
    return v


def non_negative_float(text: str) -> float:
    v: float = _number(text, float)
    _require(text, v >= 0, "must be >= 0")
    return v


def port(text: str) -> int:
    v: int = _number(text, int)
    _require(text, 1 <= v <= 65535, "is not a TCP port (1-65535)")
    return v


def worker_url(text: str) -> str:
    """http(s)://host:port[/path], the port explicit: workers listen on their own ports, never on 80/443 by
    accident of an omitted number. Returned without a trailing slash (paths are appended to it)."""
    try:
        parts = urlsplit(text)
        p = parts.port
    except ValueError as e:  # urlsplit raises on a port that is not a number or out of range
        raise argparse.ArgumentTypeError(f"{text!r} is not a worker URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or p is None or p == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a worker URL: expected http://HOST:PORT")
    if parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"{text!r} is not a worker URL: it has no ?query or #fragment")
    return text.rstrip("/")


def fraction(text: str) -> float:
    """A share in (0, 1] (an SLO target, a knee's share of the peak)."""
    v: float = _number(text, float)
    _require(text, 0 < v <= 1, "must be in (0, 1]")
    return v


def between(low: float, high: float) -> Any:
    """A number in [low, high] (e.g. a headroom factor)."""

    def convert(text: str) -> float:
        v: float = _number(text, float)
        _require(text, low <= v <= high, f"must be in [{low:g}, {high:g}]")
        return v

    convert.__name__ = "number"
    return convert
