"""The fake engine plus the KV-connector surface `Disaggregation` uses, so the /internal/* routes can run over
real HTTP without torch; `seen` records every request that reaches the engine."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from pdcluster.worker.engine.outputs import RequestOutput
from pdcluster.worker.engine.sampling_params import SamplingParams

from .fake_engine import FakeEngine


class DisaggFakeEngine(FakeEngine):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.kv_layout = SimpleNamespace(num_layers=2, kv_heads=1, head_dim=4, block_size=self.block_size)
        self.seen: list[str] = []
        # the pre-KV-connector surface (engine.engine.model_config, call(fn)), while both are in the tree
        self.engine = SimpleNamespace(model_config=SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4),
                                      config=SimpleNamespace(block_size=self.block_size))

    async def call(self, fn: Any) -> Any:
        out = fn(self)
        return await out if inspect.isawaitable(out) else out

    async def generate(self, request_id: str, prompt_token_ids: list[int],  # type: ignore[override]
                       params: SamplingParams, **_: Any) -> AsyncIterator[RequestOutput]:
        self.seen.append(request_id)
        async for out in super().generate(request_id, prompt_token_ids, params):
            yield out

    async def set_kv_connector(self, connector: Any) -> None:
        pass

    async def reserve_for_import(self, request_id: str, *_: Any) -> bool:
        self.seen.append(request_id)
        return True

    async def cancel_import(self, request_id: str) -> None:
        pass

    async def release(self, request_id: str) -> None:
        pass
