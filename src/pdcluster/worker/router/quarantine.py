"""Prefill->decode pairs whose KV transfers keep failing, kept apart for a while.

A transfer that fails (the prefill worker's save or the decode worker's load: a broken link, a peer with a
stale secret, a path that times out) costs the request a second prefill on another pair. One failure says
little; `threshold` failures of the same pair within `window_s` say the pair is broken, and the router then
stops reserving that decode worker for that prefill worker for `hold_s` (other pairs, including both
workers with other peers, keep working). Only while another decode worker is available: a quarantine
never leaves a request with nowhere to go (`Flow._reserve` falls back to every decode worker).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class PairQuarantine:
    def __init__(self, threshold: int = 2, window_s: float = 60.0, hold_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold < 1 or window_s <= 0 or hold_s < 0:
            raise ValueError("quarantine threshold must be >= 1, window > 0 and hold >= 0")
        self.threshold, self.window_s, self.hold_s, self.clock = threshold, window_s, hold_s, clock
        self._failures: dict[tuple[str, str], list[float]] = {}
        self._until: dict[tuple[str, str], float] = {}
        self.quarantines = 0  # pairs put in quarantine so far (the router's /cluster reports it)

    def failed(self, prefill: str, decode: str) -> bool:
        """Record one failed transfer of the pair; True when this failure puts the pair in quarantine."""
        now, pair = self.clock(), (prefill, decode)
        recent = [t for t in self._failures.get(pair, []) if now - t < self.window_s] + [now]
        if len(recent) >= self.threshold:
            self._failures.pop(pair, None)
            self._until[pair] = now + self.hold_s
            self.quarantines += 1
            return True
        self._failures[pair] = recent[-self.threshold:]
        return False

    def blocked(self, prefill: str) -> set[str]:
        """Decode workers in quarantine with `prefill` now."""
        now = self.clock()
        for pair in [p for p, until in self._until.items() if until <= now]:
            del self._until[pair]
        return {d for (p, d) in self._until if p == prefill}

    def active(self) -> list[tuple[str, str]]:
        now = self.clock()
        return sorted(p for p, until in self._until.items() if until > now)
