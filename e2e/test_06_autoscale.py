"""Scenario 5: the autoscaler reacting to real traffic.

Real workers from `pdcluster up` (router + 1 prefill + 1 decode worker on loopback, the built-in demo model),
a real Prometheus (Debian package; `scripts/setup.sh test` installs it) scraping them with the `pdcluster`
label added, and a PDCluster in the e2e cluster whose `prometheusUrl` points at it. The load generator
(`pdcluster bench`) drives traffic low -> high -> (Prometheus stopped: replicas hold, MetricsAvailable=False)
-> Prometheus back, low: replicas fall only after the stabilization window. The PDCluster's Deployments
are kwok-simulated; the traffic goes to the local workers, which stand in for its pods.

The capacities are given in the spec (small, so that a CPU-sized load is "high") to make the decisions
deterministic; learned capacities are unit-tested in tests/operator.

PDCLUSTER_E2E_SYNTHETIC_WORKERS=1 replaces `pdcluster up` and `pdcluster bench` with three in-process
/metrics endpoints (router, prefill, decode) whose counters grow at the load level the test sets. Everything
else (Prometheus, operator, API server) is real. It exercises the operator's side of the scenario while
the real workers cannot run; it is not the scenario.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pdc_e2e import (
    PDCLUSTER,
    Kube,
    Operator,
    _free_port,
    _free_port_block,
    apply_pdc,
    condition,
    deployments,
    example_pdc,
    wait_until,
)

NAME = "auto"
STABILIZATION = 20
INTERVAL = 5
WINDOW = 10


def _has_up() -> str | None:
    cp = subprocess.run([str(PDCLUSTER), "up", "--help"], capture_output=True, text=True, timeout=120)
    if cp.returncode != 0:
        return f"`pdcluster up` is not available yet: {(cp.stderr or cp.stdout).strip()[-300:]}"
    if not shutil.which("prometheus"):
        return "prometheus is not installed (`bash scripts/setup.sh test` installs the Debian package)"
    return None


SYNTHETIC = bool(os.environ.get("PDCLUSTER_E2E_SYNTHETIC_WORKERS"))
PROMPT_LEN, OUTPUT_LEN = 48, 16


class SyntheticWorkers:
    """Three /metrics endpoints with the contract's series, counters integrating `rate` requests/s."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.rate = 0.0
        self._t = time.monotonic()
        self._requests = 0.0
        self._lock = threading.Lock()
        self.servers = []
        outer = self
        for role in ("router", "prefill", "decode"):
            class Handler(BaseHTTPRequestHandler):
                _role = role

                def do_GET(self) -> None:  # noqa: N802
                    body = outer.render(self._role).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

                def log_message(self, *args: Any) -> None:
                    pass

            srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            self.servers.append(srv)
        self.targets = [f"http://127.0.0.1:{srv.server_address[1]}" for srv in self.servers]

    def set_rate(self, rate: float) -> None:
        with self._lock:
            now = time.monotonic()
            self._requests += self.rate * (now - self._t)
            self._t, self.rate = now, rate

    def render(self, role: str) -> str:
        with self._lock:
            n = self._requests + self.rate * (time.monotonic() - self._t)
        waiting = 1 if self.rate > 0 else 0
        lines = [f'pdcluster_requests_total{{role="{role}"}} {n:.3f}',
                 f'pdcluster_requests_waiting{{role="{role}"}} {waiting}']
        if role in ("router", "prefill"):
            lines.append(f'pdcluster_prompt_tokens_total{{role="{role}"}} {n * PROMPT_LEN:.3f}')
        if role in ("router", "decode"):
            lines.append(f'pdcluster_generation_tokens_total{{role="{role}"}} {n * OUTPUT_LEN:.3f}')
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        for srv in self.servers:
            srv.shutdown()


