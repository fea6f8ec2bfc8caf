"""The OpenMP thread count the operator renders for `engine: vllm` pods on CPU (render_vllm.cpu_threads): the whole
cores of the pool's CPU limit, else its request, at least 1; nothing on GPU pools, nothing when the pool names no
CPU, and never over the pool's own env."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pdcluster.operator import naming, render, render_vllm
from pdcluster.operator.models import parse_spec

OWNER = naming.Owner(name="chat", namespace="serving", uid="u-1")
FP = render.secret_fingerprint(b"k" * 32)
VLLM = {"model": {"name": "llama-3-8b", "uri": "pvc://models/llama3"}, "engine": "vllm",
        "kvTransfer": {"integrity": "fabric"}}


def _worker(spec: dict[str, Any], role: str = "decode") -> dict[str, Any]:
    objs = render.render_children(OWNER, parse_spec(spec), {"prefill": 1, "decode": 1}, FP)
    (dep,) = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == f"chat-{role}"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return dep | {"container": c}


def _omp(spec: dict[str, Any], role: str = "decode") -> list[str | None]:
    return [e.get("value") for e in _worker(spec, role)["container"]["env"] if e["name"] == "OMP_NUM_THREADS"]


def _with(decode: dict[str, Any], prefill: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = copy.deepcopy(VLLM)
    spec["decode"] = decode
    if prefill is not None:
        spec["prefill"] = prefill
    return spec


@pytest.mark.parametrize("resources,threads", [
    ({"limits": {"cpu": 4}}, "4"),
    ({"limits": {"cpu": "2500m"}}, "2"),  # whole cores: the rest is left to the API server process
    ({"limits": {"cpu": "1.5"}}, "1"),
    ({"requests": {"cpu": "500m"}}, "1"),  # at least 1
    ({"requests": {"cpu": "3"}}, "3"),
    ({"requests": {"cpu": 1}, "limits": {"cpu": "6"}}, "6"),  # the limit is the pod's quota: it wins
    ({"requests": {"cpu": "8"}, "limits": {"cpu": "2000m"}}, "2"),
    ({"requests": {"cpu": "0.25", "memory": "2Gi"}, "limits": {"memory": "8Gi"}}, "1"),
], ids=["limit-int", "limit-milli", "limit-decimal", "request-below-one", "request", "limit-over-request",
        "limit-under-request", "memory-limit-only"])
def test_a_cpu_pool_gets_openmp_threads_at_its_cpu_share(resources: dict[str, Any], threads: str) -> None:
    assert _omp(_with({"resources": resources})) == [threads]


def test_each_pool_is_sized_from_its_own_resources() -> None:
    spec = _with({"resources": {"limits": {"cpu": 2}}}, prefill={"resources": {"limits": {"cpu": "7"}}})
    assert _omp(spec, "decode") == ["2"] and _omp(spec, "prefill") == ["7"]


def test_no_cpu_named_leaves_vllm_its_own_default() -> None:
    assert _omp(_with({"resources": {"limits": {"memory": "8Gi"}}})) == []
    assert _omp(copy.deepcopy(VLLM)) == []


def test_gpu_pools_get_no_thread_count() -> None:
    # vLLM's GPU workers size their own CPU threads; the KV and the model are on the GPU
    assert _omp(_with({"resources": {"limits": {"cpu": 8, "nvidia.com/gpu": 1}}})) == []


def test_the_pools_own_env_wins_and_is_not_duplicated() -> None:
    assert _omp(_with({"resources": {"limits": {"cpu": 4}}, "env": [{"name": "OMP_NUM_THREADS", "value": "3"}]})) \
        == ["3"]


def test_a_cpu_change_rolls_the_pods() -> None:
    a = _worker(_with({"resources": {"limits": {"cpu": 2}}}))
    b = _worker(_with({"resources": {"limits": {"cpu": 4}}}))
    key = "pdcluster.dev/config-hash"
    assert a["spec"]["template"]["metadata"]["annotations"][key] != b["spec"]["template"]["metadata"]["annotations"][key]


def test_our_engine_is_not_given_a_thread_count_by_this_rule() -> None:
    spec = {"model": VLLM["model"], "decode": {"resources": {"limits": {"cpu": 4}}}}
    assert _omp(spec) == []


@pytest.mark.parametrize("value,cores", [
    (3, 3.0), ("3", 3.0), ("250m", 0.25), ("1.5", 1.5), (".5", 0.5), ("2k", 2000.0), (" 4 ", 4.0),
    (None, None), ("two", None), ("1Gi", None), ("-1", None), (True, None),
])
def test_cpu_quantities(value: Any, cores: float | None) -> None:
    assert render_vllm.cpu_cores(value) == cores
