"""E2E fixtures: a real control plane (e2e/cluster.sh), the Helm chart installed into it, and the operator
as a local process authenticated as the chart's ServiceAccount (so a missing RBAC rule fails the suite).

Environment:
  PDCLUSTER_E2E_KEEP=1     leave the cluster running after the session (otherwise a cluster this session
                           started is stopped; one that was already running is left alone).
  PDCLUSTER_E2E_ARTIFACTS  where operator logs and failure dumps go (default /tmp/pdcluster-e2e).
  PDCLUSTER_E2E_CRD        debugging only: install this CRD file instead of the chart's crds/.
  PDCLUSTER_E2E_EXAMPLE    debugging only: start the scenarios from this PDCluster instead of
                           examples/pdcluster-cpu.yaml.
Every wait is bounded (see `wait_until`); on a failed test the operator log tail, the namespace's events and
`kubectl describe pdc` are printed and saved under the artifacts dir.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # test modules import pdc_e2e

from pdc_e2e import (  # noqa: E402
    ARTIFACTS,
    CHART,
    E2E,
    HELM,
    OPERATOR_NS,
    RELEASE,
    Kube,
    Operator,
    wait_until,
)

# ------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def cluster() -> Iterator[str]:
    """The admin kubeconfig of a running e2e cluster (started here if it was not running)."""
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
    extra = []
    if os.environ.get("PDCLUSTER_E2E_CRD"):  # try a CRD other than the chart's (debugging only)
        kube.run("apply", "--server-side", "--force-conflicts", "-f", os.environ["PDCLUSTER_E2E_CRD"])
        extra = ["--skip-crds"]
    cp = subprocess.run(
        [str(HELM), "upgrade", "--install", RELEASE, str(CHART), "--namespace", OPERATOR_NS,
         "--create-namespace", "--wait", "--timeout", "120s", "--kubeconfig", kube.kubeconfig, *extra],
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




def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """e2e/realnode runs as a session of its own (`pytest e2e/realnode`): the kwok suite's local operator
    watches every namespace and would reconcile the real node's PDClusters beside the operator pod."""
    if collection_path.name == "realnode" and not any("realnode" in str(a) for a in config.args):
        return True
    return None
