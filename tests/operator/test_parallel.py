"""Tensor parallelism in the operator (issue 16 §2): the spec fields and their rules, the pod a layout
renders (flag, GPUs, /dev/shm), the status, and the autoscaler forgetting what it learned at another TP."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
from pydantic import ValidationError

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import naming, parallel, render, scaling
from pdcluster.operator import status as st
from pdcluster.operator.models import parse_spec
from pdcluster.worker.engine.parallel import heads

from .conftest import make_spec

OWNER = naming.Owner(name="llama", namespace="inference", uid="0000-1111")
NOW = 1_700_000_000.0


def _spec(prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None, **kw: Any) -> Any:
    raw = make_spec(**kw)
    raw["prefill"].update(prefill or {})
    raw["decode"].update(decode or {})
    return parse_spec(raw)


# ---- the operator's head arithmetic is the engine's ---------------------------------------------------

@pytest.mark.parametrize("kv,tp", list(itertools.product([1, 2, 3, 4, 6, 8, 16, 64], [1, 2, 4, 8, 16])))
def test_kv_heads_per_rank_agrees_with_the_engine(kv: int, tp: int) -> None:
    num_heads = 64 * 3  # divisible by every tp here except where the KV rule fails
    try:
        heads.check_layout(kv, num_heads, tp)
    except ValueError as e:
        with pytest.raises(ValueError, match=str(e).split(" (")[0]):
            parallel.kv_heads_per_rank(kv, tp, num_heads)
        return
    assert parallel.kv_heads_per_rank(kv, tp, num_heads) == len(heads.kv_heads_of_rank(kv, tp, 0))
    assert parallel.kv_replication(kv, tp) == len(heads.ranks_holding_head(kv, tp, 0))


def test_attention_heads_must_divide_too() -> None:
    with pytest.raises(ValueError, match="attention head count 40"):
        parallel.kv_heads_per_rank(8, 16, 40)


@pytest.mark.parametrize("text,want", [("70B", 70e9), ("8e9", 8e9), ("1.5t", 1.5e12), (" 7000m ", 7e9), ("405", 405)])
def test_parse_count(text: str, want: float) -> None:
    assert parallel.parse_count(text) == pytest.approx(want)


@pytest.mark.parametrize("text", ["", "abc", "-5B", "0", "70X", "nan", "1e999"])
def test_parse_count_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parallel.parse_count(text)


# ---- the spec -----------------------------------------------------------------------------------------

def test_default_is_one_and_pools_are_independent() -> None:
    s = _spec()
    assert (s.prefill.tensorParallelSize, s.decode.tensorParallelSize) == (1, 1)
    s = _spec({"tensorParallelSize": 4}, {"tensorParallelSize": 2})
    assert (s.prefill.tensorParallelSize, s.decode.tensorParallelSize) == (4, 2)


@pytest.mark.parametrize("tp", [0, 3, 6, 12, 32, 64, -1, True, "4"])
def test_bad_tp_is_refused(tp: Any) -> None:
    with pytest.raises(ValidationError, match="tensorParallelSize|greater than|less than|valid integer"):
        _spec({"tensorParallelSize": tp})


@pytest.mark.parametrize("tp", [0, 3, 6, 12, 32, 64, -4])
def test_bad_tp_message_names_the_rule(tp: int) -> None:
    with pytest.raises(ValidationError, match="must be 1, 2, 4, 8 or 16"):
        _spec(decode={"tensorParallelSize": tp})


@pytest.mark.parametrize("resources", [
    {"limits": {"nvidia.com/gpu": 1}}, {"requests": {"nvidia.com/gpu": 2}}, {"limits": {"nvidia.com/gpu": "8"}},
    {"limits": {"nvidia.com/gpu": "04"}},
])
def test_explicit_gpus_must_equal_tp(resources: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="must equal tensorParallelSize"):
        _spec({"tensorParallelSize": 4, "resources": resources})


def test_explicit_gpus_equal_to_tp_are_accepted_as_int_or_string() -> None:
    s = _spec({"tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": "4"}, "requests": {"nvidia.com/gpu": 4}}})
    assert s.gpus_per_pod("prefill") == 4


def test_crd_carries_the_rules() -> None:
    from .test_crd import _spec_schema

    for role in ("prefill", "decode"):
        pool = _spec_schema()["properties"][role]
        field = pool["properties"]["tensorParallelSize"]
        assert (field["default"], field["minimum"], field["maximum"]) == (1, 1, 16)
        assert field["x-kubernetes-validations"][0]["rule"] == "self in [1, 2, 4, 8, 16]"
        assert pool["default"]["tensorParallelSize"] == 1  # the pool rules read it
        gpu_rules = [r["rule"] for r in pool["x-kubernetes-validations"] if "nvidia.com/gpu" in r["rule"]]
        assert len(gpu_rules) == 2 and all("string(self.tensorParallelSize)" in r for r in gpu_rules)


# ---- rendering ----------------------------------------------------------------------------------------

def _worker(spec: Any, role: str) -> tuple[dict[str, Any], dict[str, Any]]:
    dep = render.render_worker_deployment(OWNER, spec, role, 2, "fp")
    pod = dep["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def _shm(pod: dict[str, Any]) -> str:
    (vol,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert vol["emptyDir"]["medium"] == "Memory"
    return vol["emptyDir"]["sizeLimit"]


GPU_NODES = {"nodeSelector": {"nvidia.com/gpu.present": "true"}}


def test_tp_renders_flag_gpus_and_shm_per_pool() -> None:
    spec = _spec({"tensorParallelSize": 4}, {"tensorParallelSize": 2}, **GPU_NODES)
    for role, tp in (("prefill", 4), ("decode", 2)):
        pod, c = _worker(spec, role)
        i = c["command"].index("--tensor-parallel-size")
        assert c["command"][i + 1] == str(tp)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == tp
        assert _shm(pod) == f"{2 * tp}Gi"


def test_tp_one_renders_as_before() -> None:
    pod, c = _worker(_spec(), "decode")
    assert "--tensor-parallel-size" not in c["command"] and c["resources"] == {} and _shm(pod) == "2Gi"


def test_cpu_pools_never_request_gpus() -> None:
    spec = _spec({"tensorParallelSize": 2, "resources": {"limits": {"memory": "2Gi"}}})
    pod, c = _worker(spec, "prefill")
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {}) and "requests" not in c["resources"]
    assert c["command"][-2:] == ["--tensor-parallel-size", "2"]  # gloo ranks on CPU
    assert spec.gpus_per_pod("prefill") == 0


@pytest.mark.parametrize("gpu_signal", [
    {"prefill": {"resources": {"requests": {"nvidia.com/gpu": 8}}}},
    {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}},
])
def test_gpu_pools_get_one_gpu_per_rank(gpu_signal: dict[str, Any]) -> None:
    raw = make_spec(**{k: v for k, v in gpu_signal.items() if k != "prefill"})
    raw["prefill"].update({"tensorParallelSize": 8, **copy.deepcopy(gpu_signal.get("prefill", {}))})
    _, c = _worker(parse_spec(raw), "prefill")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    # an explicit request (equal, by the rule) is kept: requests == limits, as Kubernetes wants
    assert c["resources"].get("requests", {}).get("nvidia.com/gpu", 8) == 8


def test_user_resources_are_not_mutated_by_rendering() -> None:
    spec = _spec({"tensorParallelSize": 2}, **GPU_NODES)
    _worker(spec, "prefill")
    assert spec.prefill.resources.limits == {}


# ---- status -------------------------------------------------------------------------------------------

def test_status_reports_layout_and_gpus() -> None:
    dep = {"spec": {"replicas": 3}, "status": {"replicas": 3, "readyReplicas": 2}}
    out = st.pdcluster_status(generation=1, old_conditions=None, conditions=[], deployments={
        "prefill": dep, "decode": None, "router": dep}, desired={"prefill": 3, "decode": 2}, router_replicas=1,
        endpoint="e", autoscaler=None, now="2026-01-01T00:00:00Z", layouts={"prefill": (4, 4), "decode": (2, 0)})
    assert out["prefill"] == {"replicas": 3, "readyReplicas": 2, "desiredReplicas": 3, "tensorParallelSize": 4,
                              "gpus": 12}
    assert out["decode"]["gpus"] == 0 and out["decode"]["tensorParallelSize"] == 2
    assert "gpus" not in out["router"]


# ---- the autoscaler after a layout change -------------------------------------------------------------

LEARNED = asc.PoolState(learned_capacity=9000.0, capacity_scale=0.7, slo_breaches=3, max_need=4.0,
                        recent_needs=((NOW - 10, 4.0),), recent_bursts=((NOW - 10, 6.0),), tensor_parallel=2)


def test_same_layout_keeps_everything() -> None:
    assert LEARNED.for_layout(2, NOW) is LEARNED


def test_another_layout_starts_the_pool_afresh() -> None:
    ps = LEARNED.for_layout(4, NOW)
    assert ps == asc.PoolState(last_change=NOW, tensor_parallel=4, slo_breaches=3)


def test_a_status_from_before_tp_was_learned_at_tp_one() -> None:
    legacy = asc.PoolState(learned_capacity=9000.0)
    assert legacy.for_layout(1, NOW).learned_capacity == 9000.0
    assert legacy.for_layout(1, NOW).tensor_parallel == 1
    assert legacy.for_layout(8, NOW).learned_capacity is None


def test_status_round_trips_the_layout() -> None:
    state = asc.State(prefill=LEARNED, decode=asc.PoolState(tensor_parallel=1))
    back = st.autoscaler_state(st.autoscaler_state_status(state))
    assert (back.prefill.tensor_parallel, back.decode.tensor_parallel) == (2, 1)
    junk = st.autoscaler_state({"learnedCapacity": {"prefillTensorParallelSize": "4", "decodeTensorParallelSize": True}})
    assert (junk.prefill.tensor_parallel, junk.decode.tensor_parallel) == (None, None)


class _Source:
    def __init__(self, obs: asc.Observation) -> None:
        self.obs = obs

    def observe(self, *a: Any, **kw: Any) -> asc.Observation:
        return self.obs


async def test_capacity_learned_at_another_tp_is_not_reused() -> None:
    """Learned at TP 1 (status from before TP), the decode pool is now TP 4: its learned capacity must not
    size the pool (it would think a TP 4 pod serves what a TP 1 pod did); no spec capacity -> hold."""
    auto = {"enabled": True, "prometheusUrl": "http://prom:9090"}
    old = {"autoscaler": {"learnedCapacity": {"prefillTokensPerSecond": 10000.0, "decodeTokensPerSecond": 2000.0}}}
    obs = asc.Observation(10.0, 2000.0, 400.0)
    pools = scaling.Pools(current={"prefill": 1, "decode": 2}, ready={"prefill": 1, "decode": 2},
                          created={"prefill": NOW - 3600, "decode": NOW - 3600})

    async def step(spec: Any, status: dict[str, Any]) -> scaling.Step:
        return await scaling.step(spec, status, pools, NOW, cluster="demo", source_for=lambda u: _Source(obs),
                                  resync_seconds=60)

    same = await step(_spec(autoscaling=auto), old)
    assert same.decision is not None and same.decision.decode.capacity_source == "learned"
    s = await step(_spec(decode={"tensorParallelSize": 4}, autoscaling=auto), old)
    assert s.decision is not None
    assert (s.decision.decode.capacity_source, s.decision.decode.reason) == ("unknown", asc.CAPACITY_UNKNOWN)
    assert s.desired["decode"] == 2  # held, not sized from a TP 1 capacity
    assert s.decision.prefill.capacity_source == "learned"  # prefill's layout did not change
    learned = s.autoscaler_status["learnedCapacity"]
    assert (learned["decodeTensorParallelSize"], learned["decodeTokensPerSecond"]) == (4, None)
    assert s.autoscaler_status["lastScaleTime"]["decode"] == st.fmt_time(NOW)  # the layout change is a change
    # with a spec capacity (per instance of the new layout) the pool is sized from it at once
    spec_cap = {**auto, "capacity": {"prefillTokensPerSecond": 10000, "decodeTokensPerSecond": 8000}}
    s = await step(_spec(decode={"tensorParallelSize": 4}, autoscaling=spec_cap), old)
    assert s.decision is not None and s.decision.decode.capacity_source == "spec"
