"""The chart against the real API server: server-side dry-run of everything it renders (with each
ci/*-values.yaml), `helm install` (the session fixture), and the ServiceAccount's permissions."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from pdc_e2e import CHART, HELM, OPERATOR_NS, Kube

CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
# kinds whose CRDs (prometheus-operator) a bare cluster does not have: schema-checked by helm only
NO_CRD_HERE = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


@pytest.mark.parametrize("values", CI_VALUES, ids=[p.name for p in CI_VALUES])
def test_rendered_manifests_pass_server_side_dry_run(kube: Kube, values: Path):
    ns = "pdc-dryrun"
    cp = subprocess.run([str(HELM), "template", "pdc", str(CHART), "-n", ns, "-f", str(values), "--include-crds"],
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    docs = [d for d in yaml.safe_load_all(cp.stdout) if d]
    for n in {ns} | {d["metadata"].get("namespace") for d in docs if d["metadata"].get("namespace")}:
        kube.run("create", "namespace", n, check=False)
    # the chart's own CRDs (kopf peering's too) exist before its objects, as `helm install` makes them
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    kube.run("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump_all(crds))
    for c in crds:
        kube.run("wait", "--for=condition=Established", f"crd/{c['metadata']['name']}", "--timeout=30s")
    checked = [d for d in docs if d["kind"] not in NO_CRD_HERE]
    assert {"Deployment", "CustomResourceDefinition"} <= {d["kind"] for d in checked}
    cp = kube.run("apply", "--server-side", "--dry-run=server", "--field-manager=helm-dry-run", "-f", "-",
                  input=yaml.safe_dump_all(checked), check=False)
    assert cp.returncode == 0, f"server-side dry-run rejected the chart ({values.name}):\n{cp.stderr}"
    assert cp.stdout.count("(server dry run)") == len(checked), cp.stdout


def test_helm_install(kube: Kube, helm_release: dict[str, str]):
    sa = kube.get("serviceaccount", helm_release["serviceAccount"], OPERATOR_NS)
    assert sa is not None
    roles = kube.json("get", "clusterrole", "-l", "app.kubernetes.io/instance=pdcluster-operator")["items"]
    # the operator's rules, and (HA: replicaCount 2 by default) kopf peering's
    assert sorted(r["metadata"]["name"] for r in roles) == [helm_release["deployment"],
                                                            helm_release["deployment"] + "-peering"]
    assert all(r["rules"] for r in roles)
    assert kube.json("get", "clusterkopfpeering", helm_release["deployment"])["metadata"]["name"]
    # the Deployment turned Available (kwok runs its pods): `helm --wait` already required it
    dep = kube.get("deployment", helm_release["deployment"], OPERATOR_NS)
    assert dep["status"].get("availableReplicas") == dep["spec"]["replicas"] == 2, dep["status"]
    crd = kube.json("get", "crd", "pdclusters.pdcluster.dev")
    # crds/ are installed as-is, not as release objects (Helm never upgrades or deletes them)
    assert (crd["metadata"].get("annotations") or {}).get("meta.helm.sh/release-name") is None
    cp = subprocess.run([str(HELM), "status", "pdcluster-operator", "-n", OPERATOR_NS, "--kubeconfig",
                         kube.kubeconfig], capture_output=True, text=True, timeout=30)
    assert "STATUS: deployed" in cp.stdout, cp.stdout + cp.stderr


def test_service_account_is_least_privilege(kube: Kube, helm_release: dict[str, str]):
    who = f"system:serviceaccount:{OPERATOR_NS}:{helm_release['serviceAccount']}"

    def can(*args: str) -> bool:
        return kube.run("auth", "can-i", *args, f"--as={who}", check=False).stdout.strip() == "yes"

    assert can("watch", "pdclusters.pdcluster.dev", "--all-namespaces")
    assert can("patch", "pdclusters.pdcluster.dev/status", "-n", "default")
    assert can("create", "deployments.apps", "-n", "default")
    for verb, res in [("delete", "nodes"), ("create", "clusterroles"), ("create", "clusterrolebindings"),
                      ("delete", "customresourcedefinitions"), ("create", "pods/exec"),
                      ("delete", "namespaces"), ("update", "serviceaccounts")]:
        assert not can(verb, res, "--all-namespaces"), f"the operator may {verb} {res}: not least privilege"
