"""The tensor-parallel process group of this process: started once per rank, torn down on close.

Three groups over the same ranks. WORLD serves the start-up (rendezvous, agreeing on the cache size), with a
long timeout. The step group carries rank 0's per-step broadcast: its timeout is local to each rank, so rank
0 gives up on a silent follower after the short timeout while a follower waits as long as the server sits
idle. The compute group carries the all_reduce / all_gather inside each forward, with the short timeout
everywhere: a rank that stops answering fails the step instead of hanging the worker. Rendezvous is on
127.0.0.1 only (gloo also binds its pairs to the loopback interface); gloo on CPU, NCCL on CUDA for compute.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # a follower waits this long for rank 0's next step
_compute: dist.ProcessGroup | None = None
_step: dist.ProcessGroup | None = None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the rendezvous store binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def compute_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init(rank: int, size: int, port: int, device: str, timeout_s: float) -> None:
    """Join the group (blocks until every rank has); ``timeout_s`` bounds each collective of a step."""
    global _compute, _step
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo's pairs on loopback
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)  # rank r drives cuda:r; NCCL binds its communicator to it
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S),
    )
    _compute = _new_group(size, timeout_s, compute_backend(device))
    _step = _new_group(size, timeout_s if rank == 0 else IDLE_TIMEOUT_S, "gloo")  # pickled steps: CPU


def _new_group(size: int, timeout_s: float, backend: str) -> dist.ProcessGroup:
    made = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=timeout_s), backend=backend)
    assert isinstance(made, dist.ProcessGroup)  # every rank is a member (NON_GROUP_MEMBER is for others)
    return made


def compute_group() -> dist.ProcessGroup:
    if _compute is None:
        raise RuntimeError("the tensor-parallel group is not started (parallel.group.init)")
    return _compute


def step_group() -> dist.ProcessGroup:
    if _step is None:
        raise RuntimeError("the tensor-parallel group is not started (parallel.group.init)")
    return _step


def teardown() -> None:
    global _compute, _step
    if dist.is_initialized():
        dist.destroy_process_group()
    _compute = _step = None
