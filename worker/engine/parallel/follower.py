"""A follower rank's process: join the group, load this rank's slice, then run every step rank 0 broadcasts.

Started by rank 0 (runner.py) with one JSON line on stdin; stdin stays open for as long as rank 0 lives, and
its EOF ends this process at once, so a follower never outlives its worker. A collective that fails (rank 0
or another rank died, or the compute timeout passed) ends it too.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.engine_config import EngineConfig
from pdcluster.worker.engine.model_runner import ModelRunner
from pdcluster.worker.engine.parallel import group, kv_relay, step
from pdcluster.worker.engine.parallel.runner import agree_num_blocks, rank_device, store_own
from pdcluster.worker.engine.parallel.shard import local_config
from pdcluster.worker.engine.scheduler import Batch

log = logging.getLogger("pdcluster.tp.follower")


def _exit_on_eof() -> None:
    while sys.stdin.buffer.read(4096):
        pass
    os._exit(0)  # rank 0 is gone: leave now, whatever the main thread is blocked in


def _exporter(runner: ModelRunner, batch: Batch, exports: list[tuple[int, int, int]]) -> Callable[[int], None]:
    """The layer hook of a step that exports KV: our heads of each range to rank 0, in rank 0's order."""

    def hook(layer: int) -> None:
        for row, start, end in exports:
            kv_relay.send_export(runner.cache, layer, runner.slots(batch.seqs[row], start, end))

    return hook


def serve(spec: dict) -> None:
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
    box: list[step.StepMsg | None] = [None]
    while True:
        dist.broadcast_object_list(box, src=0, group=group.step_group())  # type: ignore[arg-type]
        msg = box[0]
        if msg is None:  # rank 0 is closing
            break
        if isinstance(msg, step.ImportMsg):  # a received layer (decode role): write our heads of it
            store_own(runner, msg, kv_relay.receive_part(msg.shape, getattr(torch, msg.dtype), msg.quantized))
            continue
        batch = step.decode(msg)
        runner.execute(batch, _exporter(runner, batch, msg.exports) if msg.exports else None)
    group.teardown()


def main() -> None:
    line = sys.stdin.buffer.readline()
    if not line:
        return
    spec = json.loads(line)
    # rank 0's level: `pdcluster serve --log-level warning` quiets every rank
    logging.basicConfig(level=int(spec.get("log_level", logging.INFO)),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_on_eof, name="pdcluster-tp-parent", daemon=True).start()
    try:
        serve(spec)
    except Exception as e:  # rank 0 or a peer died, or a step failed: this rank is done either way
        log.error("tensor-parallel rank %s stopping: %s: %s", spec.get("rank"), type(e).__name__, e)
        os._exit(1)


if __name__ == "__main__":
    main()
