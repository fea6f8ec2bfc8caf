"""Cross-component contracts: what the operator renders must be what the worker and router accept.

The operator and the worker are built and released separately, so a flag renamed on one side would
only show up as a crash-looping pod. These tests parse the rendered command lines with the real
argument parsers of `pdcluster serve` and `pdcluster router`.
"""

from __future__ import annotations

import argparse
import pathlib

import pytest
import yaml

from pdcluster.operator import models, naming, render
from pdcluster.worker.router import cli as router_cli
from pdcluster.worker.server import cli as serve_cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
# our engine's examples: an `engine: vllm` example's commands are vLLM's, parsed with vLLM's own CLI in
# tests/operator/test_vllm_command_contract.py
EXAMPLES = [p for p in sorted((ROOT / "examples").glob("*.yaml"))
            if yaml.safe_load(p.read_text())["spec"].get("engine", "pdcluster") == "pdcluster"]


def _parser(module) -> argparse.ArgumentParser:  # type: ignore[no-untyped-def]
    p = argparse.ArgumentParser(exit_on_error=False)
    module.add_arguments(p)
    return p


def _children(path: pathlib.Path) -> list[dict]:
    body = yaml.safe_load(path.read_text())
    body["metadata"].setdefault("uid", "0000")
    owner = naming.Owner.from_body(body)
    spec = models.parse_spec(body["spec"])
    return render.render_children(owner, spec, {"prefill": 2, "decode": 3}, "fingerprint")


def _container(deploy: dict) -> dict:
    return deploy["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_rendered_commands_parse_with_the_real_clis(example: pathlib.Path) -> None:
    deployments = {d["metadata"]["name"].rsplit("-", 1)[1]: d for d in _children(example)
                   if d["kind"] == "Deployment"}
    assert set(deployments) == {"prefill", "decode", "router"}
    for role in ("prefill", "decode"):
        cmd = _container(deployments[role])["command"]
        assert cmd[:2] == ["pdcluster", "serve"]
        args = _parser(serve_cli).parse_args(cmd[2:])
        assert args.role == role
        assert args.host == "0.0.0.0", "a worker bound to loopback is unreachable from the router pod"
        assert args.kv_transfer_secret_file
    cmd = _container(deployments["router"])["command"]
    assert cmd[:2] == ["pdcluster", "router"]
    args = _parser(router_cli).parse_args(cmd[2:])
    assert args.host == "0.0.0.0"
    assert args.prefill_service and args.decode_service


def test_worker_ports_match_the_probes() -> None:
    for d in _children(EXAMPLES[0]):
        if d["kind"] != "Deployment":
            continue
        c = _container(d)
        port = int(c["command"][c["command"].index("--port") + 1])
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["readinessProbe"]["httpGet"]["port"] in (port, "http")
        assert any(p["containerPort"] == port for p in c["ports"])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_spec_fields_reach_the_engine_config(example: pathlib.Path) -> None:
    """Every KV/batching field of the spec must end up in EngineConfig, not only in a ConfigMap."""
    from pdcluster.worker.engine.llm_engine import EngineConfig

    body = yaml.safe_load(example.read_text())
    spec = models.parse_spec(body["spec"])
    decode = next(d for d in _children(example)
                  if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-decode"))
    args = _parser(serve_cli).parse_args(_container(decode)["command"][2:])
    config = serve_cli.make_config(EngineConfig, serve_cli.engine_config_kwargs(args))
    assert config.block_size == spec.kvCache.blockSize
    assert config.kv_cache_dtype == spec.kvCache.dtype
    assert config.watermark == pytest.approx(spec.kvCache.swapWatermark)
    assert config.preemption_mode == spec.kvCache.preemption
    assert config.swap_space == pytest.approx(spec.kvCache.swapSpaceGiB)
    assert tuple(config.full_precision_layers) == tuple(spec.kvCache.fullPrecisionLayers)
    assert config.max_batch_size == spec.decode.maxBatchSize
    assert config.max_model_len == spec.model.maxModelLen


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_each_pools_tensor_parallel_size_reaches_serve(example: pathlib.Path) -> None:
    """spec.<pool>.tensorParallelSize (issue 16) is the worker's --tensor-parallel-size, pool by pool."""
    spec = models.parse_spec(yaml.safe_load(example.read_text())["spec"])
    for d in _children(example):
        role = d["metadata"]["name"].rsplit("-", 1)[1]
        if d["kind"] != "Deployment" or role == "router":
            continue
        args = _parser(serve_cli).parse_args(_container(d)["command"][2:])
        assert args.tensor_parallel_size == spec.pool(role).tensorParallelSize
