"""Helpers of the e2e suite (fixtures are in conftest.py): pinned tool paths, kubectl wrapper, the
local operator process, bounded waits, PDCluster helpers."""


from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
E2E = ROOT / "e2e"
CHART = ROOT / "helm" / "pdcluster-operator"
ARTIFACTS = Path(os.environ.get("PDCLUSTER_E2E_ARTIFACTS", "/tmp/pdcluster-e2e"))
OPERATOR_NS = "pdcluster-system"
RELEASE = "pdcluster-operator"


def _versions() -> dict[str, str]:
    out = {}
    for line in (E2E / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k] = v
    return out


VERSIONS = _versions()
CACHE = Path(os.environ.get("PDCLUSTER_CACHE", Path.home() / ".cache" / "pdcluster"))
KUBECTL = CACHE / "bin" / f"kubectl-{VERSIONS['K8S_VERSION']}"
HELM = CACHE / "bin" / f"helm-{VERSIONS['HELM_VERSION']}"
PDCLUSTER = Path(sys.executable).parent / "pdcluster"
# the CPU example the scenarios start from (override only to try the suite before examples/ exists)
EXAMPLE = Path(os.environ.get("PDCLUSTER_E2E_EXAMPLE", ROOT / "examples" / "pdcluster-cpu.yaml"))


def wait_until(what: str, fn: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    """Poll fn until it returns something truthy; fail after `timeout` seconds with the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = fn()
        except Exception as e:  # noqa: BLE001 - keep polling through transient errors
            last = e
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


class Kube:
    """kubectl (the pinned build) against the e2e cluster."""

    def __init__(self, kubeconfig: str) -> None:
        self.kubeconfig = kubeconfig
        self.env = {**os.environ, "KUBECONFIG": kubeconfig}

    def run(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
            ) -> subprocess.CompletedProcess[str]:
        cp = subprocess.run([str(KUBECTL), *args], input=input, capture_output=True, text=True,
                            env=self.env, timeout=timeout)
        if check and cp.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({cp.returncode}):\n{cp.stderr}{cp.stdout}")
        return cp

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json").stdout)

    def get(self, kind: str, name: str, ns: str) -> dict[str, Any] | None:
        cp = self.run("get", kind, name, "-n", ns, "-o", "json", check=False)
        if cp.returncode != 0:
            if "NotFound" in cp.stderr:
                return None
            raise AssertionError(cp.stderr)
        return json.loads(cp.stdout)

    def apply(self, obj: dict[str, Any] | str, ns: str | None = None, check: bool = True,
              server_side: bool = True) -> subprocess.CompletedProcess[str]:
        text = obj if isinstance(obj, str) else yaml.safe_dump(obj)
        args = ["apply", "-f", "-"]
        if server_side:
            args += ["--server-side", "--field-manager=e2e-user"]
        if ns:
            args += ["-n", ns]
        return self.run(*args, input=text, check=check)


class Operator:
    """`pdcluster operator` as a local process with the chart ServiceAccount's credentials."""

    def __init__(self, kubeconfig: str, log_dir: Path) -> None:
        self.kubeconfig = kubeconfig
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"operator-{self.starts}.log"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "operator already running"
        self.starts += 1
        env = {**os.environ, "KUBECONFIG": self.kubeconfig, "PYTHONUNBUFFERED": "1"}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([str(PDCLUSTER), "operator", *_operator_args()], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, cwd=str(self.log_dir),
                                     start_new_session=True)
        # kopf is ready once it has listed the PDClusters; give it a moment and fail fast if it died
        time.sleep(2.0)
        if self.proc.poll() is not None:
            pytest.fail(f"operator exited with {self.proc.returncode} at startup:\n{self.tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if getattr(self, "_log", None):
            self._log.close()

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 120) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no operator log)"

    def all_logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob("operator-*.log")))


RESYNC_SECONDS = 5.0


def _free_port() -> int:
    return _free_port_block(1)


def _free_port_block(n: int) -> int:
    """A base port P with P..P+n-1 free on 127.0.0.1, below the kernel's ephemeral range (32768+), so that
    no outgoing connection or port-0 listener of another process takes one of them in the meantime."""
    import random
    import socket

    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no block of {n} free ports in 20000-32000")


def _operator_args() -> list[str]:
    """`pdcluster operator` flags for the e2e run: all namespaces, a short resync (drift correction and
    the autoscaler interval are bounded by it), metrics and liveness on free loopback ports."""
    return ["--resync-seconds", str(RESYNC_SECONDS), "--metrics-port", str(_free_port()),
            "--liveness", f"http://127.0.0.1:{_free_port()}/healthz", "--verbose"]


def example_pdc(name: str, **spec_overrides: Any) -> dict[str, Any]:
    """examples/pdcluster-cpu.yaml with a new name and spec overrides (deep-merged)."""
    path = EXAMPLE
    doc = yaml.safe_load(path.read_text())
    doc["metadata"] = {"name": name}
    _merge(doc["spec"], spec_overrides)
    return doc


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


# ------------------------------------------------------------------------------------------- helpers

ROLES = ("prefill", "decode", "router")


def condition(pdc: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for c in ((pdc or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return None


def deployments(kube: Kube, ns: str, name: str) -> dict[str, dict[str, Any]]:
    """The PDCluster's Deployments by role (from the pdcluster.dev/role label)."""
    items = kube.json("get", "deployments", "-n", ns, "-l", f"app.kubernetes.io/instance={name}")["items"]
    out: dict[str, dict[str, Any]] = {}
    for d in items:
        role = d["metadata"]["labels"].get("pdcluster.dev/role", d["metadata"]["name"])
        assert role not in out, f"two Deployments for role {role}: {out[role]['metadata']['name']}, " \
                                f"{d['metadata']['name']}"
        out[role] = d
    return out


def rollout_done(d: dict[str, Any]) -> bool:
    st, spec = d.get("status") or {}, d["spec"]
    want = spec.get("replicas", 1)
    return (st.get("observedGeneration", 0) >= d["metadata"]["generation"]
            and st.get("updatedReplicas", 0) == want and st.get("readyReplicas", 0) == want
            and st.get("replicas", 0) == want)


def wait_ready(kube: Kube, ns: str, name: str, timeout: float = 90) -> dict[str, Any]:
    """Wait until the PDCluster is Ready=True for its current generation and every child rolled out."""
    def ok() -> dict[str, Any] | None:
        pdc = kube.get("pdc", name, ns)
        if not pdc:
            return None
        st = pdc.get("status") or {}
        ready = condition(pdc, "Ready")
        if not ready or ready.get("status") != "True":
            return None
        if st.get("observedGeneration") != pdc["metadata"]["generation"]:
            return None
        deps = deployments(kube, ns, name)
        if set(deps) != set(ROLES) or not all(rollout_done(d) for d in deps.values()):
            return None
        return pdc
    return wait_until(f"PDCluster {ns}/{name} Ready with every Deployment rolled out", ok, timeout)


def apply_pdc(kube: Kube, ns: str, doc: dict[str, Any]) -> None:
    kube.apply(doc, ns=ns)
