"""Real-node scenario 3: a completion through the router Service (`kubectl port-forward svc/...`) returns
the same greedy tokens and text as `pdcluster serve` run here on the same model folder (copied out of the
pod); a prompt above the example's disaggregation threshold goes prefill pod -> KV transfer -> decode pod
(the workers' metrics show it). The image's /models/demo is also byte-identical to the demo model built
here: until the demo tokenizer's corpus shipped with the package it was trained on the interpreter's own
stdlib, and Debian's python3.11 (3.11.2) in the image gave another vocabulary than this venv's 3.11.7."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from node_e2e import assert_route_to, dump, http_json, http_text, local_serve, metric_sum, pods, port_forward
from pdc_e2e import Kube

# > 16 prompt tokens (the example's disaggregationThreshold) for the demo tokenizer
LONG_PROMPT = ("The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly "
               "and a wizard's job is to vex chumps quickly in fog; pack my box with five dozen jugs")
SHORT_PROMPT = "Hello, my name is"


@pytest.fixture(scope="module")
def local_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model built here by the same code as the image's /models/demo (fixed seed)."""
    from pdcluster.worker.local.launcher import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("demo"))


def _digests(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir()) if f.is_file()}


def _copy_pod_model(kube: Kube, ns: str, pod: str, dest: Path) -> Path:
    """The pod's /models/demo, file by file (`kubectl cp` = tar over exec: the API server -> kubelet path)."""
    kube.run("cp", f"{ns}/{pod}:/models/demo", str(dest), timeout=180)
    assert (dest / "model.safetensors").is_file(), sorted(dest.iterdir())
    return dest


def _complete(port: int, prompt: str, model: str) -> dict[str, Any]:
    return http_json(f"http://127.0.0.1:{port}/v1/completions",
                     {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                      "return_token_ids": True})


def _model_id(port: int) -> str:
    return str(http_json(f"http://127.0.0.1:{port}/v1/models")["data"][0]["id"])


def _kv(kube: Kube, ns: str, name: str, metric: str = "pdcluster_kv_transfer_bytes_total") -> float:
    """Sum of a KV-transfer counter over the PDCluster's prefill and decode pods."""
    total = 0.0
    for role in ("prefill", "decode"):
        for p in pods(kube, ns, f"app.kubernetes.io/instance={name},pdcluster.dev/role={role}"):
            ip = p["status"]["podIP"]
            assert_route_to(ip)  # the hard network rule, checked before each request to a pod address
            total += metric_sum(http_text(f"http://{ip}:8000/metrics"), metric)
    return total


def test_image_demo_model_is_the_one_built_here(kube: Kube, app_ns: str, example_name: str,
                                                local_model: Path, tmp_path: Path):
    """Every file (weights, config, tokenizer) of the image's demo model equals the demo model built by this
    interpreter: the demo model does not depend on which Python builds it."""
    (decode, *_) = pods(kube, app_ns, f"app.kubernetes.io/instance={example_name},pdcluster.dev/role=decode")
    remote = _copy_pod_model(kube, app_ns, decode["metadata"]["name"], tmp_path / "pod-model")
    assert _digests(remote) == _digests(local_model)


def test_router_service_answers_like_local_serve(kube: Kube, app_ns: str, example_name: str,
                                                tmp_path: Path):
    name = example_name
    try:
        # `pdcluster serve` here on the very folder the pods serve
        (decode, *_) = pods(kube, app_ns, f"app.kubernetes.io/instance={name},pdcluster.dev/role=decode")
        pod_model = _copy_pod_model(kube, app_ns, decode["metadata"]["name"], tmp_path / "pod-model")

        with local_serve(pod_model) as lport:
            want = {p: _complete(lport, p, _model_id(lport))["choices"][0] for p in (SHORT_PROMPT, LONG_PROMPT)}
        kv0, fail0 = _kv(kube, app_ns, name), _kv(kube, app_ns, name, "pdcluster_kv_transfer_failures_total")
        with port_forward(kube, app_ns, f"svc/{name}-router", 8000) as port:
            model = _model_id(port)
            got = {p: _complete(port, p, model) for p in (SHORT_PROMPT, LONG_PROMPT)}
        for p in (SHORT_PROMPT, LONG_PROMPT):
            c = got[p]["choices"][0]
            assert c["token_ids"] == want[p]["token_ids"], (p, c, want[p])
            assert got[p]["usage"]["completion_tokens"] == len(want[p]["token_ids"])
        assert got[LONG_PROMPT]["usage"]["prompt_tokens"] > 16, got[LONG_PROMPT]["usage"]
        # the long prompt's KV crossed from the prefill pod to the decode pod, and no transfer failed (a
        # failed one is retried by the router on the decode pod alone: same tokens, so only this shows it)
        kv1, fail1 = _kv(kube, app_ns, name), _kv(kube, app_ns, name, "pdcluster_kv_transfer_failures_total")
        assert (kv1 > kv0, fail1 - fail0) == (True, 0), (kv0, kv1, fail0, fail1)
        print(f"\nKV bytes moved between the pods: {kv1 - kv0:.0f}")
        # and the same text (checked last: the token ids and the KV path are facts of their own)
        for p in (SHORT_PROMPT, LONG_PROMPT):
            assert got[p]["choices"][0]["text"] == want[p]["text"], (p, got[p]["choices"][0], want[p])
    except BaseException:
        print(dump(kube, app_ns))
        raise
