"""NIXL (NVIDIA Inference Xfer Library, UCX underneath: RDMA, NVLink, shared memory, TCP) as seen by
pdcluster: whether it loads here and why not, and the few agent calls a KV transfer needs.

Only this module imports nixl. The wheel (`nixl-cu12`) bundles UCX and runs on CPU-only machines (host
memory, DRAM segments); GPU memory is registered the same way where CUDA is present.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import time
import uuid
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


class Agent:
    """One NIXL agent with one registered buffer (the staging area: registered once, never per transfer)."""

    def __init__(self, name: str, staging_bytes: int, device: str = "cpu") -> None:
        self.name = name
        self._agent = new_agent(name)
        self.buffer = torch.zeros(staging_bytes, dtype=torch.uint8, device=device)
        self._reg: Any = self._agent.register_memory(self.buffer)
        self._remotes: set[str] = set()
        self._lock = threading.Lock()
        self.mem_type = "VRAM" if self.buffer.is_cuda else "DRAM"

    @property
    def base(self) -> int:
        return int(self.buffer.data_ptr())

    def metadata(self) -> bytes:
        """What a peer needs to write into our buffer (sent over the authenticated control channel)."""
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

    def write(self, remote: str, local_off: int, remote_addr: int, nbytes: int, remote_dev: int = 0,
              timeout: float = 30.0) -> None:
        """Blocking WRITE of local buffer[local_off:+nbytes] to the peer's address (call on a worker thread)."""
        self._xfer("WRITE", remote, local_off, remote_addr, nbytes, remote_dev, timeout)

    def read(self, remote: str, local_off: int, remote_addr: int, nbytes: int, remote_dev: int = 0,
             timeout: float = 30.0) -> None:
        """Blocking READ of the peer's [remote_addr, +nbytes) into local buffer[local_off:] (worker thread).
        NIXL refuses a range outside the peer's registrations (nixlNotFoundError) before anything moves."""
        self._xfer("READ", remote, local_off, remote_addr, nbytes, remote_dev, timeout)

    async def aread(self, remote: str, local_off: int, remote_addr: int, nbytes: int, remote_dev: int = 0,
                    timeout: float = 30.0) -> None:
        """`read`, waited for on the event loop with no thread: for small layers, where a hop to a worker
        thread and back costs more than the READ (which often completes inside the call that posts it)."""
        handle, state = self._post("READ", remote, local_off, remote_addr, nbytes, remote_dev)
        try:
            deadline, polls = time.monotonic() + timeout, 0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nixl READ of {nbytes} bytes with {remote} timed out")
                # yield to the loop's other work between checks; past a few hundred the READ is a slow one:
                # check once a millisecond (the loop's timer resolution) instead of spinning the core
                polls += 1
                await asyncio.sleep(0 if polls < 200 else 1e-3)
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise OSError(f"nixl READ with {remote} failed ({state})")
        finally:
            with self._lock:
                self._agent.release_xfer_handle(handle)

    def _post(self, op: str, remote: str, local_off: int, remote_addr: int, nbytes: int,
              remote_dev: int) -> tuple[Any, str]:
        """Describe and post one transfer: (its handle, its first state)."""
        if not 0 <= local_off <= self.buffer.numel() - nbytes:
            raise ValueError(f"local range [{local_off}, +{nbytes}) is outside the staging buffer")
        # One call at a time into the agent (its thread-safety depends on the build's sync mode); waiting runs
        # unlocked, so concurrent transfers still overlap on the wire.
        with self._lock:
            src = self._agent.get_xfer_descs([(self.base + local_off, nbytes, 0)], self.mem_type)
            dst = self._agent.get_xfer_descs([(remote_addr, nbytes, remote_dev)], self.mem_type)
            handle = self._agent.initialize_xfer(op, src, dst, remote)
        try:
            with self._lock:
                return handle, self._agent.transfer(handle)
        except BaseException:
            with self._lock:
                self._agent.release_xfer_handle(handle)
            raise

    def _xfer(self, op: str, remote: str, local_off: int, remote_addr: int, nbytes: int, remote_dev: int,
              timeout: float) -> None:
        handle, state = self._post(op, remote, local_off, remote_addr, nbytes, remote_dev)
        try:
            deadline = time.monotonic() + timeout
            pause = 0.0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nixl {op} of {nbytes} bytes with {remote} timed out")
                # The agent's progress thread moves the bytes: polling only asks whether it is done. Spinning
                # would take a core from that thread (and from the peer, on one host), so back off from a
                # bare yield to at most 0.5 ms between checks (a 64 MiB read takes tens of ms).
                time.sleep(pause)
                pause = min(5e-4, pause * 2 or 2e-5)
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise OSError(f"nixl {op} with {remote} failed ({state})")
        finally:
            with self._lock:
                self._agent.release_xfer_handle(handle)

    def close(self) -> None:
        for name in list(self._remotes):
            self.remove_remote(name)
        with self._lock:
            if self._reg is not None:
                self._agent.deregister_memory(self._reg)
                self._reg = None

    @property
    def registered(self) -> bool:
        return self._reg is not None
