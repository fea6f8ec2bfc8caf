"""Scenario 2: bad specs are refused by the API server (structural schema, enums, CEL) with a message
that names the field, and nothing is created."""

from __future__ import annotations

import pytest
from pdc_e2e import Kube, example_pdc

CASES = [
    # (id, spec overrides, substrings the error must contain)
    ("min-gt-max", {"prefill": {"minReplicas": 5, "maxReplicas": 2}},
     ["spec.prefill", "minReplicas must be <= maxReplicas"]),
    ("replicas-out-of-range", {"decode": {"replicas": 9, "minReplicas": 1, "maxReplicas": 4}},
     ["spec.decode", "replicas must be within"]),
    ("unknown-enum", {"kvCache": {"dtype": "fp8"}}, ["spec.kvCache.dtype", "Unsupported value", "fp8"]),
    ("block-size-enum", {"kvCache": {"blockSize": 12}}, ["spec.kvCache.blockSize", "Unsupported value"]),
    # server-side apply reports type errors and unknown fields while building the typed patch, in its own
    # words; a client-side create says "must be of type integer" / "unknown field": accept either
    ("wrong-type", {"decode": {"maxBatchSize": "lots"}},
     ["spec.decode.maxBatchSize", ("expected numeric", "must be of type integer")]),
    ("out-of-bounds", {"kvCache": {"gpuMemoryUtilization": 1.5}}, ["spec.kvCache.gpuMemoryUtilization"]),
    ("autoscaling-without-prometheus", {"autoscaling": {"enabled": True, "prometheusUrl": None}},
     ["prometheusUrl is required"]),
    ("unknown-field", {"prefil": {"replicas": 2}}, ["spec.prefil", ("field not declared in schema", "unknown field")]),
    ("tp-not-power-of-two", {"prefill": {"tensorParallelSize": 3}},
     ["spec.prefill.tensorParallelSize", "must be 1, 2, 4, 8 or 16"]),
    ("gpus-not-tp", {"decode": {"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}}},
     ["spec.decode", "must equal tensorParallelSize"]),
    # engine vllm: pdcluster's own KV formats and transfer knobs, and the unauthenticated NIXL data plane
    ("vllm-int8-wire", {"engine": "vllm", "kvTransfer": {"integrity": "fabric", "compression": "int8"}},
     ["engine vllm", "int8 is pdcluster's wire format"]),
    ("vllm-mac", {"engine": "vllm"}, ["engine vllm", "integrity: fabric"]),
    ("engine-args-port", {"decode": {"engineArgs": ["--port=9"]}}, ["spec.decode", "engineArgs must not repeat"]),
]


@pytest.mark.parametrize("overrides,needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_spec_refused(kube: Kube, namespace: str, overrides: dict, needles: list[str]):
    doc = example_pdc("bad", **overrides)
    _drop_nones(doc)
    cp = kube.apply(doc, ns=namespace, check=False)
    assert cp.returncode != 0, f"the API server accepted a bad spec {overrides}: {cp.stdout}"
    for needle in needles:
        options = needle if isinstance(needle, tuple) else (needle,)
        assert any(o in cp.stderr for o in options), f"error message lacks {needle!r}:\n{cp.stderr}"
    assert kube.get("pdc", "bad", namespace) is None


def test_good_spec_accepted_and_defaulted(kube: Kube, namespace: str):
    doc = example_pdc("good")
    kube.apply(doc, ns=namespace)
    pdc = kube.get("pdc", "good", namespace)
    # structural-schema defaults filled in by the API server
    assert pdc["spec"]["kvCache"]["blockSize"] in (8, 16, 32)
    assert pdc["spec"]["kvTransfer"]["maxRetries"] >= 0
    assert pdc["spec"]["autoscaling"]["headroom"] >= 1.0


def _drop_nones(d: dict) -> None:
    for k in [k for k, v in d.items() if v is None]:
        del d[k]
    for v in d.values():
        if isinstance(v, dict):
            _drop_nones(v)
