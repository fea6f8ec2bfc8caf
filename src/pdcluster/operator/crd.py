"""Generate the PDCluster CRD from the pydantic models.

`make generate` (scripts/generate.py) writes it to `crds/pdcluster.yaml` and the chart's `crds/`; the tests
fail if either differs. The pydantic JSON Schema (draft 2020-12) is turned into a Kubernetes *structural*
OpenAPI v3 schema: `$ref`s are inlined, `X | None` becomes an optional X, numeric exclusive bounds use
the OpenAPI 3.0 boolean form, `int | str` maps become `x-kubernetes-int-or-string`, nested objects get
a full default so that the API server fills in their defaults, and the models' CEL rules are kept.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml

from pdcluster.operator import models

_KEEP = {
    "type", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern", "default",
    "description", "format", "minItems", "maxItems", "x-kubernetes-validations",
}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        name = node["$ref"].split("/")[-1]
        merged = copy.deepcopy(defs[name])
        for k, v in node.items():
            if k != "$ref":
                merged[k] = v
        return merged
    return node


def _convert(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = _resolve(node, defs)
    if "anyOf" in node:
        options = [_resolve(o, defs) for o in node["anyOf"]]
        non_null = [o for o in options if o.get("type") != "null"]
        types = sorted(o.get("type", "") for o in non_null)
        if types == ["integer", "string"]:
            out: dict[str, Any] = {"x-kubernetes-int-or-string": True}
            for k in ("description",):
                if k in node:
                    out[k] = node[k]
            return out
        if len(non_null) != 1:
            raise ValueError(f"cannot express {node!r} as a structural schema")
        inner = dict(non_null[0])
        for k, v in node.items():
            if k not in ("anyOf", "default") and k not in inner:
                inner[k] = v
        if node.get("default") is not None:
            inner["default"] = node["default"]
        return _convert(inner, defs)

    out = {}
    for key, value in node.items():
        if key == "exclusiveMinimum":
            out["minimum"] = value
            out["exclusiveMinimum"] = True
        elif key == "exclusiveMaximum":
            out["maximum"] = value
            out["exclusiveMaximum"] = True
        elif key in _KEEP:
            out[key] = copy.deepcopy(value)

    typ = node.get("type")
    if typ == "object" or "properties" in node:
        out["type"] = "object"
        props = node.get("properties", {})
        if props:
            out["properties"] = {}
            for name, sub in props.items():
                converted = _convert(sub, defs)
                if (
                    converted.get("type") == "object"
                    and "properties" in converted
                    and "default" not in converted
                    and not converted.get("required")
                ):
                    # Let the API server default nested fields even when the parent is omitted. The
                    # default is spelled out in full: the API server validates it (CEL rules included)
                    # without applying the nested defaults first.
                    converted["default"] = {
                        k: copy.deepcopy(v["default"]) for k, v in converted["properties"].items()
                        if "default" in v
                    }
                out["properties"][name] = converted
        required = [r for r in node.get("required", [])]
        if required:
            out["required"] = required
        addl = node.get("additionalProperties")
        if isinstance(addl, dict):
            out["additionalProperties"] = _convert(addl, defs)
        elif addl is True:
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif typ == "array":
        out["items"] = _convert(node.get("items", {}), defs)
    if "enum" in out and "type" not in out:
        first = out["enum"][0]
        out["type"] = "integer" if isinstance(first, int) else "string"
    return out


def spec_schema() -> dict[str, Any]:
    raw = models.PDClusterSpec.model_json_schema(mode="validation")
    defs = raw.pop("$defs", {})
    schema = _convert(raw, defs)
    schema.pop("default", None)
    schema["description"] = "Desired state of a prefill/decode-disaggregated inference deployment."
    return schema


def _pool_status(role: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "object",
        "description": f"Replicas of the {role} Deployment.",
        "properties": {
            "replicas": {"type": "integer", "description": "Pods the Deployment has."},
            "readyReplicas": {"type": "integer", "description": "Pods that pass their readiness probe."},
            "desiredReplicas": {"type": "integer",
                                "description": "Replicas the operator (or the autoscaler) asked for."},
        },
    }
    if role != "router":
        out["description"] = f"Replicas of the {role} pool: its Deployment's pods and the flipped pods it holds."
        out["properties"].update(
            tensorParallelSize={"type": "integer", "description": "Ranks (GPUs on a GPU pool) of one pod."},
            gpus={"type": "integer", "description": "GPUs the pool's pods hold: replicas x GPUs per pod "
                  "(0 on CPU)."},
            flippedReplicas={"type": "integer", "description": "Pods of this pool that came from the other "
                             "pool by a role flip (counted in replicas; owned by the PDCluster, not the "
                             "Deployment)."})
    return out


def _status_schema() -> dict[str, Any]:
    condition = {
        "type": "object",
        "description": "A standard condition (types in docs/operator.md).",
        "required": ["type", "status"],
        "properties": {
            "type": {"type": "string", "description": "Condition type."},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"],
                       "description": "True, False or Unknown."},
            "reason": {"type": "string", "description": "CamelCase reason for the status."},
            "message": {"type": "string", "description": "Human-readable details."},
            "lastTransitionTime": {"type": "string", "format": "date-time",
                                   "description": "When status last changed."},
            "observedGeneration": {"type": "integer",
                                   "description": "metadata.generation the condition was computed for."},
        },
    }
    return {
        "type": "object",
        "description": "Observed state, written by the operator only.",
        "properties": {
            "observedGeneration": {"type": "integer",
                                   "description": "metadata.generation the operator last reconciled."},
            "conditions": {
                "type": "array",
                "description": "Ready, Progressing, Degraded, MetricsAvailable, ScalingLimited, SLOMet, "
                               "KVTransferDegraded, RoleFlips.",
                "items": condition,
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            "prefill": _pool_status("prefill"),
            "decode": _pool_status("decode"),
            "router": _pool_status("router"),
            "ratio": {"type": "number", "description": "Decode replicas per prefill replica."},
            "endpoint": {"type": "string", "description": "In-cluster URL of the router."},
            "autoscaler": {
                "type": "object",
                "description": "Last decision with its inputs and reason, learned capacities, stabilization state.",
                "x-kubernetes-preserve-unknown-fields": True,
            },
        },
    }


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{models.PLURAL}.{models.API_GROUP}",
            "labels": {"app.kubernetes.io/name": "pdcluster"},
        },
        "spec": {
            "group": models.API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": models.KIND,
                "listKind": f"{models.KIND}List",
                "plural": models.PLURAL,
                "singular": models.SINGULAR,
                "shortNames": list(models.SHORT_NAMES),
                "categories": ["all"],
            },
            "versions": [
                {
                    "name": models.API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Prefill", "type": "integer", "jsonPath": ".status.prefill.replicas",
                         "description": "Prefill replicas"},
                        {"name": "Decode", "type": "integer", "jsonPath": ".status.decode.replicas",
                         "description": "Decode replicas"},
                        {"name": "Ratio", "type": "number", "jsonPath": ".status.ratio",
                         "description": "Decode replicas per prefill replica"},
                        {"name": "Ready", "type": "string",
                         "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
                         "description": "Ready condition"},
                        # `kubectl get pdc` says why a cluster is not healthy (InvalidSpec, ApplyFailed,
                        # RolloutFailed, ...); Reconciled while it is.
                        {"name": "Degraded", "type": "string",
                         "jsonPath": '.status.conditions[?(@.type=="Degraded")].reason',
                         "description": "Reason of the Degraded condition"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "PDCluster: a prefill/decode-disaggregated LLM inference deployment.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string", "description": (
                                    "Versioned schema of this object (pdcluster.dev/v1alpha1).")},
                                "kind": {"type": "string", "description": "PDCluster."},
                                # the API server refuses anything but `type` here (kubectl explain
                                # documents ObjectMeta from the built-in schema)
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": _status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


HEADER = (
    "# GENERATED from pdcluster.operator.models by `make generate` (scripts/generate.py).\n"
    "# Do not edit by hand: the tests fail when this file and the models disagree.\n"
)


def render_yaml() -> str:
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


PEERING_GROUP = "kopf.dev"


def build_peering_crds() -> list[dict[str, Any]]:
    """kopf's peering CRDs (ClusterKopfPeering, KopfPeering; kopf does not install them): with two or more
    operator replicas the chart runs `pdcluster operator --peering NAME`, and kopf keeps each replica's
    keep-alive (identity -> priority, lifetime, last seen) in the peering object's status."""
    out = []
    for kind, scope in (("ClusterKopfPeering", "Cluster"), ("KopfPeering", "Namespaced")):
        plural = kind.lower() + "s"
        out.append({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{PEERING_GROUP}"},
            "spec": {
                "scope": scope,
                "group": PEERING_GROUP,
                "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                "versions": [{
                    "name": "v1", "served": True, "storage": True,
                    "schema": {"openAPIV3Schema": {
                        "type": "object",
                        "description": f"kopf peering ({scope.lower()}-scoped): live operator replicas.",
                        "properties": {"status": {
                            "type": "object", "x-kubernetes-preserve-unknown-fields": True,
                            "description": "Written by kopf: one entry per operator replica.",
                        }},
                    }},
                }],
            },
        })
    return out


def render_peering_yaml() -> str:
    return HEADER.replace("pdcluster.operator.models", "pdcluster.operator.crd (kopf's peering CRDs)") + (
        "---\n".join(yaml.safe_dump(d, sort_keys=False, width=100) for d in build_peering_crds()))


def main() -> int:
    sys.stdout.write(render_yaml())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
