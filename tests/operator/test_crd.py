"""The CRD and the pydantic models agree: the CRD is generated from the models, the committed file equals
the generated one, the schema is structural, and a small validator of the schema's own constraints
accepts and rejects the same specs as the models."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from pdcluster.operator import crd, models

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "pdcluster.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _version() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]


def _spec_schema() -> dict[str, Any]:
    return _version()["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_committed_crd_is_generated_from_the_models() -> None:
    assert CRD_FILE.read_text() == crd.render_yaml(), (
        "crds/pdcluster.yaml is stale: run `make generate`")


def test_crd_shape() -> None:
    doc = yaml.safe_load(CRD_FILE.read_text())
    assert doc["metadata"]["name"] == "pdclusters.pdcluster.dev"
    assert doc["spec"]["names"]["shortNames"] == ["pdc"]
    assert doc["spec"]["scope"] == "Namespaced"
    v = _version()
    assert v["name"] == "v1alpha1" and v["subresources"] == {"status": {}}
    cols = {c["name"]: c for c in v["additionalPrinterColumns"]}
    assert list(cols) == ["Prefill", "Decode", "Ratio", "Ready", "Degraded", "Age"]
    assert cols["Degraded"]["jsonPath"] == '.status.conditions[?(@.type=="Degraded")].reason'


def test_every_field_has_a_description() -> None:
    """`kubectl explain pdcluster --recursive` documents every field: each named property of the whole
    schema (spec and status, inside arrays and maps too) carries a description."""
    root = _version()["schema"]["openAPIV3Schema"]
    missing, seen = [], 0

    def visit(node: dict[str, Any], path: str) -> None:
        nonlocal seen
        for name, sub in (node.get("properties") or {}).items():
            seen += 1
            if path == "" and name == "metadata":
                # a real kube-apiserver refuses a CRD whose metadata schema says more than `type: object`
                assert sub == {"type": "object"}, sub
                continue
            if not str(sub.get("description", "")).strip():
                missing.append(f"{path}.{name}")
            visit(sub, f"{path}.{name}")
        if "items" in node:
            visit(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            visit(node["additionalProperties"], f"{path}{{}}")

    visit(root, "")
    assert seen > 80
    assert not missing, f"fields without a description (add one in operator/models.py or crd.py): {missing}"


def test_image_is_optional_in_the_crd() -> None:
    s = _spec_schema()
    assert s["required"] == ["model"]
    assert "default" not in s["properties"]["image"]  # defaulted by the operator, to its own version


def _walk(node: dict[str, Any], path: str = "spec"):
    yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural() -> None:
    for path, node in _walk(_spec_schema()):
        assert "$ref" not in node and "$defs" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            continue
        assert "type" in node, f"{path} has no type"
        assert "anyOf" not in node and "oneOf" not in node, path
        if node["type"] == "object" and "properties" not in node:
            assert "additionalProperties" in node or node.get("x-kubernetes-preserve-unknown-fields"), path


def test_defaults_and_rules_from_the_issue() -> None:
    s = _spec_schema()["properties"]
    assert s["autoscaling"]["properties"]["headroom"]["default"] == 1.5
    assert s["kvCache"]["properties"]["blockSize"] == {
        "default": 16, "description": "Tokens per KV-cache block.", "enum": [8, 16, 32], "type": "integer"}
    assert s["decode"]["properties"]["maxBatchSize"]["default"] == 16
    assert s["kvCache"]["properties"]["dtype"]["enum"] == ["auto", "int8", "int4"]
    assert s["kvTransfer"]["properties"]["compression"]["enum"] == ["none", "int8"]
    rules = [r["rule"] for r in s["prefill"]["x-kubernetes-validations"]]
    assert "self.minReplicas <= self.maxReplicas" in rules
    assert any("self.replicas >= self.minReplicas" in r for r in rules)
    assert s["autoscaling"]["x-kubernetes-validations"][0]["message"].startswith("autoscaling.prometheusUrl")
    assert "maxTotalReplicas" in _spec_schema()["x-kubernetes-validations"][0]["rule"]


def _defaults(schema: dict[str, Any], value: Any) -> Any:
    """Apply the CRD's defaults the way the API server does."""
    if schema.get("type") == "object" and isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = _defaults(sub, value[name])
    return value


