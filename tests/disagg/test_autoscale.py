"""`pdcluster up --autoscale`: the operator's autoscaler core (`decide`) fed from the local /metrics, with the
router's and the workers' metrics faked (no processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from pdcluster.operator import autoscaler as operator_autoscaler
from pdcluster.operator import planner
from pdcluster.operator.autoscaler import Observation, Policy
from pdcluster.operator.planner import Bounds
from pdcluster.worker.local import autoscale, demo
from pdcluster.worker.local.autoscale import Autoscaler, Scrape, counters, observation

ROUTER = "http://router"


def test_demo_prints_the_operator_planners_pd(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = demo.pd_lines(2048, 512, 10_000, 2_000, 10.0, (1, 1))  # DESIGN.md's example: 1 : 1.25
    assert "4 prefill : 4 decode" in lines[-1] and "ratio 1.25" in lines[-1]  # ceil(1.5*10*0.2048), ceil(3.84)
    seen = []
    monkeypatch.setattr(demo, "plan", lambda **kw: seen.append(kw) or planner.plan(**kw))
    demo.pd_lines(100, 10, 1_000, 100, 1.0, (1, 1))
    assert seen == [{"input_len": 100, "output_len": 10, "prefill_capacity": 1_000, "decode_capacity": 100,
                     "request_rate": 1.0, "headroom": 1.5}]


def test_counters_sum_series_across_labels() -> None:
    text = ('# HELP x\npdcluster_requests_total{role="router"} 3.0\n'
            'pdcluster_requests_total{role="router",pdcluster="a"} 2.0\nfoo 1\n')
    assert counters(text) == {"pdcluster_requests_total": 5.0, "foo": 1.0}


def test_observation_reads_the_prompts_the_routers_load_rule_placed_on_decode() -> None:
    """The load-aggregated rate (decode's TPOT breach is then the valve's price: autoscaler_guard.valve_explains):
    the router's placements by its load rule, not its other placements on decode workers."""
    def placements(load: int, short: int) -> str:
        return ('# TYPE pdcluster_router_placements_total counter\n'
                f'pdcluster_router_placements_total{{role="router",placement="aggregated",reason="prefill_backlog"}} {load}\n'
                f'pdcluster_router_placements_total{{role="router",placement="aggregated",reason="short_prompt"}} {short}\n'
                'pdcluster_router_placements_total{role="router",placement="disaggregated",reason="prompt_length"} 9\n')
    before, after = counters(placements(3, 100)), counters(placements(23, 500))
    assert before["pdcluster_router_placements_total"] == 112  # every placement still sums under its name
    first = Scrape(0.0, {**_router(100, 10_000, 2_000), **before})
    last = Scrape(10.0, {**_router(140, 14_000, 20_000), **after})
    obs = observation(first, last, {})
    assert obs is not None and obs.load_aggregated_rate == 20 / 10
    assert observation(first, Scrape(10.0, _router(140, 14_000, 20_000)), {}).load_aggregated_rate is None


def _router(n: float, prompt: float, gen: float) -> dict[str, float]:
    return {"pdcluster_requests_total": n, "pdcluster_prompt_tokens_total": prompt,
            "pdcluster_generation_tokens_total": gen}


def test_observation_has_the_operators_definitions() -> None:
    first = Scrape(0.0, _router(100, 10_000, 2_000), {
        "prefill-0": ("prefill", {"pdcluster_prompt_tokens_total": 6_000}),
        "decode-0": ("decode", {"pdcluster_generation_tokens_total": 1_000}),
        "decode-1": ("decode", {"pdcluster_generation_tokens_total": 1_000}),
    })
    last = Scrape(10.0, _router(200, 30_000, 4_000), {
        "prefill-0": ("prefill", {"pdcluster_prompt_tokens_total": 26_000}),
        "decode-0": ("decode", {"pdcluster_generation_tokens_total": 2_000}),
        "decode-1": ("decode", {"pdcluster_generation_tokens_total": 50}),  # restarted: counts from 0
    })
    obs = observation(first, last, {"prefill": [2, 1, 3], "decode": [1, 0, 4]})
    assert obs == Observation(
        request_rate=10.0, mean_input_tokens=200.0, mean_output_tokens=20.0,
        prefill_tokens_per_instance=2_000.0,  # 20 000 prompt tokens in 10 s on one instance
        decode_tokens_per_instance=(1_000 + 50) / 10 / 2,
        prefill_saturated=True,  # the queue never emptied
        decode_saturated=False,  # it emptied once
    )


