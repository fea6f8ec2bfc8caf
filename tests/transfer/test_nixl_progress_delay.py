"""NIXL agents are built with a sleeping progress thread: the wheel's own constructor passes a delay of 0,
with which UCX's progress thread busy-spins a core per idle worker (measured: 0.96 cores)."""

from __future__ import annotations

from typing import Any

import pytest

from pdcluster.worker.transfer import nixl_agent as na

pytestmark = pytest.mark.skipif(not na.availability().ok, reason="nixl with UCX does not load on this host")


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pthrDelay of every config that reaches the C++ agent."""
    from nixl_cu12 import _api

    delays: list[int] = []
    real = _api.nixlBind.nixlAgent

    def spy(name: str, config: Any) -> Any:
        delays.append(config.pthrDelay)
        return real(name, config)

    monkeypatch.setattr(_api.nixlBind, "nixlAgent", spy)
    return delays


def test_the_wheel_alone_would_spin(seen: list[int]) -> None:
    from nixl_cu12 import nixl_agent, nixl_agent_config

    nixl_agent("spin-premise", nixl_agent_config(backends=["UCX"]))
    assert seen == [0]  # the premise of new_agent: if a wheel stops doing this, the override is moot


def test_our_agents_sleep_between_polls(seen: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    from nixl_cu12 import _api

    base = _api.nixlBind.nixlAgentConfig
    na.new_agent("delay-default")
    monkeypatch.setenv("PDCLUSTER_NIXL_PROGRESS_DELAY_US", "250")
    agent = na.Agent("delay-env", 4096)
    assert seen == [na.PROGRESS_DELAY_US, 250]
    assert _api.nixlBind.nixlAgentConfig is base  # the swap lasts one construction
    agent.close()


@pytest.mark.parametrize("raw", ["fast", "-1", "1.5"])
def test_a_bad_delay_is_named(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLUSTER_NIXL_PROGRESS_DELAY_US", raw)
    with pytest.raises(ValueError, match="PDCLUSTER_NIXL_PROGRESS_DELAY_US"):
        na.new_agent("delay-bad")
