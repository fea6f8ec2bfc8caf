"""The interface every KV transfer backend implements: the engine's KV connector (`save_kv_layer`, called by
the engine) plus the transport side the worker's /internal routes drive (`connector.py` has the protocol)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import torch

from pdcluster.worker.engine.kv_connector import KVConnectorBase

if TYPE_CHECKING:
    from pdcluster.worker.transfer.connector import LoadSpec, SaveResult, TransferTarget


class KVConnector(KVConnectorBase):
    """A transfer backend: the engine's connector (save_kv_layer, called by the engine) plus the transport
    side driven by the worker's /internal routes."""

    # ---- producer
    @abc.abstractmethod
    def start_save(self, request_id: str, target: TransferTarget, num_layers: int) -> None: ...

    @abc.abstractmethod
    def save_kv_layer(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor,
                      token_start: int = 0, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None: ...

    @abc.abstractmethod
    async def wait_for_save(self, request_id: str) -> SaveResult: ...

    @abc.abstractmethod
    async def abort_save(self, request_id: str) -> None: ...

    # ---- consumer
    @abc.abstractmethod
    def start_load_kv(self, spec: LoadSpec) -> None: ...

    @abc.abstractmethod
    async def wait_for_layer_load(self, request_id: str, layer: int) -> None: ...

    @abc.abstractmethod
    async def wait_for_load(self, request_id: str, timeout: float | None = None) -> None: ...

    @abc.abstractmethod
    def cancel_load(self, request_id: str) -> None: ...

    # ---- both
    @abc.abstractmethod
    def get_finished(self) -> tuple[set[str], set[str]]: ...