def test_observation_carries_the_decode_join_seconds() -> None:
    """t_join = the decode workers' mean join seconds (sum increase / count increase) less their mean step
    (the TPOT histogram's, the same way); none joined -> None."""
    def dec(s: float, n: float, step_s: float = 0.0, steps: float = 0.0) -> tuple[str, dict[str, float]]:
        return "decode", {"pdcluster_decode_join_seconds_sum": s, "pdcluster_decode_join_seconds_count": n,
                          "pdcluster_time_per_output_token_seconds_sum": step_s,
                          "pdcluster_time_per_output_token_seconds_count": steps}

    first = Scrape(0.0, _router(0, 0, 0), {"decode-0": dec(1.0, 10, 1.0, 100), "decode-1": dec(0.0, 0),
                                           "prefill-0": ("prefill", {"pdcluster_decode_join_seconds_sum": 99.0})})
    last = Scrape(10.0, _router(40, 4000, 400), {"decode-0": dec(2.2, 40, 5.0, 500), "decode-1": dec(0.4, 10),
                                                 "prefill-0": ("prefill", {"pdcluster_decode_join_seconds_sum": 999.0})})
    obs = observation(first, last, {})
    # admission 1.6 s / 40 = 40 ms, step 4 s / 400 = 10 ms -> 30 ms
    assert obs is not None and obs.decode_join_seconds == pytest.approx(0.04 - 0.01)
    same = observation(last, Scrape(20.0, _router(40, 4000, 400), last.workers), {})
    assert same is not None and same.decode_join_seconds is None


def test_no_router_no_observation_and_no_traffic_no_lengths() -> None:
    assert observation(Scrape(0, None), Scrape(10, _router(1, 1, 1)), {}) is None
    idle = observation(Scrape(0, _router(5, 50, 5)), Scrape(10, _router(5, 50, 5)), {})
    assert idle is not None and idle.request_rate == 0 and idle.mean_input_tokens is None
    assert idle.prefill_tokens_per_instance is None  # no prefill worker answered


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


class FakeCluster:
    """Counters that grow by `rate` requests/s of `in_len`/`out_len` tokens, served by the running workers;
    `waiting` requests queued on each decode worker. Answers httpx.get for the router and the workers."""

    def __init__(self, sup: FakeSup, workers: dict[str, tuple[str, str]]) -> None:
        self.sup, self.workers = sup, workers
        self.t, self.rate, self.in_len, self.out_len, self.waiting = 0.0, 0.0, 100.0, 50.0, 0.0
        self.totals = {"requests": 0.0, "prompt": 0.0, "gen": 0.0}
        self.per_worker: dict[str, float] = {n: 0.0 for n in workers}

    def advance(self, dt: float) -> None:
        self.t += dt
        n = self.rate * dt
        self.totals = {"requests": self.totals["requests"] + n, "prompt": self.totals["prompt"] + n * self.in_len,
                       "gen": self.totals["gen"] + n * self.out_len}
        for role, tokens in (("prefill", n * self.in_len), ("decode", n * self.out_len)):
            live = [w for w, (r, _) in self.workers.items() if r == role and self.sup.procs[w].enabled]
            for w in live:
                self.per_worker[w] += tokens / len(live)

    def get(self, url: str, timeout: float = 0) -> httpx.Response:
        base = url.removesuffix("/metrics")
        if base == ROUTER:
            t = self.totals
            text = (f'pdcluster_requests_total{{role="router"}} {t["requests"]}\n'
                    f'pdcluster_prompt_tokens_total{{role="router"}} {t["prompt"]}\n'
                    f'pdcluster_generation_tokens_total{{role="router"}} {t["gen"]}\n')
            return httpx.Response(200, text=text)
        name = next(n for n, (_, u) in self.workers.items() if u == base)
        role = self.workers[name][0]
        counter = "pdcluster_prompt_tokens_total" if role == "prefill" else "pdcluster_generation_tokens_total"
        waiting = self.waiting if role == "decode" else 0.0
        return httpx.Response(200, text=f'{counter}{{role="{role}"}} {self.per_worker[name]}\n'
                                        f'pdcluster_requests_waiting{{role="{role}"}} {waiting}\n')


WORKERS = {f"{r}-{i}": (r, f"http://{r}-{i}") for r in ("prefill", "decode") for i in range(3)}


