"""`pdcluster up --autoscale`: the planner-driven resize decision, with the router's metrics faked."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from pdcluster.worker.local import autoscale as launch_autoscale
from pdcluster.worker.local.autoscale import Autoscaler, counters
from pdcluster.worker.local.demo import plan_pd


def test_counters_sum_series_across_labels() -> None:
    text = ('# HELP x\npdcluster_requests_total{role="router"} 3.0\n'
            'pdcluster_requests_total{role="router",pdcluster="a"} 2.0\nfoo 1\n')
    assert counters(text) == {"pdcluster_requests_total": 5.0, "foo": 1.0}


def test_plan_pd_uses_the_operator_planner() -> None:
    pd = plan_pd(2048, 512, 10_000, 2_000, 10.0)  # DESIGN.md's example: 1 : 1.25
    assert pd["source"] == "operator" and abs(pd["ratio"] - 1.25) < 1e-9
    assert (pd["prefill"], pd["decode"]) == (4, 4)  # ceil(1.5*10*0.2048)=4, ceil(1.5*10*0.256)=4


@dataclass
class FakeProc:
    enabled: bool
    popen: Any = None


@dataclass
class FakeSup:
    procs: dict[str, FakeProc] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    def enable(self, name: str) -> None:
        self.procs[name] = FakeProc(True, object())
        self.log.append(f"+{name}")

    def disable(self, name: str) -> None:
        self.procs[name].enabled = False
        self.log.append(f"-{name}")


def metrics(n: float, prompt: float, gen: float, ttft_sum: float, tpot_sum: float, tpot_n: float) -> str:
    return "\n".join([
        f"pdcluster_requests_total {n}", f"pdcluster_prompt_tokens_total {prompt}",
        f"pdcluster_generation_tokens_total {gen}", f"pdcluster_time_to_first_token_seconds_sum {ttft_sum}",
        f"pdcluster_time_to_first_token_seconds_count {n}", f"pdcluster_time_per_output_token_seconds_sum {tpot_sum}",
        f"pdcluster_time_per_output_token_seconds_count {tpot_n}"])


def test_autoscaler_scales_up_at_once_and_down_after_three_ticks(monkeypatch: pytest.MonkeyPatch) -> None:
    sup = FakeSup({"prefill-0": FakeProc(True, object()), "prefill-1": FakeProc(True),
                   "decode-0": FakeProc(True, object()), "decode-1": FakeProc(True), "decode-2": FakeProc(True)})
    snaps = iter([metrics(0, 0, 0, 0, 0, 0),
                  # heavy: 600 requests of 1000 in / 100 out tokens, slow TTFT -> needs more of both pools
                  metrics(600, 600_000, 60_000, 600 * 0.5, 60_000 * 0.05, 60_000)]
                 + [metrics(600 + k, 600_000 + 10 * k, 60_000 + k, 300 + 0.001 * k, 3000 + 0.001 * k, 60_000 + k)
                    for k in range(1, 5)])
    monkeypatch.setattr(launch_autoscale.httpx, "get", lambda *a, **k: httpx.Response(200, text=next(snaps)))
    clock = [0.0]
    monkeypatch.setattr(launch_autoscale.time, "monotonic", lambda: clock[0])
    scaler = Autoscaler("http://router", sup, max_workers=3, interval=15)  # type: ignore[arg-type]
    for _ in range(2):
        clock[0] += 15
        scaler.tick()
    assert "+prefill-1" in sup.log and "+decode-1" in sup.log
    grown = len(sup.log)
    for _ in range(2):  # light traffic: two ticks are not enough to shrink
        clock[0] += 15
        scaler.tick()
    assert len(sup.log) == grown
    clock[0] += 15
    scaler.tick()
    assert any(e.startswith("-") for e in sup.log[grown:])
