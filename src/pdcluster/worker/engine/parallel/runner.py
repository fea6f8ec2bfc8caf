"""Rank 0's model runner under tensor parallelism: starts the follower ranks, then runs each step on its own
slice of the model after broadcasting the step to them.

Each follower is a child process of this worker (``python -m pdcluster.worker.engine.parallel.follower``)
that reads its rank and the engine config from its stdin and treats EOF there as rank 0's death (no orphans,
however rank 0 ends). Rank 0 keeps the scheduler, block manager and sampler; every rank keeps its own slice
of the weights and a paged cache of the same blocks holding only its KV heads. A watcher thread polls the
followers: one that exits marks this runner faulted (the worker's /health then fails), and the step that
was waiting on it fails within the compute group's timeout instead of hanging.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.engine_config import EngineConfig
from pdcluster.worker.engine.kv_cache import PagedKVCache
from pdcluster.worker.engine.kv_transfer import store_layer
from pdcluster.worker.engine.model_runner import ModelRunner
from pdcluster.worker.engine.parallel import group, step
from pdcluster.worker.engine.parallel.control import Control
from pdcluster.worker.engine.parallel.kv_relay import RelayedKV, Views, own_heads, scatter_parts
from pdcluster.worker.engine.parallel.shard import check_tp, local_config
from pdcluster.worker.engine.scheduler import Batch
from pdcluster.worker.engine.sequence import Sequence

log = logging.getLogger(__name__)
POLL_S = 0.2


def rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device.startswith("cuda") else device


def agree_num_blocks(runner: ModelRunner) -> int:
    """Every rank's cache must address the same block ids: all use the smallest count (CUDA ranks may differ;
    the extra blocks of a larger cache are never handed out)."""
    t = torch.tensor([runner.cache.num_blocks], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    runner.cache.num_blocks = int(t.item())
    return runner.cache.num_blocks


def store_own(runner: ModelRunner, msg: step.ImportMsg, part: Views) -> None:
    """Write this rank's heads of a relayed layer into its cache (any rank)."""
    store_layer(runner.cache, msg.layer, part[0], part[1], part[2], msg.slots, runner.device, runner.dtype)


