"""NIXL (NVIDIA Inference Xfer Library, UCX underneath: RDMA, NVLink, shared memory, TCP) as seen by
pdcluster: whether it loads here and why not, and the few agent calls a KV transfer needs.

Only this module imports nixl. The wheel (`nixl-cu12`) bundles UCX and runs on CPU-only machines (host
memory, DRAM segments); GPU memory is registered the same way where CUDA is present.
"""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str  # why it runs or why not, for the one log line that says which backend runs


@functools.cache
def availability() -> Availability:
    """Can a NIXL agent with the UCX backend be created in this process? (Cached: creating one is cheap, but
    a failure is the same every time.)"""
    try:
        from nixl_cu12 import nixl_agent, nixl_agent_config
    except Exception as e:  # ImportError, or a bundled library that does not load on this host
        return Availability(False, f"nixl is not importable ({type(e).__name__}: {e})")
    try:
        agent = nixl_agent(f"pdkv-probe-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=["UCX"]))
        if "UCX" not in agent.backends:
            return Availability(False, "nixl loads but its UCX backend plugin does not")
    except Exception as e:
        return Availability(False, f"nixl agent creation failed ({type(e).__name__}: {e})")
    return Availability(True, "nixl with the UCX backend loads")


class Agent:
    """One NIXL agent with one registered buffer (the staging area: registered once, never per transfer)."""

    def __init__(self, name: str, staging_bytes: int, device: str = "cpu") -> None:
        from nixl_cu12 import nixl_agent, nixl_agent_config

        self.name = name
        self._agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self.buffer = torch.zeros(staging_bytes, dtype=torch.uint8, device=device)
        self._reg: Any = self._agent.register_memory(self.buffer)
        self._remotes: set[str] = set()

    @property
    def base(self) -> int:
        return int(self.buffer.data_ptr())

    def metadata(self) -> bytes:
        """What a peer needs to write into our buffer (sent over the authenticated control channel)."""
        return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes.add(name)
        return name

    def write(self, remote: str, local_off: int, remote_addr: int, nbytes: int, remote_dev: int = 0,
              timeout: float = 30.0) -> None:
        """Blocking WRITE of local buffer[local_off:+nbytes] to the peer's address (call on a worker thread)."""
        src = self._agent.get_xfer_descs([(self.base + local_off, nbytes, 0)], "DRAM")
        dst = self._agent.get_xfer_descs([(remote_addr, nbytes, remote_dev)], "DRAM")
        handle = self._agent.initialize_xfer("WRITE", src, dst, remote)
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nixl write of {nbytes} bytes to {remote} timed out")
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise OSError(f"nixl write to {remote} failed ({state})")
        finally:
            self._agent.release_xfer_handle(handle)

    def close(self) -> None:
        for name in list(self._remotes):
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # the peer may be gone already
                pass
        self._remotes.clear()
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