def _setup(monkeypatch: pytest.MonkeyPatch, policy: Policy) -> tuple[FakeSup, FakeCluster, Autoscaler, list[Any]]:
    sup = FakeSup({n: FakeProc(True, object() if n.endswith("-0") else None) for n in WORKERS})
    cluster = FakeCluster(sup, WORKERS)
    monkeypatch.setattr(autoscale.httpx, "get", cluster.get)
    monkeypatch.setattr(autoscale.time, "monotonic", lambda: cluster.t)
    calls: list[Any] = []

    def spy(*args: Any) -> Any:  # the real operator core; the calls are recorded
        d = operator_autoscaler.decide(*args)
        calls.append((args, d))
        return d

    monkeypatch.setattr(autoscale, "decide", spy)
    return sup, cluster, Autoscaler(ROUTER, sup, WORKERS, policy, interval=15, flip_window=0), calls


def _run(cluster: FakeCluster, scaler: Autoscaler, seconds: float) -> list[str]:
    events: list[str] = []
    for _ in range(int(seconds / 1.5)):
        cluster.advance(1.5)
        events += scaler.tick()
    return events


def test_up_autoscale_applies_the_operators_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    # decode capacity 1000 output tok/s per worker (as `pdcluster profile` would give), 40 req/s x 50 out:
    # D = ceil(1.5 * 40 * 50 / 1000) = 3; prefill capacity learned from a saturated window.
    policy = Policy(bounds=Bounds(1, 3, 1, 3), decode_capacity=1000.0)
    sup, cluster, scaler, calls = _setup(monkeypatch, policy)
    cluster.rate = 40.0
    events = _run(cluster, scaler, 16.5)
    assert len(calls) == 1
    (pol, state, obs, pv, dv, _now, short_need), d = calls[0]
    assert short_need is None  # no flip window here: no short need to confirm a scale-up
    assert pol is policy and state == operator_autoscaler.State()
    assert obs.request_rate == pytest.approx(40.0) and obs.mean_output_tokens == pytest.approx(50.0)
    assert (pv.current, dv.current, dv.ready) == (1, 1, 1)
    assert d.decode.desired == 3 and d.prefill.reason == "CapacityUnknown"  # never saturated, no capacity
    assert sup.log == ["+decode-1", "+decode-2"]
    assert any("decode 1->3 (ScaleUp" in e for e in events)
    assert scaler.state == d.state  # the state is carried to the next decision, as the operator does


def test_an_unknown_capacity_holds_the_pool_like_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    # Heavy traffic but no capacity configured and no saturated window: the operator holds (CapacityUnknown);
    # the old local rules scaled from client-side TTFT/TPOT instead.
    sup, cluster, scaler, calls = _setup(monkeypatch, Policy(bounds=Bounds(1, 3, 1, 3)))
    cluster.rate = 200.0
    events = _run(cluster, scaler, 31.5)
    assert len(calls) == 2 and all(d.reason == "CapacityUnknown" for _, d in calls)
    assert sup.log == [] and sum("CapacityUnknown" in e for e in events) == 1  # said once, not every tick
    # a decode queue that never empties for a whole window teaches the decode capacity: then it scales
    cluster.waiting = 5.0
    _run(cluster, scaler, 15)
    assert calls[-1][1].decode.capacity_source == "unknown"  # the window began with an empty queue
    _run(cluster, scaler, 15)
    assert calls[-1][1].decode.capacity_source == "learned" and "+decode-1" in sup.log


