"""Fast checks of the Helm chart (helm/pdcluster-operator): lint, render with every ci/*-values.yaml, the
files `make generate` writes (CRD, alert rules, dashboard, operator RBAC) are generated and unchanged, and
the rendered ClusterRole is exactly what the operator declares it uses (operator/rbac.yaml).

The helm binary is the pinned one that e2e/build.sh builds into ~/.cache/pdcluster/bin (or $PDCLUSTER_HELM);
without it the tests that need it are skipped, saying so. The server-side dry-run and `helm install` against
a real API server are in the e2e suite (e2e/test_helm.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdcluster-operator"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))


def _versions() -> dict[str, str]:
    out = {}
    for line in (ROOT / "e2e" / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k] = v
    return out


def _helm_path() -> Path:
    if os.environ.get("PDCLUSTER_HELM"):
        return Path(os.environ["PDCLUSTER_HELM"])
    cache = Path(os.environ.get("PDCLUSTER_CACHE", Path.home() / ".cache" / "pdcluster"))
    return cache / "bin" / f"helm-{_versions()['HELM_VERSION']}"


HELM = _helm_path()
needs_helm = pytest.mark.skipif(
    not HELM.exists() and not os.environ.get("CI"),
    reason=f"helm binary not built yet ({HELM}); run `e2e/build.sh helm` (about 3 minutes, cached)",
)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cp = subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)
    if check and cp.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({cp.returncode}):\n{cp.stdout}\n{cp.stderr}")
    return cp


def render(*values_args: str) -> list[dict]:
    out = helm("template", "pdc", str(CHART), "--namespace", "pdc-system", *values_args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


# ----------------------------------------------------------------------------------------------- generated


def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), *args], capture_output=True,
                          text=True, timeout=120)


def test_generated_artefacts_are_unchanged(tmp_path: Path):
    """`make generate` into a fresh folder writes exactly what the tree holds: nobody edited a copy by hand
    and nobody forgot to regenerate after editing a source."""
    cp = _generate("--out", str(tmp_path))
    assert cp.returncode == 0, cp.stderr
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert {"crds/pdcluster.yaml", "helm/pdcluster-operator/crds/pdcluster.yaml",
            "crds/kopf-peering.yaml", "helm/pdcluster-operator/crds/kopf-peering.yaml",
            "helm/pdcluster-operator/README.md",
            "helm/pdcluster-operator/files/prometheus-rules.yaml",
            "helm/pdcluster-operator/files/grafana-dashboard.json",
            "helm/pdcluster-operator/files/operator-rbac.yaml"} <= set(written)
    stale = [p for p in written if (tmp_path / p).read_bytes() != (ROOT / p).read_bytes()]
    assert not stale, f"stale generated files (run `make generate`): {stale}"
    # the chart carries no CRD that the generator does not write
    chart_crds = {f"helm/pdcluster-operator/crds/{p.name}" for p in (CHART / "crds").iterdir()}
    assert chart_crds <= set(written), chart_crds - set(written)


def test_generate_check_names_a_stale_copy(tmp_path: Path):
    assert _generate("--out", str(tmp_path)).returncode == 0
    assert _generate("--check", "--out", str(tmp_path)).returncode == 0
    copy = tmp_path / "helm" / "pdcluster-operator" / "files" / "operator-rbac.yaml"
    copy.write_text(copy.read_text().replace('"delete"', '"delete", "deletecollection"'))
    cp = _generate("--check", "--out", str(tmp_path))
    assert cp.returncode == 1 and "helm/pdcluster-operator/files/operator-rbac.yaml" in cp.stderr, cp.stderr


def test_values_schema_is_valid_json_and_closed():
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert schema["additionalProperties"] is False
    # every top-level value is described by the schema and documented by a comment in values.yaml
    assert set(values) <= set(schema["properties"]), set(values) - set(schema["properties"])
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith((" ", "#")) and ":" in line:
            key = line.split(":", 1)[0]
            has_own_comment = i > 0 and lines[i - 1].lstrip().startswith("#")
            is_section = line.rstrip().endswith(":")  # a map whose children carry the comments
            assert has_own_comment or is_section, f"values.yaml: top-level key {key!r} has no comment"


# ----------------------------------------------------------------------------------------------- helm


@needs_helm
def test_helm_lint_strict():
    for values in [None, *CI_VALUES]:
        args = ["lint", "--strict", str(CHART)] + (["-f", str(values)] if values else [])
        helm(*args)


@needs_helm
@pytest.mark.parametrize("values", CI_VALUES, ids=[p.name for p in CI_VALUES])
def test_helm_template_ci_values(values: Path):
    docs = render("-f", str(values))
    kinds = {d["kind"] for d in docs}
    assert "Deployment" in kinds
    for d in docs:
        assert d["metadata"]["name"], d
        assert d["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    cfg = yaml.safe_load(values.read_text()) or {}
    (dep,) = by_kind(docs, "Deployment")
    (ctr,) = dep["spec"]["template"]["spec"]["containers"]
    assert ctr["command"] == ["pdcluster", "operator"]
    assert ctr["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    sa_name = dep["spec"]["template"]["spec"]["serviceAccountName"]
    namespaced = bool(cfg.get("operator", {}).get("watchNamespaces"))
    if not cfg.get("rbac", {}).get("create", True):
        assert not ({"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"} & kinds)
    elif namespaced:
        assert not ({"ClusterRole", "ClusterRoleBinding"} & kinds)
        for rb in by_kind(docs, "RoleBinding"):
            assert rb["subjects"] == [{"kind": "ServiceAccount", "name": sa_name, "namespace": "pdc-system"}]
    else:
        assert not ({"Role", "RoleBinding"} & kinds)
        for crb in by_kind(docs, "ClusterRoleBinding"):
            assert crb["subjects"][0]["name"] == sa_name
    if cfg.get("serviceAccount", {}).get("create", True):
        (sa,) = by_kind(docs, "ServiceAccount")
        assert sa["metadata"]["name"] == dep["spec"]["template"]["spec"]["serviceAccountName"]
    assert ("Service" in kinds) == cfg.get("metrics", {}).get("enabled", True)
    ns = cfg.get("operator", {}).get("watchNamespaces")
    if ns:
        assert [a for a in ctr["args"] if a.startswith("--namespace=")] == [f"--namespace={n}" for n in ns]
    else:
        assert not [a for a in ctr["args"] if a.startswith("--namespace")]  # all namespaces
    metrics_on = cfg.get("metrics", {}).get("enabled", True)
    port = cfg.get("metrics", {}).get("port", 8080) if metrics_on else 0
    assert f"--metrics-port={port}" in ctr["args"]


@needs_helm
def test_monitoring_objects_render_when_enabled():
    import json

    docs = render("-f", str(CHART / "ci" / "full-values.yaml"))
    (sm,) = by_kind(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    (rule,) = by_kind(docs, "PrometheusRule")
    source = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    assert rule["spec"]["groups"] == source["groups"]
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["namespace"] == "monitoring"
    json.loads(cm["data"]["pdcluster.json"])


@needs_helm
@pytest.mark.parametrize(
    "bad,needle",
    [
        (["--set", "replicaCount=-1"], "replicaCount"),
        (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
        (["--set", "operator.resyncSeconds=0"], "resyncSeconds"),
        (["--set", "metrics.port=0"], "port"),
        (["--set", "unknownKey=1"], "unknownKey"),
        (["--set", "replicaCount=6"], "replicaCount"),
        (["--set", "metrics.podMonitor.interval=fast"], "interval"),
        (["--set", "metrics.podMonitor.bogus=1"], "bogus"),
        (["--set", "operator.extraEnv[0].nam=X"], "extraEnv"),
        (["--set", "tolerations[0].operator=Maybe"], "operator"),
        (["--set", "affinity.nodeAfinity.x=1"], "nodeAfinity"),
        (["--set", "resources.limits.memory=true"], "memory"),
        (["--set", "operator.watchNamespaces[0]=Bad_NS"], "watchNamespaces"),
        (["--set", "podDisruptionBudget.enabled=yes"], "podDisruptionBudget"),
    ],
)
def test_values_schema_rejects_bad_values(bad: list[str], needle: str):
    cp = helm("template", "pdc", str(CHART), *bad, check=False)
    assert cp.returncode != 0, f"helm accepted {bad}"
    assert needle in cp.stderr, cp.stderr


# ----------------------------------------------------------------------------------------------- RBAC


def _expand(rules: list[dict]) -> set[tuple[str, str, str]]:
    out = set()
    for r in rules:
        assert not r.get("resourceNames"), "resourceNames not supported by this check"
        for g in r.get("apiGroups", []):
            for res in r.get("resources", []):
                for v in r.get("verbs", []):
                    out.add((g, res, v))
    return out


def _operator_rules() -> list[dict]:
    path = ROOT / "src" / "pdcluster" / "operator" / "rbac.yaml"
    rules: list[dict] = []
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc:
            continue
        if isinstance(doc, dict) and doc.get("kind") in ("ClusterRole", "Role"):
            rules += doc.get("rules", [])
        elif isinstance(doc, dict) and "rules" in doc:
            rules += doc["rules"]
        elif isinstance(doc, list):
            rules += doc
    assert rules, "operator/rbac.yaml holds no rules"
    return rules


@needs_helm
def test_cluster_role_is_exactly_what_the_operator_uses():
    wanted = _expand(_operator_rules())
    (role,) = [r for r in by_kind(render(), "ClusterRole") if r["metadata"]["name"] == "pdc-pdcluster-operator"]
    granted = _expand(role["rules"])
    for g, res, v in granted | wanted:
        assert "*" not in (g, res, v), "wildcards are not least privilege"
    missing = wanted - granted
    extra = granted - wanted
    assert not missing, f"chart ClusterRole lacks what operator/rbac.yaml needs: {sorted(missing)}"
    assert not extra, f"chart ClusterRole grants more than operator/rbac.yaml declares: {sorted(extra)}"


@needs_helm
@pytest.mark.parametrize("values", CI_VALUES, ids=[p.name for p in CI_VALUES])
def test_rendered_operator_args_parse_with_the_real_cli(values: Path):
    """The Deployment's command line is accepted by `pdcluster operator`'s own argument parser."""
    import argparse

    from pdcluster.operator import cli

    (dep,) = by_kind(render("-f", str(values)), "Deployment")
    (ctr,) = dep["spec"]["template"]["spec"]["containers"]
    assert ctr["command"] == ["pdcluster", "operator"]
    parser = argparse.ArgumentParser(prog="pdcluster operator", exit_on_error=False)
    cli.add_arguments(parser)
    args = parser.parse_args(ctr["args"])
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert args.liveness.endswith(f":{ports['health']}/healthz")
    if "metrics" in ports:
        assert args.metrics_port == ports["metrics"]
    else:
        assert args.metrics_port == 0
