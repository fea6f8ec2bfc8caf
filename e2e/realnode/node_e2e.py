"""Helpers of the real-node scenarios (e2e/realnode): the node's names and paths, the route check that
guards every request to a pod address, a namespace pinned to the real node, `kubectl port-forward` and a
local `pdcluster serve` to compare answers with."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdc_e2e import CACHE, E2E, KUBECTL, PDCLUSTER, Kube, wait_until

NODE_NAME = os.environ.get("PDCLUSTER_NODE_NAME", "pdc-node-0")
CLUSTER_DIR = Path(os.environ.get("PDCLUSTER_CLUSTER_DIR", CACHE / "cluster"))
CONTAINERD_SOCK = CLUSTER_DIR / "node" / "containerd.sock"
TAINT_KEY = "pdcluster.dev/real-node"
SERVICE_CIDR = f"{os.environ.get('PDCLUSTER_NODE_NET', '10.213')}.128.0/20"  # as e2e/cluster.sh gives it
# Namespace annotations (PodNodeSelector and PodTolerationRestriction admission, enabled by cluster.sh):
# every pod of the namespace lands on the real node, without touching the chart or the example.
PINNED_ANNOTATIONS = {
    "scheduler.alpha.kubernetes.io/node-selector": "pdcluster.dev/node=real",
    "scheduler.alpha.kubernetes.io/defaultTolerations": json.dumps(
        [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]),
}


def assert_routes() -> None:
    """Stop unless every pod/service address of the node routes through its bridge (hard network rule)."""
    cp = subprocess.run([str(E2E / "cluster.sh"), "routes"], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0, f"pod/service routes do not stay on the node's bridge:\n{cp.stderr}{cp.stdout}"


def assert_route_to(ip: str) -> None:
    """This one address routes via the node's bridge (a pod IP the test is about to contact)."""
    out = subprocess.run(["ip", "-4", "route", "get", ip], capture_output=True, text=True, check=True).stdout
    bridge = os.environ.get("PDCLUSTER_NODE_BRIDGE", "pdc0")
    assert f" dev {bridge} " in out + " ", f"route to {ip} is not via {bridge}: {out!r}"


def create_pinned_namespace(kube: Kube, name: str) -> None:
    kube.run("create", "namespace", name)
    kube.run("annotate", "namespace", name, *[f"{k}={v}" for k, v in PINNED_ANNOTATIONS.items()])
    wait_until(f"serviceaccount default in {name}", lambda: kube.get("serviceaccount", "default", name),
               timeout=30)


def ctr(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ctr", "--address", str(CONTAINERD_SOCK), "-n", "k8s.io", *args],
                          capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> Any:
    assert url.startswith(("http://127.0.0.1:", "http://10.")), url  # loopback or the node's bridge only
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def http_text(url: str, timeout: float = 30) -> str:
    assert url.startswith(("http://127.0.0.1:", "http://10.")), url
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


@contextlib.contextmanager
def port_forward(kube: Kube, ns: str, target: str, remote: int) -> Iterator[int]:
    """`kubectl port-forward` (API server -> kubelet -> the pod's netns) to a loopback port."""
    port = free_port()
    # Its output goes to a file, never an unread pipe: kubectl prints a line per connection, and a scenario
    # of ~2,000 requests fills a 64 KiB pipe, after which kubectl blocks on the write and every request
    # through the forward hangs (test_14 timed out on exactly that).
    CLUSTER_DIR.mkdir(parents=True, exist_ok=True)
    log_path = CLUSTER_DIR / f"port-forward-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(KUBECTL), "--kubeconfig", kube.kubeconfig, "-n", ns, "port-forward",
                                 "--address", "127.0.0.1", target, f"{port}:{remote}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(f"port-forward to {target} (log {log_path})", lambda: _health(port), timeout=60)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            lines = log_path.read_text(errors="replace").splitlines()
            errors = [ln for ln in lines if not ln.startswith(("Forwarding from", "Handling connection"))]
            if errors:  # what kubectl said besides its per-connection lines (lost connections, resets)
                print(f"port-forward {target}: " + " | ".join(errors[-5:]))
            log_path.unlink()


def _health(port: int) -> bool:
    try:
        http_text(f"http://127.0.0.1:{port}/health", timeout=3)
        return True
    except OSError:
        return False


@contextlib.contextmanager
def local_serve(model: Path) -> Iterator[int]:
    """`pdcluster serve` on this machine (loopback) on a model folder: the reference answers."""
    port = free_port()
    log = open(CLUSTER_DIR.parent / "local-serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([str(PDCLUSTER), "serve", "--model", str(model), "--host", "127.0.0.1",
                             "--port", str(port), "--device", "cpu", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until("local pdcluster serve", lambda: proc.poll() is None and _health(port), timeout=180)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def pods(kube: Kube, ns: str, selector: str) -> list[dict[str, Any]]:
    return kube.json("get", "pods", "-n", ns, "-l", selector)["items"]


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of a Prometheus metric (any labels) in an exposition text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def elapsed(t0: float) -> str:
    return f"{time.monotonic() - t0:.1f}s"


def dump(kube: Kube, *namespaces: str) -> str:
    parts = []
    for ns in namespaces:
        for args in (["get", "pdc,deploy,svc,pods", "-o", "wide"], ["get", "events", "--sort-by=.lastTimestamp"],
                     ["describe", "pods"]):
            cp = kube.run(*args, "-n", ns, check=False)
            parts.append(f"==== {' '.join(args)} ({ns}) ====\n{cp.stdout[-6000:]}{cp.stderr[-2000:]}")
        # each pod's own account (the operator's reconcile and peering decisions, a worker's start-up)
        pods = kube.run("get", "pods", "-n", ns, "-o", "name", check=False).stdout.split()
        for pod in pods[:8]:
            cp = kube.run("logs", "-n", ns, pod, "--all-containers", "--tail=60", check=False)
            parts.append(f"==== logs {pod} ({ns}) ====\n{cp.stdout[-5000:]}{cp.stderr[-1000:]}")
    # which operator replica is active: kopf peering keep-alives (priority, lastseen) per replica
    cp = kube.run("get", "clusterkopfpeerings,kopfpeerings", "-A", "-o", "yaml", check=False)
    parts.append(f"==== kopf peerings ====\n{cp.stdout[-4000:]}{cp.stderr[-1000:]}")
    return "\n".join(parts)


class Traffic:
    """One client sending completions (short and long prompts) until stopped: back to back, or one every
    `pause` seconds. Every failure is recorded (the scenarios assert there is none)."""

    def __init__(self, port: int, model: str, pause: float = 0.0) -> None:
        self.port, self.model, self.pause = port, model, pause
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            prompt = "count: " + " ".join(str(n) for n in range(i % 7 * 4 + 2))
            try:
                r = http_json(f"http://127.0.0.1:{self.port}/v1/completions",
                              {"model": self.model, "prompt": prompt, "max_tokens": 6, "temperature": 0},
                              timeout=90)
                assert r["usage"]["completion_tokens"] >= 1, r
                self.ok += 1
            except Exception as e:  # noqa: BLE001 - every failure is recorded and fails the test
                self.failures.append(f"{type(e).__name__}: {e}")
            i += 1
            self._stop.wait(self.pause)

    def __enter__(self) -> Traffic:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=120)