def test_scale_down_waits_for_the_stabilization_window(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = Policy(bounds=Bounds(1, 3, 1, 3), stabilization_seconds=60, decode_capacity=1000.0,
                    prefill_capacity=10_000.0)
    sup, cluster, scaler, calls = _setup(monkeypatch, policy)
    cluster.rate = 40.0
    _run(cluster, scaler, 16.5)
    assert sup.log == ["+decode-1", "+decode-2"]
    cluster.rate = 1.0  # D = ceil(1.5 * 1 * 50 / 1000) = 1
    _run(cluster, scaler, 45)
    assert [d.reason for _, d in calls[1:]] == ["Stabilizing"] * 3 and sup.log[2:] == []
    _run(cluster, scaler, 30)
    assert calls[-1][1].reason == "ScaleDown" and sup.log[2:] == ["-decode-2"]  # one step at a time


def flip_rig(monkeypatch: pytest.MonkeyPatch, url: str, secret: bytes, *, flip_window: float
             ) -> tuple[FakeSup, FakeCluster, Autoscaler]:
    """Two prefill workers (prefill-1 a real one at `url`, which can flip) and one decode worker running, the
    metrics simulated on a fake clock, `/internal/role` real."""
    workers = {**WORKERS, "prefill-1": ("prefill", url)}
    policy = Policy(bounds=Bounds(1, 3, 1, 3), decode_capacity=1000.0, prefill_capacity=10_000.0)
    sup = FakeSup({n: FakeProc(True, object() if n in ("prefill-0", "prefill-1", "decode-0") else None)
                   for n in workers})
    cluster = FakeCluster(sup, workers)
    monkeypatch.setattr(autoscale.httpx, "get", cluster.get)  # the metrics are simulated; /internal/role is not
    monkeypatch.setattr(autoscale.time, "monotonic", lambda: cluster.t)
    return sup, cluster, Autoscaler(ROUTER, sup, workers, policy, interval=15, flip_window=flip_window, secret=secret)


def test_up_autoscale_flips_a_worker_of_the_pool_with_slack(monkeypatch: pytest.MonkeyPatch,
                                                           tiny_model_dir: Any) -> None:
    """Decode must grow by 2 while prefill runs 2 and needs 1: one prefill worker (a real one, tiny model) is
    flipped to decode (no process started or stopped for it), one decode worker is started for the rest."""
    from .harness import SECRET, make_worker, serve

    app, _ = make_worker(tiny_model_dir, "prefill")
    with serve(app) as url:
        sup, cluster, scaler = flip_rig(monkeypatch, url, SECRET, flip_window=0)
        cluster.rate = 40.0  # decode: ceil(1.5 x 40 x 50 / 1000) = 3; prefill: ceil(1.5 x 40 x 100 / 10 000) = 1
        events = _run(cluster, scaler, 16.5)
        assert any("flipped prefill-1: prefill -> decode" in e for e in events), events
        assert sup.log == ["+decode-1"]  # 1 -> 3: one by the flip, one started
        assert scaler.workers["prefill-1"] == ("decode", url)
        with httpx.Client() as h:
            assert h.get(f"{url}/health").json()["role"] == "decode"  # the same process, now decode
        assert any("RoleFlip" in e for e in events)


def test_observation_reads_o_by_completion_from_the_routers_histogram() -> None:
    """The flip window's O: the mean length of the requests that finished between the scrapes (the router's
    pdcluster_request_generation_tokens sum / count), beside tokens generated per request admitted."""
    fin = {"pdcluster_request_generation_tokens_count": 10, "pdcluster_request_generation_tokens_sum": 4_000}
    first = Scrape(0.0, {**_router(100, 10_000, 2_000), **fin})
    last = Scrape(10.0, {**_router(140, 14_000, 20_000), "pdcluster_request_generation_tokens_count": 30,
                         "pdcluster_request_generation_tokens_sum": 22_000})
    obs = observation(first, last, {})
    assert obs is not None and obs.mean_output_tokens == 18_000 / 40 and obs.finished_output_tokens == 18_000 / 20
    assert observation(first, Scrape(10.0, {**_router(140, 14_000, 20_000), **fin}), {}).finished_output_tokens is None


def test_observation_reads_the_prompt_length_scv_from_the_routers_histogram() -> None:
    """The prefill tail need's SCV (autoscaler_tail.histogram_scv) from the increases of the router's real
    pdcluster_request_prompt_tokens buckets between the window's scrapes (the prompts finished before it left out)."""
    from pdcluster.operator.autoscaler_tail import histogram_scv
    from pdcluster.worker.api.metrics import WorkerMetrics

    m = WorkerMetrics("router", process=False)
    for _ in range(50):
        m.request_finished("stop", 40_000, 10)  # before the window: not counted
    before = counters(m.render().decode())
    for n in [800] * 16 + [40_000] * 4:
        m.request_finished("stop", n, 10)
    after = counters(m.render().decode())
    obs = observation(Scrape(0.0, {**_router(100, 1, 1), **before}), Scrape(10.0, {**_router(120, 2, 2), **after}), {})
    want = histogram_scv([(512.0, 0.0), (1024.0, 16.0), (32768.0, 16.0), (65536.0, 20.0), (float("inf"), 20.0)])
    assert obs is not None and obs.prompt_length_scv == pytest.approx(want) and want > 2.0
    assert observation(Scrape(0.0, _router(100, 1, 1)), Scrape(10.0, _router(120, 2, 2)), {}).prompt_length_scv is None
