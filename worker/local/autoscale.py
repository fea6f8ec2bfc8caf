"""`pdcluster up --autoscale`: resize the local pools from the router's own counters with the operator's
planner — the same decision the Kubernetes autoscaler makes from Prometheus, on a laptop."""

from __future__ import annotations

import time
from typing import Any

import httpx

from pdcluster.worker.local.demo import plan_pd
from pdcluster.worker.local.supervisor import Supervisor


def counters(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        out[name.split("{", 1)[0]] = out.get(name.split("{", 1)[0], 0.0) + float(value)
    return out


class Autoscaler:
    """Every `interval` s: rate and mean lengths from the router's counters; capacities learned from the
    workers' own TTFT/TPOT sums (tokens per busy second); scale up at once, down after 3 agreeing ticks."""

    def __init__(self, router: str, sup: Supervisor, max_workers: int, interval: float = 15.0) -> None:
        self.router, self.sup, self.max_workers, self.interval = router, sup, max_workers, interval
        self.last: tuple[float, dict[str, float]] | None = None
        self.next_at = time.monotonic() + interval
        self.down_votes = 0

    def _running(self, role: str) -> int:
        return sum(1 for n, p in self.sup.procs.items() if n.startswith(role) and p.enabled and p.popen is not None)

    def tick(self) -> list[str]:
        if time.monotonic() < self.next_at:
            return []
        self.next_at = time.monotonic() + self.interval
        try:
            now = (time.monotonic(), counters(httpx.get(f"{self.router}/metrics", timeout=2).text))
        except httpx.HTTPError:
            return []
        prev, self.last = self.last, now
        if prev is None:
            return []
        dt = now[0] - prev[0]
        d: dict[str, Any] = {k: now[1].get(k, 0.0) - prev[1].get(k, 0.0) for k in now[1]}
        n = d.get("pdcluster_requests_total", 0.0)
        if n <= 0 or dt <= 0:
            return []
        mean_in = d.get("pdcluster_prompt_tokens_total", 0.0) / n
        mean_out = max(1.0, d.get("pdcluster_generation_tokens_total", 0.0) / n)
        # capacity: inverse of the client-visible per-token times (conservative: includes queueing)
        ttft = d.get("pdcluster_time_to_first_token_seconds_sum", 0.0) / max(1.0, d.get(
            "pdcluster_time_to_first_token_seconds_count", 0.0))
        tpot = d.get("pdcluster_time_per_output_token_seconds_sum", 0.0) / max(1.0, d.get(
            "pdcluster_time_per_output_token_seconds_count", 0.0))
        if ttft <= 0 or tpot <= 0 or mean_in <= 0:
            return []
        pd = plan_pd(mean_in, mean_out, mean_in / ttft, 8.0 / tpot, n / dt)
        want = {"prefill": min(self.max_workers, max(1, pd["prefill"])),
                "decode": min(self.max_workers, max(1, pd["decode"]))}
        events = []
        shrink = any(want[r] < self._running(r) for r in want)
        self.down_votes = self.down_votes + 1 if shrink else 0
        for role, target in want.items():
            have = self._running(role)
            names = sorted(n for n in self.sup.procs if n.startswith(role))
            if target > have:
                for name in [n for n in names if not self.sup.procs[n].enabled or self.sup.procs[n].popen is None][
                        : target - have]:
                    self.sup.enable(name)
                    events.append(f"autoscale: started {name} ({role} {have} -> {target})")
            elif target < have and self.down_votes >= 3:
                for name in [n for n in reversed(names) if self.sup.procs[n].enabled
                             and self.sup.procs[n].popen is not None][: have - target]:
                    self.sup.disable(name)
                    events.append(f"autoscale: stopped {name} ({role} {have} -> {target})")
        return events
