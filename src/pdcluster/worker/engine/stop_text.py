"""Streaming text of one request, holding back what could still become a stop string."""

from __future__ import annotations

from pdcluster.worker.engine.tokenizer import IncrementalDetokenizer


class StopText:
    """The text streamed so far; `add` returns what is safe to send and whether a stop string matched."""

    def __init__(self, detok: IncrementalDetokenizer) -> None:
        self.detok = detok
        self.text = ""
        self.emitted = 0

    def add(self, token: int, stops: list[str], final: bool) -> tuple[str, bool]:
        self.text += self.detok.step([token])
        for stop in stops:
            idx = self.text.find(stop, self.emitted)
            if stop and idx != -1:
                self.text = self.text[:idx]
                return self._emit(len(self.text)), True
        hold = 0 if final or not stops else max(len(s) for s in stops) - 1
        return self._emit(max(self.emitted, len(self.text) - hold)), False

    def _emit(self, upto: int) -> str:
        piece = self.text[self.emitted : upto]
        self.emitted = upto
        return piece
