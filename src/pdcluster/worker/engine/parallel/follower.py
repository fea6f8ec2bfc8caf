"""A follower rank's process: join the group, load this rank's slice, then run every step rank 0 broadcasts.

Started by rank 0 (runner.py) with one JSON line on stdin; stdin stays open for as long as rank 0 lives, and
its EOF ends this process at once, so a follower never outlives its worker. A collective that fails (rank 0
or another rank died, or the compute timeout passed) ends it too. Later stdin lines are control commands
(control.py): the first, ``kv_listen``, starts this rank's own KV transfer endpoint (a class the server names,
so the engine never imports the transfer code), the others go to that endpoint.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.engine_config import EngineConfig
from pdcluster.worker.engine.model_runner import ModelRunner
from pdcluster.worker.engine.parallel import control, group, kv_relay, step
from pdcluster.worker.engine.parallel.runner import agree_num_blocks, rank_device, store_own
from pdcluster.worker.engine.parallel.shard import local_config
from pdcluster.worker.engine.scheduler import Batch

log = logging.getLogger("pdcluster.tp.follower")


class Rank:
    """What a follower holds besides its model slice: its KV endpoint once rank 0 starts one (the direct
    path), and the lock that keeps the endpoint's cache writes out of this rank's steps."""

    def __init__(self, rank: int, size: int, reply: control.Replies) -> None:
        self.rank, self.size, self.reply = rank, size, reply
        self.runner: ModelRunner | None = None
        self.ready = threading.Event()  # the runner is built
        self.lock = threading.Lock()  # held by each step; the endpoint's imports take it too
        self.endpoint: Any = None

    def command(self, msg: dict[str, Any]) -> None:
        """One control line from rank 0 (the stdin thread)."""
        if msg.get("op") == "kv_listen":  # the server names the endpoint: the engine never imports transfer
            self.ready.wait()
            module, _, name = str(msg["factory"]).partition(":")
            try:
                factory = getattr(importlib.import_module(module), name)
                self.endpoint = factory(rank=self.rank, size=self.size, runner=self.runner, lock=self.lock,
                                        reply=self.reply, options=msg.get("options", {}))
            except Exception as e:  # rank 0 falls back to the relay
                log.exception("tensor-parallel rank %d: KV endpoint failed to start", self.rank)
                self.reply({"op": "kv_failed", "error": f"{type(e).__name__}: {e}"})
        elif self.endpoint is not None:
            self.endpoint.command(msg)


def _commands(me: Rank) -> None:
    for line in sys.stdin.buffer:
        try:
            me.command(json.loads(line))
        except Exception:  # a bad line must not end the channel (its EOF is rank 0's death)
            log.exception("tensor-parallel rank %d: control command failed", me.rank)
    os._exit(0)  # rank 0 is gone: leave now, whatever the main thread is blocked in


def _exporter(me: Rank, runner: ModelRunner, batch: Batch, exports: list[step.Export]) -> Callable[[int], None]:
    """The layer hook of a step that exports KV, in rank 0's order: our heads of each range sent to their
    decode ranks by our own endpoint (direct), or gathered to rank 0 (relay)."""

    def hook(layer: int) -> None:
        for row, start, end, rid, targets in exports:
            slots = runner.slots(batch.seqs[row], start, end)
            if targets is not None:  # rank 0 gathers nothing for it: never join a gather here
                if me.endpoint is not None:
                    me.endpoint.save(rid, [tuple(t) for t in targets], layer, start, slots)
                elif layer == 0:  # cannot happen (rank 0 goes direct only once every endpoint started)
                    log.error("tensor-parallel rank %d: no KV endpoint for %s; its heads are not sent", me.rank, rid)
            else:
                kv_relay.send_export(runner.cache, layer, slots)

    return hook


def serve(spec: dict, me: Rank) -> None:
    rank, size = int(spec["rank"]), int(spec["size"])
    raw = dict(spec["config"])
    raw["full_precision_layers"] = tuple(raw.get("full_precision_layers") or ())
    config = EngineConfig(**raw)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    cfg = ModelConfig.from_folder(config.model)
    group.init(rank, size, int(spec["port"]), config.device, config.tensor_parallel_timeout)
    kwargs = config.runner_kwargs(int(spec["max_model_len"]))
    kwargs["device"] = rank_device(config.device, rank)
    runner = ModelRunner(local_config(cfg, size, rank), **kwargs)
    agree_num_blocks(runner)
    me.runner = runner
    me.ready.set()
    box: list[step.StepMsg | None] = [None]
    while True:
        dist.broadcast_object_list(box, src=0, group=group.step_group())
        msg = box[0]
        if msg is None:  # rank 0 is closing
            break
        if isinstance(msg, step.ImportMsg):  # a received layer (decode role): write our heads of it
            store_own(runner, msg, kv_relay.receive_part(msg.shape, getattr(torch, msg.dtype), msg.quantized))
            continue
        batch = step.decode(msg)
        with me.lock:
            runner.execute(batch, _exporter(me, runner, batch, msg.exports) if msg.exports else None)
    group.teardown()


def main() -> None:
    line = sys.stdin.buffer.readline()
    if not line:
        return
    spec = json.loads(line)
    # rank 0's level: `pdcluster serve --log-level warning` quiets every rank
    logging.basicConfig(level=int(spec.get("log_level", logging.INFO)),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    me = Rank(int(spec["rank"]), int(spec["size"]), control.Replies(int(spec["reply_fd"])))
    threading.Thread(target=_commands, args=(me,), name="pdcluster-tp-parent", daemon=True).start()
    try:
        serve(spec, me)
    except Exception as e:  # rank 0 or a peer died, or a step failed: this rank is done either way
        log.error("tensor-parallel rank %s stopping: %s: %s", spec.get("rank"), type(e).__name__, e)
        os._exit(1)


if __name__ == "__main__":
    main()
