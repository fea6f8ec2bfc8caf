"""`pdcluster up --autoscale --flip-window S`: the operator's short-window flip step
(`operator/autoscaler_flip_window.py`) between decisions, fed from the same local scrapes as `decide` over a
shorter window. The metrics are faked (tests/disagg/test_autoscale.py's FakeCluster on a fake clock); the flip
goes to a real worker (tiny model) over `POST /internal/role`."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from pdcluster.operator.autoscaler import Policy
from pdcluster.worker.local import autoscale
from pdcluster.worker.local.autoscale import Autoscaler, Scrape, window_observation

from .test_autoscale import ROUTER, WORKERS, FakeProc, FakeSup, _router, _run, flip_rig


def test_the_window_runs_from_the_newest_scrape_a_window_old_with_the_queues_at_its_end() -> None:
    def at(t: float, n: float, waiting: float) -> Scrape:
        return Scrape(t, _router(n, n * 100, n * 10), {"decode-0": ("decode", {"pdcluster_requests_waiting": waiting})})

    scrapes = [at(0.0, 0, 9), at(5.0, 50, 0), at(10.0, 100, 1), at(25.0, 400, 3)]
    obs = window_observation(scrapes, 20.0)  # from t=5 (the newest at least 20 s before t=25) to t=25
    assert obs is not None and obs.request_rate == pytest.approx(350 / 20)
    assert obs.decode_queue_now == 3 and obs.prefill_queue_now is None  # no prefill worker answered
    assert not obs.decode_saturated  # the queue was empty at t=5: the window's samples, not the one at t=0
    assert window_observation(scrapes, 30.0) is None  # the scrapes do not span the window yet
    assert window_observation([], 20.0) is None


@pytest.mark.parametrize("flip_window", [20.0, 0.0], ids=["on", "off"])
def test_the_flip_window_flips_a_worker_between_decisions(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Any,
                                                          flip_window: float) -> None:
    """Prompts give way to long outputs after the first decision: the next flip step's 20 s window (half of it
    the new mix) asks for 2 decode workers, 1 prefill worker; `decide`'s 15 s window has not ended yet. With
    the window on, a running prefill worker (the real one) is flipped to decode before the next decision and no
    process is started or stopped; with 0 nothing changes until that decision."""
    from .harness import SECRET, make_worker, serve

    app, _ = make_worker(tiny_model_dir, "prefill")
    with serve(app) as url:
        sup, cluster, scaler = flip_rig(monkeypatch, url, SECRET, flip_window=flip_window)
        # prefill ceil(1.5 x 40 x 300 / 10 000) = 2, decode ceil(1.5 x 40 x 10 / 1000) = 1: as they run
        cluster.rate, cluster.in_len, cluster.out_len = 40.0, 300.0, 10.0
        events = _run(cluster, scaler, 16.5)  # one decision (t=15), which changes nothing
        assert scaler.last_rec == {"prefill": 2, "decode": 1} and not any("RoleFlip" in e for e in events), events
        cluster.in_len, cluster.out_len = 50.0, 50.0
        # up to t=28.5, before the next decision (t=30): the flip step runs every 5 s (a quarter window), on
        # the 1.5 s ticks at t=21 (4.5 s of the new mix: decode needs less than 1) and t=27 on [7, 27]:
        # I = (9.5 x 300 + 10.5 x 50) / 20 = 169, O = (9.5 x 10 + 10.5 x 50) / 20 = 31 at 40 req/s ->
        # decode needs 40 x 31 / 1000 = 1.24 -> 2 (short by 1), prefill 40 x 169 / 10 000 = 0.68 -> keeps 1
        events = _run(cluster, scaler, 12)
        assert sup.log == []  # flips only: no process started or stopped
        with httpx.Client() as h:
            role = h.get(f"{url}/health").json()["role"]
        if flip_window:
            assert any("prefill 2->1, decode 1->2 (RoleFlipShortWindow: last 20 s" in e for e in events), events
            assert any("flipped prefill-1: prefill -> decode" in e for e in events), events
            assert scaler.workers["prefill-1"] == ("decode", url) and role == "decode"
            assert scaler.state.prefill.last_change == scaler.state.decode.last_change == 27.0
        else:
            assert not any("RoleFlip" in e for e in events), events
            assert scaler.workers["prefill-1"] == ("prefill", url) and role == "prefill"


def test_no_flip_window_without_role_flips(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--no-role-flips` (or a layout that cannot flip) turns the flip window off with the flips."""
    sup = FakeSup({n: FakeProc(True, object()) for n in WORKERS})
    monkeypatch.setattr(autoscale.time, "monotonic", lambda: 0.0)
    assert Autoscaler(ROUTER, sup, WORKERS, Policy(), flip_window=20.0, flips=False).flip_window == 0.0
    assert Autoscaler(ROUTER, sup, WORKERS, Policy(), flip_window=20.0).flip_window == 20.0
