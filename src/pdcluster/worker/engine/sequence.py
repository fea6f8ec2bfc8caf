"""A request as the engine tracks it: its tokens, how many have KV in the cache, and where that KV lives."""

from __future__ import annotations

import itertools
import re
from enum import Enum, auto

from pdcluster.worker.engine.outputs import FinishReason
from pdcluster.worker.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()  # queued, or being prefilled in chunks (then it already holds blocks)
    RUNNING = auto()  # decoding
    SWAPPED = auto()  # preempted, KV parked in host memory
    PREFILLED = auto()  # prefill-only request done; blocks held until released (disaggregation)
    IMPORTING = auto()  # blocks reserved, KV arriving from a prefill worker
    FINISHED = auto()


_arrival = itertools.count()

# The API names a client request `<cmpl|chatcmpl>-<uuid hex>` (api/responses.new_id); its n choices and batched
# prompts become `<that>-<index>`, and the router appends `-<attempt>`. The sequences sharing that head are one
# client's fan-out, which the scheduler keeps to a fair share of the batch (scheduler.py).
_API_REQUEST = re.compile(r"(?:chat)?cmpl-[0-9a-f]{32}")


def request_group(request_id: str) -> str:
    """The client request ``request_id`` belongs to: the API id it was derived from, else the id itself."""
    m = _API_REQUEST.match(request_id)
    return m.group(0) if m else request_id


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        group: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.group = request_group(request_id) if group is None else group  # siblings share a fair share
        self.arrival = next(_arrival)  # FCFS order; survives preemption so the victim keeps its place
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.prefill_only = prefill_only
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the leading full blocks already published
        self.host_block_table: list[int] = []  # while SWAPPED
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.first_scheduled_at: float | None = None  # time.monotonic() of its first prefill step (metrics)
        self.num_exported_tokens = 0  # prefill-only: tokens whose KV already left through the KV connector

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, tokens={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
