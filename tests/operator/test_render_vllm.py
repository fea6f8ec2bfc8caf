"""`spec.engine`: vLLM pods rendered from a PDCluster, what `engine: vllm` refuses, and the served model name
both engines' pods get (pure rendering and validation, no cluster)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from pydantic import ValidationError

from pdcluster.operator import models, naming, render, render_vllm
from pdcluster.operator.models import NIXL_SIDE_CHANNEL_PORT, parse_spec

from .test_crd import _defaults, _errors, _spec_schema

OWNER = naming.Owner(name="chat", namespace="serving", uid="u-1")
FP = render.secret_fingerprint(b"k" * 32)
VLLM = {"model": {"name": "llama-3-8b", "uri": "pvc://models/llama3", "maxModelLen": 4096},
        "engine": "vllm", "kvTransfer": {"integrity": "fabric"}}


def _children(spec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    objs = render.render_children(OWNER, parse_spec(spec), {"prefill": 1, "decode": 2}, FP)
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def _container(dep: dict[str, Any]) -> dict[str, Any]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def _flag(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def _env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_vllm_cpu_pods_run_the_openai_server_with_the_nixl_connector() -> None:
    kids = _children(VLLM)
    for role in ("prefill", "decode"):
        dep = kids[("Deployment", f"chat-{role}")]
        c = _container(dep)
        cmd = c["command"]
        assert cmd[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        assert _flag(cmd, "--served-model-name") == "llama-3-8b"
        assert _flag(cmd, "--model") == "/models/llama3"
        assert _flag(cmd, "--port") == "8000" and _flag(cmd, "--host") == "0.0.0.0"
        assert json.loads(_flag(cmd, "--kv-transfer-config")) == {
            "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
            "kv_load_failure_policy": "recompute"}  # a failed KV read recomputed, not a 500 inside the stream
        assert _flag(cmd, "--max-model-len") == "4096"
        assert _flag(cmd, "--tensor-parallel-size") == "1"
        assert "--gpu-memory-utilization" not in cmd  # a CPU pool sizes KV from VLLM_CPU_KVCACHE_SPACE
        assert "--block-size" not in cmd  # vLLM's CPU attention picks its own (multiples of 32)
        assert c["image"] == models.DEFAULT_VLLM_IMAGE
        env = _env(c)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(NIXL_SIDE_CHANNEL_PORT)
        assert env["UCX_TLS"] == "tcp,sm,self" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        assert env["PDCLUSTER_ROLE"] == role
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8000, "nixl": NIXL_SIDE_CHANNEL_PORT}
        assert c["lifecycle"]["preStop"]["exec"]["command"] == render_vllm.drain_command(parse_spec(VLLM))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels["llm-d.ai/role"] == role and labels[naming.ROLE_LABEL] == role
        # no pdcluster KV secret or transfer port: vLLM's transfer does not use them
        assert {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]} == {"tmp", "dshm", "model"}
        svc = kids[("Service", f"chat-{role}")]
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"http": 8000, "nixl": NIXL_SIDE_CHANNEL_PORT}
    router = _container(kids[("Deployment", "chat-router")])
    assert _flag(router["command"], "--engine") == "vllm"
    assert router["image"] == models.DEFAULT_WORKER_IMAGE  # the router is ours whatever the engine


def test_vllm_gpu_pools_put_kv_on_cuda_and_shard_per_pool() -> None:
    spec = copy.deepcopy(VLLM)
    spec["prefill"] = {"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 2}},
                       "image": "vllm/vllm-openai:v0.11.0", "engineArgs": ["--enforce-eager"]}
    spec["decode"] = {"tensorParallelSize": 1, "resources": {"limits": {"nvidia.com/gpu": 1}}}
    spec["kvCache"] = {"gpuMemoryUtilization": 0.85}
    kids = _children(spec)
    p = _container(kids[("Deployment", "chat-prefill")])
    d = _container(kids[("Deployment", "chat-decode")])
    assert json.loads(_flag(p["command"], "--kv-transfer-config"))["kv_buffer_device"] == "cuda"
    assert _flag(p["command"], "--tensor-parallel-size") == "2" and _flag(d["command"], "--tensor-parallel-size") == "1"
    assert _flag(p["command"], "--gpu-memory-utilization") == "0.85"
    assert _flag(p["command"], "--block-size") == "16"
    assert p["command"][-1] == "--enforce-eager" and "--enforce-eager" not in d["command"]
    assert p["image"] == "vllm/vllm-openai:v0.11.0" and d["image"] == models.DEFAULT_VLLM_IMAGE
    assert p["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert [x["containerPort"] for x in p["ports"] if x["name"].startswith("nixl")] == [5600, 5601]
    assert "UCX_TLS" not in _env(p)  # GPU nodes: UCX picks RDMA / NVLink / cuda_ipc itself
    policy = kids[("NetworkPolicy", naming.network_policy_name(OWNER))]
    (http, workers) = policy["spec"]["ingress"]
    assert http["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert {"protocol": "TCP", "port": 5600, "endPort": 5601} in workers["ports"]
    assert {"protocol": "TCP", "port": render_vllm.UCX_PORTS[0], "endPort": render_vllm.UCX_PORTS[1]} in workers["ports"]
    assert {p["podSelector"]["matchLabels"][naming.ROLE_LABEL] for p in workers["from"]} == {"prefill", "decode"}
    assert _env(p)["UCX_TCP_PORT_RANGE"] == "5700-5799"


def test_a_pool_env_replaces_a_vllm_default_instead_of_duplicating_it() -> None:
    spec = copy.deepcopy(VLLM)
    spec["decode"] = {"env": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0-7"},
                              {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "2"}]}
    c = _container(_children(spec)[("Deployment", "chat-decode")])
    names = [e["name"] for e in c["env"]]
    assert names.count("VLLM_CPU_OMP_THREADS_BIND") == 1 and _env(c)["VLLM_CPU_OMP_THREADS_BIND"] == "0-7"
    assert _env(c)["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_our_engine_serves_the_crd_model_name_and_takes_engine_args() -> None:
    spec = {"model": {"name": "pdcluster-demo", "uri": "hostpath:///srv/models/demo"},
            "decode": {"engineArgs": ["--threads", "2"]}}
    kids = _children(spec)
    for role in ("prefill", "decode"):
        dep = kids[("Deployment", f"chat-{role}")]
        cmd = _container(dep)["command"]
        assert cmd[:2] == ["pdcluster", "serve"]
        assert _flag(cmd, "--served-model-name") == "pdcluster-demo"
        assert dep["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"] == role
    assert _container(kids[("Deployment", "chat-decode")])["command"][-2:] == ["--threads", "2"]
    assert "--engine" not in _container(kids[("Deployment", "chat-router")])["command"]


# What engine vllm cannot honour: refused by the pydantic model and left to a CEL rule by the structural schema.
REFUSED = [
    ("int8-cache", {"kvCache": {"dtype": "int8"}}, "kvCache.dtype"),
    ("full-precision-layers", {"kvCache": {"fullPrecisionLayers": [0]}}, "fullPrecisionLayers"),
    ("swap", {"kvCache": {"preemption": "swap"}}, "recompute"),
    ("int8-wire", {"kvTransfer": {"integrity": "fabric", "compression": "int8"}}, "wire format"),
    ("tcp", {"kvTransfer": {"integrity": "fabric", "backend": "tcp"}}, "NIXL only"),
    ("mac", {"kvTransfer": {"integrity": "mac"}}, "integrity: fabric"),
    ("reserved-flag", {"decode": {"engineArgs": ["--served-model-name=x"]}}, "engineArgs"),
]


@pytest.mark.parametrize("patch,words", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_engine_vllm_refuses_what_it_cannot_honour(patch: dict[str, Any], words: str) -> None:
    spec = {**copy.deepcopy(VLLM), **patch}
    with pytest.raises(ValidationError, match=words.replace(".", r"\.")):
        parse_spec(spec)
    assert _errors(_spec_schema(), _defaults(_spec_schema(), copy.deepcopy(spec))) == []  # a CEL rule's job
    rules = [r for n in ([_spec_schema()] + [_spec_schema()["properties"][p] for p in ("prefill", "decode")])
             for r in n.get("x-kubernetes-validations", [])]
    assert any(words in r["message"] for r in rules), f"no CEL rule says {words!r}"


def test_the_same_knobs_stay_valid_for_our_engine() -> None:
    spec = {**copy.deepcopy(VLLM), "engine": "pdcluster", "kvCache": {"dtype": "int8"},
            "kvTransfer": {"compression": "int8", "backend": "tcp"}}
    assert parse_spec(spec).kvTransfer.compression == "int8"
    assert parse_spec(VLLM).engine == "vllm" and parse_spec({"model": VLLM["model"]}).engine == "pdcluster"
