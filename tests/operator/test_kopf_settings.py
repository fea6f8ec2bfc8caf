"""The operator's kopf settings: what the startup handler sets, checked on a real OperatorSettings."""

from __future__ import annotations

import logging
from typing import Any

import kopf
import pytest

from pdcluster.operator import handlers


class _NoKube:
    host = "https://test.invalid"

    async def close(self) -> None:
        return None


async def test_watches_and_requests_have_finite_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    async def fake_env(*_: Any, **__: Any) -> _NoKube:
        return _NoKube()

    monkeypatch.setattr(handlers.Kube, "from_environment", staticmethod(fake_env))
    settings = kopf.OperatorSettings()
    assert settings.watching.client_timeout is None  # kopf's default: a silent dead stream waits forever
    await handlers.configure(settings=settings, logger=logging.getLogger("test"))
    try:
        w, n = settings.watching, settings.networking
        # the server closes each watch; the client abandons a silent one a little after that
        assert isinstance(w.server_timeout, int) and 30 <= w.server_timeout <= 600
        assert w.client_timeout is not None and w.client_timeout > w.server_timeout
        assert w.connect_timeout is not None and n.connect_timeout is not None
        assert n.request_timeout is not None and n.request_timeout <= 120
        assert settings.scanning.disabled and settings.execution.max_workers == 4
    finally:
        await handlers.close()
