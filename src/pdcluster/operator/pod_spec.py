"""The pod-level parts of the PDCluster spec (container resources, tolerations and each pool's pod
options), and the base every spec model shares. Split from `models` to keep each file small;
`models` re-exports all of it, so `models` stays the one place to read the spec from."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


def cel(rule: str, message: str) -> Any:
    return {"rule": rule, "message": message}


class SpecModel(BaseModel):
    # The API server prunes unknown fields; the operator ignores them rather than failing.
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


IntOrString = int | str


class Resources(SpecModel):
    """Container resources (a subset of core/v1 ResourceRequirements)."""

    requests: dict[str, IntOrString] = Field(
        default_factory=dict, description="Minimum resources, e.g. cpu: 4, memory: 64Gi."
    )
    limits: dict[str, IntOrString] = Field(
        default_factory=dict, description="Maximum resources, e.g. nvidia.com/gpu: 1."
    )


class Toleration(SpecModel):
    """A core/v1 Toleration."""

    key: str | None = Field(default=None, description="Taint key; empty with operator Exists: every taint.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists (any value) or Equal (the taint's value equals `value`).")
    value: str | None = Field(default=None, description="Taint value matched with operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty: every effect.")
    tolerationSeconds: int | None = Field(
        default=None, description="With effect NoExecute: seconds the pod stays bound after the taint appears.")


class EnvVar(SpecModel):
    """An environment variable for the pool's containers (core/v1 EnvVar)."""

    name: str = Field(min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", description="Variable name.")
    value: str | None = Field(default=None, description="Literal value (mutually exclusive with valueFrom).")
    valueFrom: dict[str, Any] | None = Field(
        default=None,
        description="A core/v1 EnvVarSource: secretKeyRef, configMapKeyRef, fieldRef or resourceFieldRef.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value is not None and self.valueFrom is not None:
            raise ValueError(f"env {self.name}: value and valueFrom are mutually exclusive")
        return self


class LocalObjectReference(SpecModel):
    """A reference to an object in the PDCluster's namespace."""

    name: str = Field(min_length=1, description="Name of the Secret (type kubernetes.io/dockerconfigjson).")


# The operator sets these itself; a pool's `env` must not shadow them (the workers and the router read
# them to label their metrics and to find their config).
RESERVED_ENV = frozenset({"NODE_NAME", "POD_NAME", "POD_NAMESPACE", "POD_IP", "PDCLUSTER_NAME",
                          "PDCLUSTER_ROLE", "HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"})
POD_OPTION_RULES: Any = [
    cel("!has(self.env) || self.env.all(e, !(e.name in " + str(sorted(RESERVED_ENV)).replace("'", '"')
         + "))", "env must not set a variable the operator sets (" + ", ".join(sorted(RESERVED_ENV)) + ")"),
    cel("!has(self.env) || self.env.all(e, !has(e.value) || !has(e.valueFrom))",
         "env: value and valueFrom are mutually exclusive"),
]


class PodOptions(SpecModel):
    """Pod-level settings shared by the prefill, decode and router pools."""

    env: list[EnvVar] = Field(
        default_factory=list, max_length=256,
        description="Extra environment variables for the pool's container (after the operator's own; "
        "the names the operator sets itself are refused).",
    )
    affinity: dict[str, Any] = Field(
        default_factory=dict,
        description="A core/v1 Affinity (nodeAffinity, podAffinity, podAntiAffinity) for the pool's pods.",
    )
    priorityClassName: str | None = Field(
        default=None, min_length=1, max_length=253,
        description="PriorityClass of the pool's pods (e.g. keep decode above batch jobs).",
    )
    podAnnotations: dict[str, str] = Field(
        default_factory=dict,
        description="Extra annotations on the pool's pods (the operator's own pdcluster.dev/* and "
        "prometheus.io/* annotations win on a clash).",
    )
    imagePullSecrets: list[LocalObjectReference] = Field(
        default_factory=list, description="Secrets for pulling `image` from a private registry.",
    )

    @model_validator(mode="after")
    def _env_names(self) -> PodOptions:
        clash = sorted({e.name for e in self.env} & RESERVED_ENV)
        if clash:
            raise ValueError(f"env must not set a variable the operator sets: {', '.join(clash)}")
        return self