@pytest.fixture(scope="module")
def workers(artifacts: Path) -> Iterator[dict[str, Any]]:
    if SYNTHETIC:
        if not shutil.which("prometheus") and not os.environ.get("CI"):
            pytest.skip("prometheus is not installed (`bash scripts/setup.sh test` installs the Debian package)")
        syn = SyntheticWorkers()
        yield {"url": None, "targets": syn.targets, "model": None, "synthetic": syn}
        syn.close()
        return
    why = _has_up()
    if why:
        # `make e2e` installs both; only a hand-run suite on a partial install may skip.
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    port = _free_port_block(3)
    log = open(artifacts / "pdcluster-up.log", "wb")  # noqa: SIM115
    # the router takes `port`, the workers the ports right after it
    proc = subprocess.Popen([str(PDCLUSTER), "up", "--prefill", "1", "--decode", "1", "--port", str(port),
                             "--host", "127.0.0.1", "--threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> dict[str, Any] | None:
            if proc.poll() is not None:
                pytest.fail(f"pdcluster up exited {proc.returncode}: {(artifacts / 'pdcluster-up.log').read_text()[-3000:]}")
            r = httpx.get(f"{url}/cluster", timeout=2)
            if r.status_code != 200:
                return None
            c = r.json()
            if all(w.get("healthy") for w in c["prefill"] + c["decode"]) and c["prefill"] and c["decode"]:
                return c
            return None
        topo = wait_until("pdcluster up: router and workers healthy", healthy, timeout=240, interval=1)
        model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
        yield {"url": url, "targets": [url] + [w["url"] for w in topo["prefill"] + topo["decode"]], "model": model}
    finally:
        _stop_group(proc, 30)
        log.close()


def _stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the process group (pdcluster up's router and workers), SIGKILL after `grace`."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


class Prometheus:
    def __init__(self, targets: list[str], workdir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        hosts = [t.split("://", 1)[1] for t in targets]
        cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{
                "job_name": "pdcluster-local",
                "static_configs": [{"targets": hosts, "labels": {"pdcluster": NAME}}],
            }],
        }
        (workdir / "prometheus.yml").write_text(json.dumps(cfg))  # JSON is YAML

    def start(self) -> None:
        self._log = open(self.workdir / "prometheus.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until("Prometheus ready", lambda: httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200,
                   timeout=60)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if getattr(self, "_log", None):
            self._log.close()


@pytest.fixture(scope="module")
def prometheus(workers: dict[str, Any], artifacts: Path) -> Iterator[Prometheus]:
    workdir = artifacts / "prometheus"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    p = Prometheus(workers["targets"], workdir)
    p.start()
    # every target up
    def up() -> bool:
        r = httpx.get(f"{p.url}/api/v1/query", params={"query": "sum(up)"}, timeout=5).json()
        return bool(r["data"]["result"]) and float(r["data"]["result"][0]["value"][1]) == len(workers["targets"])
    wait_until("Prometheus scraping every worker", up, timeout=30)
    yield p
    p.stop()


class Load:
    """`pdcluster bench` in the background (the project's load generator)."""

    def __init__(self, workers: dict[str, Any], out: Path, *, prompt_len: int, output_len: int, requests: int,
                 concurrency: int):
        self.synthetic = workers.get("synthetic")
        if self.synthetic:
            self.synthetic.set_rate(2.0)
            return
        url = workers["url"]
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "bench.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(PDCLUSTER), "bench", "--url", url, "--prompt-lens", str(prompt_len), "--output-lens",
             str(output_len), "--requests", str(requests), "--concurrency", str(concurrency), "--out", str(out),
             "--no-progress", "--no-plots"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.synthetic:
            self.synthetic.set_rate(0.0)
            return
        _stop_group(self.proc, 20)
        self.log.close()


def _replicas(kube: Kube, ns: str) -> dict[str, int]:
    deps = deployments(kube, ns, NAME)
    return {r: deps[r]["spec"]["replicas"] for r in ("prefill", "decode")}


def test_autoscaler_follows_traffic(kube: Kube, operator: Operator, namespace: str, diag: list[str],
                                    workers: dict[str, Any], prometheus: Prometheus, artifacts: Path):
    diag.append(namespace)
    doc = example_pdc(
        NAME,
        prefill={"minReplicas": 1, "maxReplicas": 4},
        decode={"minReplicas": 1, "maxReplicas": 4},
        autoscaling={
            "enabled": True, "prometheusUrl": prometheus.url, "intervalSeconds": INTERVAL,
            "windowSeconds": WINDOW, "headroom": 1.5, "scaleDownStabilizationSeconds": STABILIZATION,
            "maxScaleUpStep": 4, "maxScaleDownStep": 4,
            "capacity": {"prefillTokensPerSecond": 20, "decodeTokensPerSecond": 8},
        },
    )
    for pool in ("prefill", "decode"):
        doc["spec"][pool].pop("replicas", None)
    apply_pdc(kube, namespace, doc)

    # ---- low: idle -> the minimums, metrics available, decisions recorded in status
    def low_decided() -> dict[str, Any] | None:
        pdc = kube.get("pdc", NAME, namespace)
        mc = condition(pdc, "MetricsAvailable")
        a = (pdc.get("status") or {}).get("autoscaler") or {}
        return pdc if mc and mc["status"] == "True" and a.get("reason") else None
    pdc = wait_until("first autoscaler decision with metrics", low_decided, timeout=60)
    assert _replicas(kube, namespace) == {"prefill": 1, "decode": 1}, pdc["status"]

    # ---- high: concurrent traffic well above the declared capacities -> scale up
    load = Load(workers, artifacts / "bench-high", prompt_len=PROMPT_LEN, output_len=OUTPUT_LEN, requests=100000,
                concurrency=6)
    try:
        up = wait_until("prefill and decode scaled up", lambda: (r := _replicas(kube, namespace))["prefill"] > 1
                        and r["decode"] > 1 and r, timeout=90, interval=1)
        pdc = kube.get("pdc", NAME, namespace)
        auto = pdc["status"]["autoscaler"]
        text = json.dumps(auto)
        for key in ("requestRate", "prefill", "decode"):
            assert key in text, f"status.autoscaler lacks {key}: {auto}"
        events = kube.json("get", "events", "-n", namespace, "--field-selector",
                           f"involvedObject.kind=PDCluster,involvedObject.name={NAME}")["items"]
        assert any(e["reason"] == "Scaled" for e in events), [e["reason"] for e in events]

        # ---- Prometheus stops mid-way: replicas hold, MetricsAvailable=False
        prometheus.stop()
        wait_until("MetricsAvailable=False", lambda: (c := condition(kube.get("pdc", NAME, namespace),
                                                      "MetricsAvailable")) and c["status"] == "False",
                   timeout=4 * INTERVAL + 10)
        held = _replicas(kube, namespace)
        time.sleep(2 * INTERVAL)
        assert _replicas(kube, namespace) == held, "replicas changed while Prometheus was down"
    finally:
        load.stop()
    t_stop = time.monotonic()

    # ---- Prometheus back, traffic low: replicas fall, but only after the stabilization window
    prometheus.start()
    t_low = time.monotonic()
    wait_until("MetricsAvailable=True again", lambda: (c := condition(kube.get("pdc", NAME, namespace),
                                                       "MetricsAvailable")) and c["status"] == "True",
               timeout=4 * INTERVAL + 10)
    before = _replicas(kube, namespace)
    first_drop: float | None = None
    deadline = t_low + WINDOW + STABILIZATION + 6 * INTERVAL + 30
    while time.monotonic() < deadline:
        r = _replicas(kube, namespace)
        if first_drop is None and (r["prefill"] < before["prefill"] or r["decode"] < before["decode"]):
            first_drop = time.monotonic() - t_stop
        if r == {"prefill": 1, "decode": 1}:
            break
        time.sleep(1)
    assert first_drop is not None, f"replicas never fell after the load stopped: {_replicas(kube, namespace)}"
    assert first_drop >= STABILIZATION - 2, (
        f"scaled down {first_drop:.1f}s after the load stopped, before the {STABILIZATION}s stabilization window")
    assert _replicas(kube, namespace) == {"prefill": 1, "decode": 1}
    print(f"\nautoscale: up to {up}, first scale-down {first_drop:.1f}s after the load stopped")
