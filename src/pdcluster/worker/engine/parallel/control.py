"""A small control channel between rank 0 and each follower rank, beside the step group: JSON lines down the
follower's stdin (which also carries its start-up spec, and whose EOF ends it) and up a pipe of its own.

The step group (gloo) carries only what every rank must do at the same point of a step; this channel carries
what one rank does on its own time: start its KV transfer endpoint, expect a request's KV, finish or abort
sending one, and the answers (ready, loaded, saved, failed). Nothing here carries KV. A follower whose pipe
reaches EOF is gone: its listener hears ``{"op": "gone"}`` once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from typing import IO, Any

log = logging.getLogger(__name__)
Listener = Callable[[int, dict[str, Any]], None]


class Control:
    """Rank 0's side: one writer (the follower's stdin) and one reader thread per follower rank."""

    def __init__(self) -> None:
        self._writers: dict[int, IO[bytes]] = {}
        self._lock = threading.Lock()
        self.listener: Listener | None = None  # called on the reader threads: hand over, never block

    def add(self, rank: int, stdin: IO[bytes], reply_fd: int) -> None:
        self._writers[rank] = stdin
        threading.Thread(target=self._read, args=(rank, reply_fd), name=f"pdcluster-tp-ctl-{rank}",
                         daemon=True).start()

    @property
    def ranks(self) -> list[int]:
        return sorted(self._writers)

    def send(self, rank: int, msg: dict[str, Any]) -> bool:
        """Queue one command for ``rank``; False when that rank is gone (its stdin is closed)."""
        line = (json.dumps(msg) + "\n").encode()
        with self._lock:
            try:
                w = self._writers[rank]
                w.write(line)
                w.flush()
                return True
            except (OSError, ValueError, KeyError):  # a dead follower's pipe, or closed on shutdown
                return False

    def _read(self, rank: int, fd: int) -> None:
        with os.fdopen(fd, "rb") as f:
            for line in f:
                try:
                    msg = json.loads(line)
                except ValueError:
                    log.warning("tensor-parallel rank %d: unreadable control line %r", rank, line[:80])
                    continue
                self._deliver(rank, msg)
        self._deliver(rank, {"op": "gone"})

    def _deliver(self, rank: int, msg: dict[str, Any]) -> None:
        fn = self.listener
        if fn is not None:
            try:
                fn(rank, msg)
            except Exception:  # a listener bug must not end the reader (and hide the follower's death)
                log.exception("tensor-parallel rank %d: control listener failed on %s", rank, msg.get("op"))


class Replies:
    """A follower's side: the reply pipe, one JSON line per message, from any thread."""

    def __init__(self, fd: int) -> None:
        self._f = os.fdopen(fd, "wb")
        self._lock = threading.Lock()

    def __call__(self, msg: dict[str, Any]) -> None:
        line = (json.dumps(msg) + "\n").encode()
        with self._lock:
            try:
                self._f.write(line)
                self._f.flush()
            except (OSError, ValueError):  # rank 0 is gone: this process ends on its stdin's EOF anyway
                pass
