"""The chart features a platform team expects, rendered with the real helm binary: HA through kopf peering
(peering object, its RBAC, PodDisruptionBudget), namespaced RBAC with `watchNamespaces`, the PodMonitor's
relabelling against the labels the operator renders and the autoscaler queries, a packaged chart that
renders with working NOTES, the README generated from values.yaml, and a complete, strict values schema."""

from __future__ import annotations

import json
import re
import shutil
import tarfile
from pathlib import Path

import pytest
import yaml

from pdcluster.operator import models, naming, render
from tests.helm.test_chart import CHART, ROOT, by_kind, helm, needs_helm
from tests.helm.test_chart import render as render_chart

FULL = CHART / "ci" / "full-values.yaml"


def _deployment(docs: list[dict]) -> dict:
    (dep,) = by_kind(docs, "Deployment")
    return dep


def _prom_meta(label: str) -> str:
    """The Prometheus service-discovery name of a pod label."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _operator_rules() -> list[dict]:
    return yaml.safe_load((ROOT / "src" / "pdcluster" / "operator" / "rbac.yaml").read_text())["rules"]


# ------------------------------------------------------------------------------------------------ HA


@needs_helm
def test_default_is_two_replicas_with_kopf_peering_and_a_pdb():
    docs = render_chart()
    dep = _deployment(docs)
    pod = dep["spec"]["template"]["spec"]
    (ctr,) = pod["containers"]
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate",
                                       "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert "--peering=pdc-pdcluster-operator" in ctr["args"]
    assert {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in ctr["env"]
    (peering,) = by_kind(docs, "ClusterKopfPeering")
    assert peering["apiVersion"] == "kopf.dev/v1" and peering["metadata"]["name"] == "pdc-pdcluster-operator"
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["podAffinityTerm"]["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    # the peering object is cluster-scoped: the ServiceAccount may read it and patch its keep-alive in
    (role,) = [r for r in by_kind(docs, "ClusterRole") if r["metadata"]["name"].endswith("-peering")]
    assert role["rules"] == [{"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings"],
                              "verbs": ["list", "watch", "patch"]}]
    # the chart ships the CRD of the object it creates
    crds = list(yaml.safe_load_all((CHART / "crds" / "kopf-peering.yaml").read_text()))
    assert {c["spec"]["names"]["kind"] for c in crds} == {"ClusterKopfPeering", "KopfPeering"}


@needs_helm
def test_one_replica_is_standalone_without_peering_or_pdb():
    docs = render_chart("--set", "replicaCount=1")
    dep = _deployment(docs)
    (ctr,) = dep["spec"]["template"]["spec"]["containers"]
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    assert not [a for a in ctr["args"] if a.startswith("--peering")]
    assert not by_kind(docs, "ClusterKopfPeering") and not by_kind(docs, "PodDisruptionBudget")
    assert [r["metadata"]["name"] for r in by_kind(docs, "ClusterRole")] == ["pdc-pdcluster-operator"]
    assert "affinity" not in dep["spec"]["template"]["spec"]


# -------------------------------------------------------------------------------------- namespaced RBAC


@needs_helm
def test_watch_namespaces_get_roles_not_cluster_roles():
    docs = render_chart("--set", "operator.watchNamespaces={team-a,team-b}")
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]): r for r in by_kind(docs, "Role")}
    assert set(roles) == {(ns, n) for ns in ("team-a", "team-b")
                          for n in ("pdc-pdcluster-operator", "pdc-pdcluster-operator-peering")}
    for ns in ("team-a", "team-b"):
        # exactly operator/rbac.yaml's rules, only in the watched namespaces
        assert roles[(ns, "pdc-pdcluster-operator")]["rules"] == _operator_rules()
        assert roles[(ns, "pdc-pdcluster-operator-peering")]["rules"] == [
            {"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings"], "verbs": ["list", "watch", "patch"]}]
    bindings = {(b["metadata"]["namespace"], b["metadata"]["name"]): b for b in by_kind(docs, "RoleBinding")}
    assert set(bindings) == set(roles)
    for (_ns, name), b in bindings.items():
        assert b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "pdc-pdcluster-operator",
                                  "namespace": "pdc-system"}]
    # kopf peers through a KopfPeering in each watched namespace
    peerings = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in by_kind(docs, "KopfPeering")}
    assert peerings == {("team-a", "pdc-pdcluster-operator"), ("team-b", "pdc-pdcluster-operator")}
    (ctr,) = _deployment(docs)["spec"]["template"]["spec"]["containers"]
    assert [a for a in ctr["args"] if a.startswith("--namespace=")] == ["--namespace=team-a", "--namespace=team-b"]


# ------------------------------------------------------------------------------------------ PodMonitor


@needs_helm
def test_pod_monitor_selects_the_operators_pods_and_relabels_pdcluster_and_role():
    docs = render_chart("--set", "metrics.podMonitor.enabled=true")
    monitors = {pm["metadata"]["name"].rsplit("-", 1)[-1]: pm for pm in by_kind(docs, "PodMonitor")}
    assert set(monitors) == {"workloads", "routers"}
    # the routers every 5 s (the autoscaler's 10 s peak rate and 20 s flip window), the workers every 15 s
    role = {k: pm["spec"]["selector"]["matchExpressions"] for k, pm in monitors.items()}
    assert role == {"routers": [{"key": naming.ROLE_LABEL, "operator": "In", "values": ["router"]}],
                    "workloads": [{"key": naming.ROLE_LABEL, "operator": "NotIn", "values": ["router"]}]}
    assert {k: pm["spec"]["podMetricsEndpoints"][0]["interval"] for k, pm in monitors.items()} == {
        "routers": "5s", "workloads": "15s"}
    pm = monitors["workloads"]
    assert pm["spec"]["selector"]["matchLabels"] == naming.CHILD_LABELS
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert monitors["routers"]["spec"]["podMetricsEndpoints"][0]["relabelings"] == ep["relabelings"]
    relabel = {r["targetLabel"]: r["sourceLabels"] for r in ep["relabelings"]}
    assert relabel == {"pdcluster": [_prom_meta(naming.INSTANCE_LABEL)], "role": [_prom_meta(naming.ROLE_LABEL)]}
    assert ep["honorLabels"] is True and ep["path"] == "/metrics"
    # the pods the operator renders carry those labels and serve /metrics on the named port
    spec = models.parse_spec({"model": {"name": "m", "uri": "/m"}})
    owner = naming.Owner("llama", "ns", "uid")
    for role in ("prefill", "decode", "router"):
        dep = (render.render_router_deployment(owner, spec, "fp") if role == "router"
               else render.render_worker_deployment(owner, spec, role, 1, "fp"))
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert all(labels[k] == v for k, v in pm["spec"]["selector"]["matchLabels"].items())
        assert labels[naming.INSTANCE_LABEL] == "llama" and labels[naming.ROLE_LABEL] == role
        (ctr,) = dep["spec"]["template"]["spec"]["containers"]
        assert ep["port"] in {p["name"] for p in ctr["ports"]}
    # ... and they are the labels the autoscaler and the dashboard query by
    assert 'pdcluster="{cluster}",role="{role}"' in (ROOT / "src" / "pdcluster" / "operator" / "promsource.py").read_text()
    assert "SEL = 'pdcluster=~\"$pdcluster\"'" in (ROOT / "observability" / "build_dashboard.py").read_text()
    namespaced = render_chart("-f", str(FULL))
    for pm in by_kind(namespaced, "PodMonitor"):
        assert pm["spec"]["namespaceSelector"] == {"matchNames": ["inference", "staging"]}
        assert pm["metadata"]["labels"]["release"] == "prometheus"


# ----------------------------------------------------------------------------------- packaged chart, NOTES


def _notes(chart_dir: Path, *args: str) -> str:
    """NOTES as Helm renders them at install (helm template skips NOTES.txt: render its named template
    through a probe ConfigMap added to a copy of the chart)."""
    probe = chart_dir / "templates" / "zz-notes-probe.yaml"
    probe.write_text('apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes-probe\n'
                     'data:\n  notes: {{ include "pdcluster-operator.notes" . | quote }}\n')
    out = helm("template", "pdc", str(chart_dir), "--namespace", "pdc-system", *args,
               "--show-only", "templates/zz-notes-probe.yaml").stdout
    probe.unlink()
    return str(yaml.safe_load(out)["data"]["notes"])


@needs_helm
def test_packaged_chart_renders_with_working_notes(tmp_path: Path):
    helm("package", str(CHART), "--destination", str(tmp_path))
    (tgz,) = tmp_path.glob("pdcluster-operator-*.tgz")
    # the package renders exactly what the source folder renders (files/ and crds/ are packaged)
    for values in (None, FULL):
        args = ["-f", str(values)] if values else []
        packaged = helm("template", "pdc", str(tgz), "--namespace", "pdc-system", *args).stdout
        assert [d for d in yaml.safe_load_all(packaged) if d] == render_chart(*args)
    with tarfile.open(tgz) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "x", filter="data")
    assert "pdcluster-operator/crds/pdcluster.yaml" in names and "pdcluster-operator/README.md" in names
    unpacked = tmp_path / "x" / "pdcluster-operator"
    assert (unpacked / "templates" / "NOTES.txt").read_text().strip() == '{{ include "pdcluster-operator.notes" . }}'
    notes = _notes(unpacked)
    assert "namespace pdc-system and watches all namespaces" in notes
    assert "2 replicas, one active" in notes and "clusterkopfpeerings pdc-pdcluster-operator" in notes
    assert models.DEFAULT_WORKER_IMAGE in notes  # what the operator defaults spec.image to
    assert "helm show crds pdcluster-operator --version 0.1.0 | kubectl apply --server-side -f -" in notes
    # nothing that only exists in a git checkout
    assert "examples/" not in notes and "crds/pdcluster.yaml" not in notes
    # the PDCluster in the notes is a valid spec
    manifest = notes.split("<<'YAML'\n", 1)[1].split("\n  YAML", 1)[0]
    doc = yaml.safe_load("\n".join(line[2:] for line in manifest.splitlines()))
    models.parse_spec(doc["spec"])
    notes = _notes(unpacked, "-f", str(FULL), "--set", "replicaCount=0")
    assert "watches: inference, staging." in notes and "paused" in notes and "kubectl apply -n inference" in notes
    shutil.rmtree(tmp_path / "x")


# ------------------------------------------------------------------------------------ README and schema


def _readme_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("chart_readme", ROOT / "scripts" / "chart_readme.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _leaves(values: dict, prefix: tuple[str, ...] = ()):
    for k, v in values.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, (*prefix, k))
        else:
            yield (*prefix, k)


def test_readme_documents_every_value():
    mod = _readme_module()
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    docs = mod.comments(text)
    assert mod.undocumented(values, docs) == []
    readme = (CHART / "README.md").read_text()
    for leaf in _leaves(values):
        # a leaf is in the table itself or under a documented parent (securityContext, resources, ...)
        assert any(f"| `{'.'.join(leaf[:n])}` |" in readme for n in range(len(leaf), 0, -1)), leaf
    assert "| `metrics.podMonitor.enabled` | bool | `false` |" in readme


def test_readme_generator_refuses_an_undocumented_value(tmp_path: Path):
    mod = _readme_module()
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "values.yaml").write_text((chart / "values.yaml").read_text() + "newKnob: 3\n")
    with pytest.raises(ValueError, match="newKnob"):
        mod.render(chart)
    comments = mod.comments("a:\n  # -- the b\n  # continued\n  b: 1\n  c: 2\n")
    assert comments == {("a", "b"): "the b continued"}


def _schema_at(schema: dict, path: tuple[str, ...]) -> dict | None:
    node = schema
    for k in path:
        props = node.get("properties") or {}
        if k in props:
            node = props[k]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        elif node.get("type") == "object" and "properties" not in node and node.get("additionalProperties") is not False:
            return node  # a free-form Kubernetes object (security context, affinity term, ...)
        else:
            return None
    return node


def test_values_schema_covers_every_value_and_is_closed():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = [".".join(p) for p in _leaves(values) if _schema_at(schema, p) is None]
    assert not missing, f"values.schema.json does not describe: {missing}"

    open_objects = []

    def walk(node: dict, path: str) -> None:
        if node.get("properties") and node.get("additionalProperties") is not False:
            open_objects.append(path)
        for k, sub in (node.get("properties") or {}).items():
            walk(sub, f"{path}.{k}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(schema, "")
    # resources.claims items and resources are Kubernetes shapes with optional extra keys
    assert [p for p in open_objects if not p.startswith(".resources.claims")] == [], open_objects
