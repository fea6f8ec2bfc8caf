"""E2E fixtures: a real control plane (e2e/cluster.sh), the Helm chart installed into it, and the operator
as a local process authenticated as the chart's ServiceAccount (so a missing RBAC rule fails the suite).

Environment:
  PDCLUSTER_E2E_KEEP=1     leave the cluster running after the session (otherwise a cluster this session
                           started is stopped; one that was already running is left alone).
  PDCLUSTER_E2E_ARTIFACTS  where operator logs and failure dumps go (default /tmp/pdcluster-e2e).
Every wait is bounded (see `wait_until`); on a failed test the operator log tail, the namespace's events and
`kubectl describe pdc` are printed and saved under the artifacts dir.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
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


def _operator_args() -> list[str]:
    """Flags for `pdcluster operator`: all namespaces, verbose; only those the CLI has."""
    cp = subprocess.run([str(PDCLUSTER), "operator", "--help"], capture_output=True, text=True, timeout=60)
    helptext = cp.stdout
    args = []
    if "--all-namespaces" in helptext:
        args.append("--all-namespaces")
    if "--standalone" in helptext:
        args.append("--standalone")
    if "--verbose" in helptext:
        args.append("--verbose")
    return args


# ------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def cluster() -> Iterator[str]:
    """The admin kubeconfig of a running e2e cluster (started here if it was not running)."""
    if not (ROOT / "operator" / "cli.py").exists():
        pytest.skip("the operator (operator/cli.py) is not written yet")
    status = subprocess.run([str(E2E / "cluster.sh"), "status"], capture_output=True, text=True)
    was_running = status.returncode == 0
    t0 = time.monotonic()
    cp = subprocess.run([str(E2E / "cluster.sh"), "up"], capture_output=True, text=True, timeout=5400)
    if cp.returncode != 0:
        pytest.fail(f"e2e/cluster.sh up failed:\n{cp.stderr[-6000:]}\n{cp.stdout[-2000:]}")
    last = cp.stdout.strip().splitlines()[-1]
    assert last.startswith("export KUBECONFIG="), f"cluster.sh up's last line is {last!r}"
    kubeconfig = last.split("=", 1)[1]
    print(f"\ncluster ready in {time.monotonic() - t0:.1f}s ({'reused' if was_running else 'started'})")
    yield kubeconfig
    if not was_running and not os.environ.get("PDCLUSTER_E2E_KEEP"):
        subprocess.run([str(E2E / "cluster.sh"), "down"], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="session")
def kube(cluster: str) -> Kube:
    return Kube(cluster)


@pytest.fixture(scope="session")
def helm_release(kube: Kube) -> dict[str, str]:
    """The chart installed (helm upgrade --install --wait): CRD, ServiceAccount, ClusterRole/Binding,
    operator Deployment (its pod is a kwok pod: it turns Ready but runs nothing; the real operator
    process is the `operator` fixture) and metrics Service."""
    cp = subprocess.run(
        [str(HELM), "upgrade", "--install", RELEASE, str(CHART), "--namespace", OPERATOR_NS,
         "--create-namespace", "--wait", "--timeout", "120s", "--kubeconfig", kube.kubeconfig],
        capture_output=True, text=True, timeout=180)
    assert cp.returncode == 0, f"helm install failed:\n{cp.stderr}\n{cp.stdout}"
    wait_until("the PDCluster CRD to be Established", lambda: kube.run(
        "wait", "--for=condition=Established", "crd/pdclusters.pdcluster.dev", "--timeout=5s",
        check=False).returncode == 0, timeout=60)
    dep = kube.json("get", "deployment", "-n", OPERATOR_NS, "-l", f"app.kubernetes.io/instance={RELEASE}")
    (d,) = dep["items"]
    return {"serviceAccount": d["spec"]["template"]["spec"]["serviceAccountName"], "namespace": OPERATOR_NS,
            "deployment": d["metadata"]["name"]}


@pytest.fixture(scope="session")
def operator_kubeconfig(kube: Kube, helm_release: dict[str, str], artifacts: Path) -> str:
    """A kubeconfig with a token of the chart's ServiceAccount (kubectl create token)."""
    token = kube.run("create", "token", helm_release["serviceAccount"], "-n", helm_release["namespace"],
                     "--duration=4h").stdout.strip()
    admin = yaml.safe_load(Path(kube.kubeconfig).read_text())
    cfg = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": admin["clusters"],
        "users": [{"name": "operator-sa", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": admin["clusters"][0]["name"],
                                                       "user": "operator-sa"}}],
        "current-context": "operator",
    }
    path = artifacts / "operator.kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    path.chmod(0o600)
    who = Kube(str(path)).run("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}").stdout
    assert who == f"system:serviceaccount:{helm_release['namespace']}:{helm_release['serviceAccount']}", who
    return str(path)


@pytest.fixture(scope="session")
def operator(operator_kubeconfig: str, artifacts: Path) -> Iterator[Operator]:
    log_dir = artifacts / "operator"
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in log_dir.glob("operator-*.log"):
        old.unlink()
    op = Operator(operator_kubeconfig, log_dir)
    op.start()
    yield op
    op.stop()
    forbidden = [ln for ln in op.all_logs().splitlines() if " 403" in ln or "Forbidden" in ln
                 or "forbidden" in ln]
    if forbidden:
        print("\nRBAC denials in the operator log:\n" + "\n".join(forbidden[:20]))


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without waiting)."""
    name = f"e2e-{request.node.name.replace('_', '-')[:40].strip('-').lower()}-{uuid.uuid4().hex[:5]}"
    name = "".join(c if c.isalnum() or c == "-" else "-" for c in name)
    kube.run("create", "namespace", name)
    # pods need the namespace's default ServiceAccount (made by kube-controller-manager)
    wait_until(f"serviceaccount default in {name}",
               lambda: kube.get("serviceaccount", "default", name), timeout=30)
    yield name
    kube.run("delete", "namespace", name, "--wait=false", check=False)


def example_pdc(name: str, **spec_overrides: Any) -> dict[str, Any]:
    """examples/pdcluster-cpu.yaml with a new name and spec overrides (deep-merged)."""
    path = ROOT / "examples" / "pdcluster-cpu.yaml"
    if not path.exists():
        pytest.skip("examples/pdcluster-cpu.yaml is not written yet")
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


@pytest.fixture
def diag(kube: Kube, operator: Operator, artifacts: Path, request: pytest.FixtureRequest
         ) -> Iterator[list[str]]:
    """Register namespaces to dump on failure: operator log, events, describe pdc, children."""
    namespaces: list[str] = []
    yield namespaces
    rep = getattr(request.node, "rep_call", None)
    if rep is None or not rep.failed:
        return
    parts = [f"==== operator log (tail) ====\n{operator.tail(200)}"]
    for ns in namespaces:
        for title, args in [
            ("events", ["get", "events", "-n", ns, "--sort-by=.lastTimestamp"]),
            ("describe pdc", ["describe", "pdc", "-n", ns]),
            ("pdc yaml", ["get", "pdc", "-n", ns, "-o", "yaml"]),
            ("children", ["get", "deploy,svc,cm,secret,pods,pdb,networkpolicy", "-n", ns, "-o", "wide"]),
        ]:
            cp = kube.run(*args, check=False)
            parts.append(f"==== {title} ({ns}) ====\n{cp.stdout}{cp.stderr}")
    text = "\n".join(parts)
    path = artifacts / f"failure-{request.node.name}.txt"
    path.write_text(text)
    print(f"\n{text[-20000:]}\n(saved to {path})")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep
