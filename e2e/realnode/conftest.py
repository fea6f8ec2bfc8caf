"""Fixtures of the real-node scenarios: the node (Ready, routes checked), the chart installed with its
operator running as a real pod on that node, and one namespace holding examples/pdcluster-cpu.yaml.

Run as their own session (`pytest e2e/realnode`, `make e2e` does): the kwok suite runs the operator as a
local process watching every namespace, which would reconcile these PDClusters a second time.
Scenario files share one PDCluster and run in file order (10 operator, 11 apply, 12 completion, 13 scale
and container kill, 14 autoscaler fed by Prometheus, 14b role flip,
and 15 delete); 16 serves a hostpath:// model of its own, 17 one `engine: vllm` PDCluster
(pdcluster/worker-vllm) for its three scenarios."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # test modules import node_e2e

from node_e2e import NODE_NAME, assert_routes, create_pinned_namespace  # noqa: E402
from pdc_e2e import CHART, EXAMPLE, HELM, Kube, wait_until  # noqa: E402

OPERATOR_NS = "pdc-real-system"
RELEASE = "pdc-real"
KEEP = bool(os.environ.get("PDCLUSTER_E2E_KEEP"))


@pytest.fixture(scope="session")
def real_node(kube: Kube) -> str:
    node = kube.get("node", NODE_NAME, "")
    if node is None:
        pytest.fail(f"no real node {NODE_NAME}: the cluster runs kwok nodes only (PDCLUSTER_REAL_NODE=0, not "
                    "root, or e2e/node-deps.sh not run); see docs/e2e.md")
    wait_until(f"node {NODE_NAME} Ready", lambda: any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (kube.get("node", NODE_NAME, "") or {}).get("status", {}).get("conditions", [])), timeout=120)
    assert_routes()  # before any traffic to a pod or service address
    # A kept cluster (PDCLUSTER_E2E_KEEP, or a second run soon after the first) still holds the last run's
    # pods while their namespaces terminate (grace period: the request timeout + 30 s): their CPU requests
    # would leave this run's second decode pod Pending (Insufficient cpu) on a 2-CPU node.
    earlier = _earlier_pods(kube)
    if earlier:
        print(f"waiting for {len(earlier)} pods of earlier runs' terminating namespaces to leave {NODE_NAME}: "
              f"{earlier[:6]}")
        wait_until("earlier runs' pods gone from the node", lambda: not _earlier_pods(kube), timeout=300, interval=3)
    return NODE_NAME


def _earlier_pods(kube: Kube) -> list[str]:
    """Pods on the real node whose namespace is being deleted."""
    terminating = {n["metadata"]["name"] for n in kube.json("get", "namespaces")["items"]
                   if (n.get("status") or {}).get("phase") == "Terminating"}
    if not terminating:
        return []
    on_node = kube.json("get", "pods", "-A", "--field-selector", f"spec.nodeName={NODE_NAME}")["items"]
    return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in on_node
            if p["metadata"]["namespace"] in terminating]


@pytest.fixture(scope="session")
def real_operator(kube: Kube, real_node: str) -> Iterator[dict[str, Any]]:
    """`helm install` of the chart with its defaults (image pdcluster/operator:<appVersion>, IfNotPresent)."""
    if kube.get("namespace", OPERATOR_NS, "") is None:
        create_pinned_namespace(kube, OPERATOR_NS)
    extra = []
    if os.environ.get("PDCLUSTER_E2E_CRD"):  # another CRD than the chart's (debugging only, as in e2e/)
        kube.run("apply", "--server-side", "--force-conflicts", "-f", os.environ["PDCLUSTER_E2E_CRD"])
        for other in sorted((CHART / "crds").glob("*.yaml")):  # the chart's other CRDs, as they are
            if other.name != "pdcluster.yaml":
                kube.run("apply", "--server-side", "--force-conflicts", "-f", str(other))
        extra = ["--skip-crds"]
    cp = subprocess.run([str(HELM), "upgrade", "--install", RELEASE, str(CHART), "--namespace", OPERATOR_NS,
                         "--wait", "--timeout", "300s", "--kubeconfig", kube.kubeconfig, *extra],
                        capture_output=True, text=True, timeout=360)
    if cp.returncode != 0:
        dump = kube.run("get", "pods,events", "-n", OPERATOR_NS, "-o", "wide", check=False).stdout
        pytest.fail(f"helm install failed:\n{cp.stderr}\n{cp.stdout}\n{dump}")
    (dep,) = kube.json("get", "deployment", "-n", OPERATOR_NS, "-l",
                       f"app.kubernetes.io/instance={RELEASE}")["items"]
    yield {"namespace": OPERATOR_NS, "deployment": dep["metadata"]["name"],
           "selector": ",".join(f"{k}={v}" for k, v in dep["spec"]["selector"]["matchLabels"].items())}
    if not KEEP:
        subprocess.run([str(HELM), "uninstall", RELEASE, "--namespace", OPERATOR_NS, "--wait",
                        "--kubeconfig", kube.kubeconfig], capture_output=True, text=True, timeout=180)
        kube.run("delete", "namespace", OPERATOR_NS, "--wait=false", check=False)


@pytest.fixture(scope="session")
def app_ns(kube: Kube, real_node: str) -> Iterator[str]:
    name = f"real-{uuid.uuid4().hex[:6]}"
    create_pinned_namespace(kube, name)
    yield name
    if not KEEP:
        kube.run("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def example_name() -> str:
    return str(yaml.safe_load(Path(EXAMPLE).read_text())["metadata"]["name"])
