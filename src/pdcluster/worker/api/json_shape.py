"""Bounds on a JSON text's shape, checked over the raw text *before* anything parses it.

`json.loads` builds the whole tree first: a body that is a list of 16M zeros costs seconds and gigabytes, and
one nested 3,000 deep raises RecursionError, before any check could look at it. `ShapeScanner` reads the text
(fed in pieces, as the body arrives) and refuses it as soon as it nests deeper than `max_depth` or holds more
than `max_values` values, `max_strings` strings or `max_containers` objects and arrays. It only looks at
structural bytes: runs of plain characters, numbers and string contents are skipped by C-level regex searches
and counts, so its cost grows with the number of containers and strings, which it caps. It does not validate JSON (json.loads still does);
on any text it is bounded, and on valid JSON its counts are exact.

`loads_bounded` is the one way to parse JSON held *inside* a request (a `guided_json` string, a tool call's
`arguments`, a schema): the same scan, then json.loads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 32  # OpenAI bodies nest ~5 deep (messages -> content parts -> ...); schemas a few more
# A batch of 128 prompts of 8k token ids each; far above any real body's values, far below a bomb's.
MAX_VALUES = 1 << 20
MAX_CONTAINERS = 1 << 16  # objects and arrays: messages, content parts, prompts of a batch, schema nodes
MAX_STRINGS = 1 << 16  # keys and string values together: 4k messages, 128 tools' schemas, 1k logit_bias keys

_STRUCT = re.compile(rb'["\[\]{}]')  # what changes the scanner's state outside strings (commas are counted)
_IN_STRING = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)  # a string's rest up to its closing quote (or the end)
_OPEN = frozenset(b"[{")
_KEY_BEFORE = frozenset(b"{,")
_QUOTE = ord('"')


class ShapeError(ValueError):
    """The text is deeper or larger than allowed; the message says which bound it crossed, `field` the
    top-level key whose value crossed it (None when unknown)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class ShapeScanner:
    """Incremental: `feed` each piece of the text in order; ShapeError as soon as a bound is crossed."""

    max_depth: int = MAX_DEPTH
    max_values: int = MAX_VALUES
    max_strings: int = MAX_STRINGS
    max_containers: int = MAX_CONTAINERS
    depth: int = 0
    containers: int = 0
    values: int = 0  # commas + containers: every value but a container's first follows a comma
    strings: int = 0
    in_string: bool = False
    escaped: bool = False  # the previous piece ended inside a string on a backslash
    # The top-level key whose value is being scanned, so a refusal can name the field (OpenAI's `param`).
    _top_raw: bytes | None = None
    _last: int = 0  # the last significant character outside strings at depth 1 (a key follows `{` or `,`)
    _key: bytearray | None = None  # a top-level key's raw text while it is being read (64 bytes kept)

    def feed(self, piece: bytes | str) -> None:
        """Scan the next piece of the text; ShapeError as soon as a bound is crossed."""
        data = piece.encode("utf-8", "surrogatepass") if isinstance(piece, str) else piece
        pos, end = 0, len(data)
        while pos < end:
            if self.in_string:
                pos = self._string_rest(data, pos, end)
                continue
            m = _STRUCT.search(data, pos)
            stop = m.start() if m else end
            self.values += data.count(b",", pos, stop)
            if self.values > self.max_values:
                raise self._error(f"JSON holds more than {self.max_values} values")
            if self.depth == 1 and stop > pos:
                tail = data[pos:stop].rstrip()
                self._last = tail[-1] if tail else self._last
            if m is None:
                return
            c, pos = data[stop], stop + 1
            if c == _QUOTE:
                self.in_string = True
                self.strings += 1
                if self.strings > self.max_strings:
                    raise self._error(f"JSON holds more than {self.max_strings} strings")
                if self.depth == 1 and self._last in _KEY_BEFORE:
                    self._key = bytearray()
            elif c in _OPEN:
                self.depth += 1
                self.values += 1
                self.containers += 1
                if self.depth > self.max_depth:
                    raise self._error(f"JSON nested more than {self.max_depth} levels deep")
                if self.containers > self.max_containers:
                    raise self._error(f"JSON holds more than {self.max_containers} objects and arrays")
            else:
                self.depth = max(self.depth - 1, 0)
            if self.depth == 1:
                self._last = c

    def _string_rest(self, data: bytes, pos: int, end: int) -> int:
        """Skip string content from `pos`; the position after it (the closing quote, or the piece's end)."""
        if self.escaped:  # the escaped character is this piece's first
            self.escaped = False
            self._keep(data[pos:pos + 1])
            return pos + 1
        m = _IN_STRING.match(data, pos)
        stop = m.end() if m else pos
        self._keep(data[pos:min(stop, pos + 64)])
        if stop >= end:
            return end
        if data[stop] == _QUOTE:
            self.in_string = False
            if self._key is not None:
                self._top_raw, self._key = bytes(self._key), None
            self._last = _QUOTE
            return stop + 1
        self.escaped = True  # a backslash that is this piece's last byte
        self._keep(b"\\")
        return end

    def _keep(self, raw: bytes) -> None:
        if self._key is not None and len(self._key) < 64:
            self._key += raw[:64 - len(self._key)]

    @property
    def top_key(self) -> str | None:
        return None if self._top_raw is None else _key_text(self._top_raw)

    def _error(self, message: str) -> ShapeError:
        return ShapeError(message, self.top_key if self.depth > 1 else None)


def _key_text(raw: bytes) -> str:
    try:
        return str(json.loads(b'"' + raw + b'"'))
    except ValueError:
        return raw.decode("utf-8", "replace")


def check_shape(text: str | bytes, max_depth: int = MAX_DEPTH, max_values: int = MAX_VALUES) -> None:
    """ShapeError when `text` nests or holds more than the bounds allow (see ShapeScanner)."""
    ShapeScanner(max_depth, max_values).feed(text)


def loads_bounded(text: str | bytes, max_depth: int = MAX_DEPTH, max_values: int = MAX_VALUES) -> Any:
    """json.loads after the shape scan: ShapeError (a ValueError) past the bounds, JSONDecodeError (also a
    ValueError) for text that is not JSON. Never RecursionError, never a tree larger than the bounds."""
    check_shape(text, max_depth, max_values)
    return json.loads(text)
