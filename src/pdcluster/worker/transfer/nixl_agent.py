"""NIXL (NVIDIA Inference Xfer Library, UCX underneath: RDMA, NVLink, shared memory, TCP) as seen by
pdcluster: whether it loads here and why not, and the few agent calls a KV transfer needs.

Only this module imports nixl. The wheel (`nixl-cu12`) bundles UCX and runs on CPU-only machines (host
memory, DRAM segments); GPU memory is registered the same way where CUDA is present.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str  # why it runs or why not, for the one log line that says which backend runs


# The wheel's Python API builds every agent with a progress-thread delay of 0, and NIXL's UCX progress thread
# then busy-spins: measured here, an idle worker holding one agent burned 0.96 of a core (0.002 with the
# thread off), taking it from prefill and decode on the same node. With a delay the thread sleeps in poll()
# on the UCX worker's event fd and still wakes on traffic (two agents idle: 0.036 cores at 100 us; a 64 MiB
# READ ran as fast as with the spinning thread). Microseconds; PDCLUSTER_NIXL_PROGRESS_DELAY_US overrides.
PROGRESS_DELAY_US = 100
_construct = threading.Lock()


def progress_delay_us() -> int:
    raw = os.environ.get("PDCLUSTER_NIXL_PROGRESS_DELAY_US", "").strip()
    try:
        value = int(raw) if raw else PROGRESS_DELAY_US
    except ValueError:
        raise ValueError(f"PDCLUSTER_NIXL_PROGRESS_DELAY_US must be a whole number of microseconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"PDCLUSTER_NIXL_PROGRESS_DELAY_US must be >= 0, got {value}")
    return value


def new_agent(name: str) -> Any:
    """A nixl agent with the UCX backend whose progress thread sleeps between polls (see PROGRESS_DELAY_US).

    The wheel's `nixl_agent` assigns `pthrDelay = 0` to a fresh binding config; the config class is swapped,
    for the length of one construction, for a subclass that keeps our delay instead. Should a later wheel
    not assign it that way, the override is simply never applied."""
    from nixl_cu12 import _api, nixl_agent, nixl_agent_config

    delay = progress_delay_us()
    base = _api.nixlBind.nixlAgentConfig

    class _Config(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, delay if key == "pthrDelay" else value)

    with _construct:
        _api.nixlBind.nixlAgentConfig = _Config
        try:
            return nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        finally:
            _api.nixlBind.nixlAgentConfig = base


@functools.cache
def availability() -> Availability:
    """Can a NIXL agent with the UCX backend be created in this process? (Cached: creating one is cheap, but
    a failure is the same every time.)"""
    try:
        import nixl_cu12  # noqa: F401
    except Exception as e:  # ImportError, or a bundled library that does not load on this host
        return Availability(False, f"nixl is not importable ({type(e).__name__}: {e})")
    try:
        agent = new_agent(f"pdkv-probe-{uuid.uuid4().hex[:8]}")
        if "UCX" not in agent.backends:
            return Availability(False, "nixl loads but its UCX backend plugin does not")
    except Exception as e:
        return Availability(False, f"nixl agent creation failed ({type(e).__name__}: {e})")
    return Availability(True, "nixl with the UCX backend loads")


Segments = list[tuple[int, int]]  # (address, bytes), in transfer order


class Agent:
    """One NIXL agent: one registered staging buffer (registered once, never per transfer), plus any memory
    registered later with `register` (the KV cache pools: READs then go from cache blocks to cache blocks)."""

    def __init__(self, name: str, staging_bytes: int, device: str = "cpu") -> None:
        self.name = name
        self._agent = new_agent(name)
        self.buffer = torch.zeros(staging_bytes, dtype=torch.uint8, device=device)
        self._regs: list[Any] = [self._agent.register_memory(self.buffer)]
        self._ranges: list[tuple[int, int]] = [(self.base, self.base + staging_bytes)]  # sorted [start, end)
        self._remotes: set[str] = set()
        self._lock = threading.Lock()
        self.mem_type = "VRAM" if self.buffer.is_cuda else "DRAM"

    @property
    def base(self) -> int:
        return int(self.buffer.data_ptr())

    def register(self, tensors: list[torch.Tensor]) -> None:
        """Register more host memory (contiguous tensors on this agent's device), once: peers can then READ
        from it, and READs can land in it. The metadata changes: send `metadata()` again after this."""
        tensors = [t for t in tensors if t.numel()]
        for t in tensors:
            if not t.is_contiguous() or t.device != self.buffer.device:
                raise ValueError(f"only contiguous {self.buffer.device} memory is registered, got {t.device}")
        if not tensors:
            return
        with self._lock:
            self._regs.append(self._agent.register_memory(tensors))
        spans = [(int(t.data_ptr()), int(t.data_ptr()) + t.numel() * t.element_size()) for t in tensors]
        self._ranges = sorted(self._ranges + spans)

    def covers(self, addr: int, nbytes: int) -> bool:
        """Whether [addr, +nbytes) lies inside one registered range (NIXL transfers only registered memory)."""
        i = bisect.bisect_right(self._ranges, (addr, 1 << 64)) - 1
        return i >= 0 and self._ranges[i][0] <= addr and addr + nbytes <= self._ranges[i][1]

    def metadata(self) -> bytes:
        """What a peer needs to transfer with our registered memory (sent over the authenticated channel)."""
        return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        """Forget a peer (it died, or its transfers failed): a later one with new metadata is added afresh."""
        with self._lock:
            if name in self._remotes:
                self._remotes.discard(name)
                with contextlib.suppress(Exception):  # already gone on the nixl side
                    self._agent.remove_remote_agent(name)

    @property
    def remote_count(self) -> int:
        return len(self._remotes)

    def has_remote(self, name: str) -> bool:
        return name in self._remotes

    def _staged(self, local_off: int, nbytes: int) -> Segments:
        if not 0 <= local_off <= self.buffer.numel() - nbytes:
            raise ValueError(f"local range [{local_off}, +{nbytes}) is outside the staging buffer")
        return [(self.base + local_off, nbytes)]

    def write(self, remote: str, local_off: int, remote_addr: int, nbytes: int, remote_dev: int = 0,
              timeout: float = 30.0) -> None:
        """Blocking WRITE of local buffer[local_off:+nbytes] to the peer's address (call on a worker thread)."""
        self._xfer("WRITE", remote, self._staged(local_off, nbytes), [(remote_addr, nbytes)], remote_dev, timeout)

    def read_segments(self, remote: str, local: Segments, remote_segs: Segments, remote_dev: int = 0,
                      timeout: float = 30.0, on_end: Callable[[], None] | None = None) -> None:
        """Blocking READ of the peer's segments into ours (registered, `covers`), pairwise of equal length (call
        on a worker thread). NIXL refuses a range outside the peer's registrations (nixlNotFoundError) before
        anything moves. `on_end` runs once the transfer can no longer write into `local` (done, failed, or drained after a
        timeout), whatever this call raises."""
        self._xfer("READ", remote, local, remote_segs, remote_dev, timeout, on_end)

    async def aread_segments(self, remote: str, local: Segments, remote_segs: Segments, remote_dev: int = 0,
                             timeout: float = 30.0, on_end: Callable[[], None] | None = None) -> None:
        """`read_segments` polled on the loop, no thread: for small layers, where a hop to a worker thread and
        back costs more than the READ (which often completes inside the call that posts it). Cancelled or timed out while the READ is in flight, the handle
        is drained on a thread (it may still write into `local`), and only then released and `on_end` run."""
        handle, state = self._post("READ", remote, local, remote_segs, remote_dev, on_end)
        try:
            deadline, polls = time.monotonic() + timeout, 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nixl READ with {remote} timed out")
                # yield to the loop's other work between checks; past a few hundred the READ is a slow one:
                # check once a millisecond (the loop's timer resolution) instead of spinning the core
                polls += 1
                await asyncio.sleep(0 if polls < 200 else 1e-3)
                state = self._state(handle)
            if state != "DONE":
                raise OSError(f"nixl READ with {remote} failed ({state})")
        finally:
            if state == "PROC":
                threading.Thread(target=self._drain, args=(handle, on_end), daemon=True).start()
            else:
                self._end(handle, on_end)

    def _post(self, op: str, remote: str, local: Segments, remote_segs: Segments, remote_dev: int,
              on_end: Callable[[], None] | None = None) -> tuple[Any, str]:
        """Describe and post one transfer: (its handle, its first state). Runs `on_end` if nothing was posted."""
        try:
            if [n for _, n in local] != [n for _, n in remote_segs] or not local:
                raise ValueError("local and remote segments must pair up, one length each")
            for addr, n in local:
                if n <= 0 or not self.covers(addr, n):
                    raise ValueError(f"local range [{addr:#x}, +{n}) is not registered memory")
            # One call at a time into the agent (its thread-safety depends on the build's sync mode); waiting
            # runs unlocked, so concurrent transfers still overlap on the wire.
            with self._lock:
                src = self._agent.get_xfer_descs([(a, n, 0) for a, n in local], self.mem_type)
                dst = self._agent.get_xfer_descs([(a, n, remote_dev) for a, n in remote_segs], self.mem_type)
                handle = self._agent.initialize_xfer(op, src, dst, remote)
        except BaseException:
            if on_end is not None:
                on_end()
            raise
        try:
            with self._lock:
                return handle, self._agent.transfer(handle)
        except BaseException:
            self._end(handle, on_end)
            raise

    def _end(self, handle: Any, on_end: Callable[[], None] | None) -> None:
        try:
            with self._lock, contextlib.suppress(Exception):  # a failed transfer's handle may refuse release
                self._agent.release_xfer_handle(handle)
        finally:
            if on_end is not None:
                on_end()

    def _drain(self, handle: Any, on_end: Callable[[], None] | None, limit: float = 600.0) -> None:
        """Wait out a transfer nobody waits for any more (its waiter timed out or was cancelled), so that the
        memory it writes is not reused while it may still land. Beyond `limit` it is released regardless (a
        peer gone that long: UCX has failed the endpoint)."""
        deadline = time.monotonic() + limit
        state = "PROC"
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(1e-3)
            state = self._state(handle)
        self._end(handle, on_end)

    def _state(self, handle: Any) -> str:
        """PROC, DONE, or ERR (a failed transfer: NIXL reports some failures by raising)."""
        try:
            with self._lock:
                return str(self._agent.check_xfer_state(handle))
        except Exception:
            return "ERR"

    def _xfer(self, op: str, remote: str, local: Segments, remote_segs: Segments, remote_dev: int,
              timeout: float, on_end: Callable[[], None] | None = None) -> None:
        handle, state = self._post(op, remote, local, remote_segs, remote_dev, on_end)
        try:
            deadline = time.monotonic() + timeout
            pause = 0.0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nixl {op} with {remote} timed out")
                # The agent's progress thread moves the bytes: polling only asks whether it is done. Spinning
                # would take a core from that thread (and from the peer, on one host), so back off from a
                # bare yield to at most 0.5 ms between checks (a 64 MiB read takes tens of ms).
                time.sleep(pause)
                pause = min(5e-4, pause * 2 or 2e-5)
                state = self._state(handle)
            if state != "DONE":
                raise OSError(f"nixl {op} with {remote} failed ({state})")
        finally:
            if state == "PROC":  # timed out (or interrupted) in flight: drained elsewhere, the error goes now
                threading.Thread(target=self._drain, args=(handle, on_end), daemon=True).start()
            else:
                self._end(handle, on_end)

    def close(self) -> None:
        for name in list(self._remotes):
            self.remove_remote(name)
        with self._lock:
            for reg in reversed(self._regs):
                self._agent.deregister_memory(reg)
            self._regs.clear()

    @property
    def registered(self) -> bool:
        return bool(self._regs)