def _errors(schema: dict[str, Any], value: Any, path: str = "spec") -> list[str]:
    """The structural constraints of the schema (types, enums, ranges, required, patterns)."""
    import re

    errs: list[str] = []
    if schema.get("x-kubernetes-int-or-string"):
        return [] if isinstance(value, int | str) and not isinstance(value, bool) else [f"{path}: int-or-string"]
    t = schema.get("type")
    ok = {"object": isinstance(value, dict), "array": isinstance(value, list), "string": isinstance(value, str),
          "boolean": isinstance(value, bool),
          "integer": isinstance(value, int) and not isinstance(value, bool),
          "number": isinstance(value, int | float) and not isinstance(value, bool)}.get(t, True)
    if not ok:
        return [f"{path}: not {t}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: not in enum")
    if "minimum" in schema and isinstance(value, int | float):
        if value < schema["minimum"] or (schema.get("exclusiveMinimum") and value == schema["minimum"]):
            errs.append(f"{path}: below minimum")
    if "maximum" in schema and isinstance(value, int | float):
        if value > schema["maximum"] or (schema.get("exclusiveMaximum") and value == schema["maximum"]):
            errs.append(f"{path}: above maximum")
    if "minLength" in schema and isinstance(value, str) and len(value) < schema["minLength"]:
        errs.append(f"{path}: too short")
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        errs.append(f"{path}: pattern")
    if t == "object":
        for r in schema.get("required", []):
            if r not in value:
                errs.append(f"{path}.{r}: required")
        for k, v in value.items():
            sub = (schema.get("properties") or {}).get(k)
            if sub is None and isinstance(schema.get("additionalProperties"), dict):
                sub = schema["additionalProperties"]
            if sub is None:
                errs.append(f"{path}.{k}: unknown field")
            else:
                errs += _errors(sub, v, f"{path}.{k}")
    if t == "array":
        for i, v in enumerate(value):
            errs += _errors(schema.get("items", {}), v, f"{path}[{i}]")
    return errs


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_for_both(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "pdcluster.dev/v1alpha1" and doc["kind"] == "PDCluster"
    assert _errors(_spec_schema(), doc["spec"]) == []
    models.parse_spec(doc["spec"])


def test_crd_defaults_equal_model_defaults() -> None:
    minimal = {"model": {"name": "m", "uri": "/m"}, "image": "img"}
    defaulted = _defaults(_spec_schema(), copy.deepcopy(minimal))
    from_model = models.parse_spec(minimal).model_dump(exclude_none=True)
    # pydantic keeps empty collections the API server would leave absent
    def prune(x):
        if isinstance(x, dict):
            return {k: prune(v) for k, v in x.items() if v not in ({}, [], None) or k in ("resources",)}
        return x
    assert prune(defaulted) == prune(from_model)


BASE = {"model": {"name": "m", "uri": "file:///m"}, "image": "img"}
# (id, spec patch, rejected by: "schema" = structural constraints, "cel" = an x-kubernetes-validations rule)
BAD = [
    ("enum", {"kvCache": {"dtype": "fp8"}}, "schema"),
    ("block-size", {"kvCache": {"blockSize": 12}}, "schema"),
    ("type", {"decode": {"maxBatchSize": "lots"}}, "schema"),
    ("range", {"kvCache": {"gpuMemoryUtilization": 1.5}}, "schema"),
    ("headroom", {"autoscaling": {"headroom": 0.5}}, "schema"),
    ("zero-capacity", {"autoscaling": {"capacity": {"prefillTokensPerSecond": 0}}}, "schema"),
    ("uri", {"model": {"name": "m", "uri": "s3://bucket/m"}}, "schema"),
    ("min-gt-max", {"prefill": {"minReplicas": 5, "maxReplicas": 2}}, "cel"),
    ("replicas-out-of-range", {"decode": {"replicas": 9, "maxReplicas": 4}}, "cel"),
    ("no-prometheus", {"autoscaling": {"enabled": True}}, "cel"),
    ("budget", {"autoscaling": {"maxTotalReplicas": 2}, "prefill": {"minReplicas": 2}}, "cel"),
    # accepted and silently ignored before: the transfer path only streams layer by layer
    ("layerwise-off", {"kvTransfer": {"layerwise": False}}, "cel"),
    ("env-reserved", {"decode": {"env": [{"name": "POD_IP", "value": "1.2.3.4"}]}}, "cel"),
    ("env-two-sources", {"router": {"env": [{"name": "A", "value": "1", "valueFrom": {}}]}}, "cel"),
    ("env-name", {"prefill": {"env": [{"name": "1A", "value": "1"}]}}, "schema"),
    ("pull-secret-name", {"prefill": {"imagePullSecrets": [{}]}}, "schema"),
    ("priority-class", {"decode": {"priorityClassName": ""}}, "schema"),
    ("image-empty", {"image": ""}, "schema"),
    ("tp-not-power-of-two", {"prefill": {"tensorParallelSize": 3}}, "cel"),
    ("tp-over-one-node", {"decode": {"tensorParallelSize": 32}}, "schema"),
    ("tp-zero", {"decode": {"tensorParallelSize": 0}}, "schema"),
    ("gpus-not-tp", {"decode": {"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}}}, "cel"),
    ("gpu-request-not-tp", {"prefill": {"tensorParallelSize": 4, "resources": {"requests": {"nvidia.com/gpu": "2"}}}},
     "cel"),
]


@pytest.mark.parametrize("patch,by", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_specs_rejected_by_both(patch: dict[str, Any], by: str) -> None:
    spec = copy.deepcopy(BASE)
    for k, v in patch.items():
        spec[k] = v
    with pytest.raises(ValidationError):
        models.parse_spec(spec)
    errs = _errors(_spec_schema(), _defaults(_spec_schema(), copy.deepcopy(spec)))
    if by == "schema":
        assert errs, f"the CRD schema accepts {patch}"
    else:
        assert errs == [], errs  # structurally fine: a CEL rule must catch it (checked above by text)


def test_good_spec_accepted_by_both() -> None:
    spec = copy.deepcopy(BASE)
    assert _errors(_spec_schema(), _defaults(_spec_schema(), spec)) == []
    s = models.parse_spec(spec)
    assert s.prefill.initial_replicas == 1 and s.autoscaling.headroom == 1.5


def test_object_defaults_satisfy_their_own_cel_rules() -> None:
    """The API server validates a `default` against the schema, CEL rules included, *without* applying the
    nested defaults first (a real kube-apiserver refused `default: {}` on spec.prefill). So every field a
    rule reads must be spelled out in the default."""
    import re

    checked = 0
    for path, node in _walk(_spec_schema()):
        if "default" not in node or not node.get("x-kubernetes-validations"):
            continue
        for rule in node["x-kubernetes-validations"]:
            for field in set(re.findall(r"self\.(\w+)", rule["rule"])):
                guarded = f"has(self.{field})" in rule["rule"]
                assert guarded or field in node["default"], f"{path}.default lacks {field} read by {rule['rule']!r}"
                checked += 1
    assert checked >= 4