class TPModelRunner:
    def __init__(self, cfg: ModelConfig, config: EngineConfig, max_model_len: int) -> None:
        tp = config.tensor_parallel_size
        check_tp(cfg, tp)
        self.tp, self.vocab_size, self.num_kv_heads = tp, cfg.vocab_size, cfg.num_kv_heads
        self.fault: str | None = None
        self._closed = False
        if config.num_threads is None and not config.device.startswith("cuda"):
            # N ranks on one machine's cores: each gets its share instead of all of them (oversubscription)
            threads = max(1, len(os.sched_getaffinity(0)) // tp)
            config = dataclasses.replace(config, num_threads=threads)
            torch.set_num_threads(threads)
        port = group.free_port()
        spec = {"log_level": logging.getLogger().getEffectiveLevel(), "size": tp, "port": port, "config": dataclasses.asdict(config), "max_model_len": max_model_len}
        self.followers: list[subprocess.Popen[bytes]] = []
        self.control = Control()  # per-rank commands beside the steps (the direct KV path: control.py)
        # request id -> its decode ranks' addresses, for the requests each rank sends its own heads of
        self.direct: dict[str, step.Targets] = {}
        self.exporting_direct: frozenset[str] = frozenset()
        try:
            for rank in range(1, tp):
                read_fd, write_fd = os.pipe()
                try:
                    proc = subprocess.Popen([sys.executable, "-m", "pdcluster.worker.engine.parallel.follower"],
                                            stdin=subprocess.PIPE, pass_fds=(write_fd,))
                finally:
                    os.close(write_fd)
                self.followers.append(proc)
                assert proc.stdin is not None
                proc.stdin.write((json.dumps({**spec, "rank": rank, "reply_fd": write_fd}) + "\n").encode())
                proc.stdin.flush()  # stays open: its EOF tells the follower rank 0 is gone
                self.control.add(rank, proc.stdin, read_fd)
            self._watched(lambda: group.init(0, tp, port, config.device, config.tensor_parallel_timeout))
            kwargs = config.runner_kwargs(max_model_len)
            kwargs["device"] = rank_device(config.device, 0)
            self.local = ModelRunner(local_config(cfg, tp, 0), **kwargs)
            self._watched(lambda: agree_num_blocks(self.local))
        except BaseException:
            self.close()
            raise
        log.info("tensor parallel: %d ranks, follower pids %s", tp, self.pids)
        threading.Thread(target=self._watch, name="pdcluster-tp-watch", daemon=True).start()

    # -- what the engine reads off its runner ----------------------------------------------------------

    @property
    def relay(self) -> RelayedKV:  # what the engine exports from: every rank's heads (kv_relay.py)
        return RelayedKV(self.local.cache, self.num_kv_heads, self.tp)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.followers]

    @property
    def cache(self) -> PagedKVCache:  # rank 0's slice: same blocks, its own KV heads
        return self.local.cache

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def block_bytes(self) -> int:  # per rank; the ranks swap their slices in parallel
        return self.local.block_bytes

    @property
    def num_host_blocks(self) -> int:
        return self.local.num_host_blocks

    def slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        return self.local.slots(seq, start, end)

    # -- the step ----------------------------------------------------------------------------------------

    def execute(self, batch: Batch, layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        if self.fault is not None:
            raise RuntimeError(self.fault)
        msg = step.encode(batch)
        if layer_hook is not None:  # the engine exports KV: every rank gathers its heads to ours (kv_relay)
            msg.exports = step.export_ranges(batch, self.direct)
        # what the engine's export reads during this forward: the step's own choice, whatever `direct` does
        self.exporting_direct = frozenset(e[3] for e in msg.exports if e[4] is not None)
        try:
            dist.broadcast_object_list([msg], src=0, group=group.step_group())
            logits = self.local.execute(batch, layer_hook)
        except Exception as e:  # the ranks are out of step now: nothing more can run
            self._set_fault(f"tensor-parallel step failed ({type(e).__name__}: {e})")
            raise RuntimeError(self.fault) from e
        return logits if batch.seqs else torch.empty(0, self.vocab_size)

    def import_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                     scales: tuple[torch.Tensor, torch.Tensor] | None, slots: torch.Tensor) -> None:
        """One received layer of every KV head (engine thread, between steps): sent to every rank, each of
        which writes the heads it holds."""
        if self.fault is not None:
            raise RuntimeError(self.fault)
        try:
            parts = scatter_parts(k, v, scales, self.num_kv_heads, self.tp)
            own = own_heads(k, v, scales, self.num_kv_heads, self.tp, 0)
            tokens, heads, width = own[0].shape
            msg = step.ImportMsg(layer, slots.cpu(), str(k.dtype).removeprefix("torch."), (tokens, heads, width),
                                 scales is not None)
            dist.broadcast_object_list([msg], src=0, group=group.step_group())
            dist.scatter(torch.empty_like(parts[0]), parts, src=0, group=group.step_group())
            store_own(self.local, msg, own)
        except Exception as e:
            self._set_fault(f"tensor-parallel KV import failed ({type(e).__name__}: {e})")
            raise RuntimeError(self.fault) from e

    # -- follower processes ---------------------------------------------------------------------------

    def _set_fault(self, message: str) -> None:
        if self.fault is None and not self._closed:
            self.fault = message
            log.error("%s", message)

    def _dead_follower(self) -> str | None:
        for rank, proc in enumerate(self.followers, start=1):
            code = proc.poll()
            if code is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
        return None

    def _watched(self, fn: Callable[[], Any]) -> None:
        """Run a blocking group call, failing fast if a follower dies meanwhile (instead of its timeout)."""
        error: list[BaseException] = []

        def target() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                error.append(e)

        t = threading.Thread(target=target, daemon=True)
        t.start()
        while t.is_alive():
            t.join(POLL_S)
            dead = self._dead_follower()
            if dead is not None and t.is_alive():
                raise RuntimeError(f"{dead} while the tensor-parallel group was starting")
        if error:
            raise error[0]

    def _watch(self) -> None:
        while not self._closed:
            dead = self._dead_follower()
            if dead is not None:
                self._set_fault(dead)
                return
            time.sleep(POLL_S)

    def close(self) -> None:
        """Stop the followers (a goodbye step, then EOF on their stdin, then a kill) and leave the group."""
        if self._closed:
            return
        healthy = self.fault is None and dist.is_initialized() and self._dead_follower() is None
        self._closed = True
        if healthy:
            try:
                dist.broadcast_object_list([None], src=0, group=group.step_group())
            except Exception:  # a follower that is gone already
                log.debug("goodbye broadcast failed", exc_info=True)
        for proc in self.followers:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.followers:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        group.teardown()
