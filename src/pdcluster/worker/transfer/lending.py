"""Export memory the TCP backend lends the engine (`export_buffer`), and when it comes back.

The engine gathers each layer's token range out of its paged cache into one host buffer; when that buffer is
fresh memory, the gather pays a page fault and a zero-fill per 4 KiB page (bufpool.py). The TCP connector
lends pooled memory instead, and takes it back once nothing needs it: after encoding, when the frames carry
other bytes (int8 compression of a float layer), else when the receiver has ACKed every frame of that save
(an un-ACKed frame may still be resent on a new connection, from these very bytes). A transfer that fails
or is aborted keeps its buffers out of the pool: they go to the garbage collector with its frames.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdcluster.worker.transfer.bufpool import BufferPool
from pdcluster.worker.transfer.frame import Frame
from pdcluster.worker.transfer.outbox import Outbox


@dataclass
class Lease:
    view: memoryview
    frames: int = 0  # frames of this save not yet ACKed


class Lender:
    def __init__(self, max_bytes: int) -> None:
        self.pool = BufferPool(max_bytes)
        self._lock = threading.Lock()  # engine thread (lend), encoder threads (attach), event loop (acked)
        self._lent: dict[int, Lease] = {}  # data_ptr of a lent buffer -> its lease, until save_kv_layer
        self._frames: dict[str, dict[int, Lease]] = {}  # request -> id(frame) -> lease, until ACKed
        self._active: set[str] = set()  # saves started and not yet finished, failed or aborted

    def open(self, request_id: str, boxes: list[Outbox] | tuple[()] = ()) -> None:
        """A save starts: its outboxes report each ACKed frame here."""
        for box in boxes:
            box.on_ack = self.acked
        with self._lock:
            self._active.add(request_id)

    def encode(self, request_id: str, lease: Lease | None, make: Callable[[], list[tuple[Outbox, Frame]]],
               uses_buffer: bool) -> list[tuple[Outbox, Frame]]:
        """Encoder thread: build a save's frames with `make`, then `attach` the lease to them (`uses_buffer`
        False for int8 compression of a float layer: the frames carry the quantizer's output)."""
        try:
            out = make()
        except BaseException:
            self.give(lease)  # nothing will be sent from it
            raise
        self.attach(request_id, lease, [f for _, f in out], uses_buffer)
        return out

    def lend(self, request_id: str, nbytes: int) -> torch.Tensor:
        view = self.pool.take(nbytes)
        buf = torch.frombuffer(view, dtype=torch.uint8)
        with self._lock:
            self._lent[int(buf.data_ptr())] = Lease(view)
        return buf

    def take(self, k: torch.Tensor) -> Lease | None:
        """The lease of the buffer this save's K starts (the engine lays K out first), if we lent it."""
        with self._lock:
            return self._lent.pop(int(k.data_ptr()), None)

    def give(self, lease: Lease | None) -> None:
        if lease is not None:
            self.pool.give(lease.view)

    def attach(self, request_id: str, lease: Lease | None, frames: list[Frame], uses_buffer: bool) -> None:
        """Encoder thread, once a save's frames are built: back to the pool now (`uses_buffer` False: the
        frames hold other bytes), or when every one of `frames` is ACKed."""
        if lease is None:
            return
        if not uses_buffer or not frames:
            self.give(lease)
            return
        lease.frames = len(frames)
        with self._lock:
            if request_id not in self._active:
                return  # aborted while encoding: its frames are never sent, the GC takes the bytes
            held = self._frames.setdefault(request_id, {})
            for f in frames:
                held[id(f)] = lease  # the outbox keeps each frame object alive until its ACK

    def acked(self, frame: Frame) -> None:
        with self._lock:
            lease = self._frames.get(frame.request_id, {}).pop(id(frame), None)
            if lease is None:
                return
            lease.frames -= 1
            done = lease.frames == 0
            if not self._frames[frame.request_id]:
                del self._frames[frame.request_id]
        if done:
            self.give(lease)

    def forget(self, request_id: str) -> None:
        """A save that ended: every frame ACKed, or it failed or was aborted (its frames, and the bytes
        they view, are the GC's then)."""
        with self._lock:
            self._active.discard(request_id)
            self._frames.pop(request_id, None)

    @property
    def held(self) -> int:
        """Frames whose export memory is still out (leak checks)."""
        with self._lock:
            return sum(len(f) for f in self._frames.values())
