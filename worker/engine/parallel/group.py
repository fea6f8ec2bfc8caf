"""The tensor-parallel process group of this process: started once per rank, torn down on close.

Two groups over the same ranks: the default (WORLD) group carries rank 0's step broadcast, and waits as long
as a server may sit idle; the compute group carries the all_reduce / all_gather inside each forward, with a
short timeout so a rank that stops answering fails the step instead of hanging the worker. Rendezvous is on
127.0.0.1 only (gloo also binds its pairs to the loopback interface); gloo on CPU, NCCL on CUDA for compute.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # a follower waits this long for rank 0's next step
_compute: dist.ProcessGroup | None = None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the rendezvous store binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def compute_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init(rank: int, size: int, port: int, device: str, timeout_s: float) -> None:
    """Join the group (blocks until every rank has); ``timeout_s`` bounds each collective of a step."""
    global _compute
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo's pairs on loopback
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S),
    )
    made = dist.new_group(
        list(range(size)), timeout=datetime.timedelta(seconds=timeout_s), backend=compute_backend(device)
    )
    assert isinstance(made, dist.ProcessGroup)  # every rank is a member (NON_GROUP_MEMBER is for others)
    _compute = made


def compute_group() -> dist.ProcessGroup:
    if _compute is None:
        raise RuntimeError("the tensor-parallel group is not started (parallel.group.init)")
    return _compute


def teardown() -> None:
    global _compute
    if dist.is_initialized():
        dist.destroy_process_group()
    _compute = None
