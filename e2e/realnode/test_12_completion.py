"""Real-node scenario 3: a completion through the router Service (`kubectl port-forward svc/...`) returns
the same greedy tokens as `pdcluster serve` run here on the same model; a prompt above the example's
disaggregation threshold goes prefill pod -> KV transfer -> decode pod (the workers' metrics show it)."""

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


def _complete(port: int, prompt: str, model: str) -> dict[str, Any]:
    return http_json(f"http://127.0.0.1:{port}/v1/completions",
                     {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                      "return_token_ids": True})


def _model_id(port: int) -> str:
    return str(http_json(f"http://127.0.0.1:{port}/v1/models")["data"][0]["id"])


def _kv_bytes(kube: Kube, ns: str, name: str, role: str) -> float:
    total = 0.0
    for p in pods(kube, ns, f"app.kubernetes.io/instance={name},pdcluster.dev/role={role}"):
        ip = p["status"]["podIP"]
        assert_route_to(ip)  # the hard network rule, checked before each request to a pod address
        total += metric_sum(http_text(f"http://{ip}:8000/metrics"), "pdcluster_kv_transfer_bytes_total")
    return total


@pytest.mark.xfail(strict=False, reason=(
    "open defect (issue 11): in the real-node cluster the long prompt's first token (the prefill pod's) is "
    "missing from the router's answer and the short prompt's text differs for equal ids; the same prompts "
    "through `pdcluster up` (tcp and nixl backends) agree exactly with a worker alone, so the cause is in "
    "what the pods run (image contents or rendered flags), not yet found"))
def test_router_service_answers_like_local_serve(kube: Kube, app_ns: str, example_name: str,
                                                local_model: Path):
    name = example_name
    try:
        # the image's model is byte-identical to the one built here
        (decode, *_) = pods(kube, app_ns, f"app.kubernetes.io/instance={name},pdcluster.dev/role=decode")
        remote = kube.run("exec", "-n", app_ns, decode["metadata"]["name"], "--", "python3.11", "-c",
                          "import hashlib; print(hashlib.sha256(open('/models/demo/model.safetensors','rb')"
                          ".read()).hexdigest())").stdout.strip()
        assert remote == hashlib.sha256((local_model / "model.safetensors").read_bytes()).hexdigest()

        with local_serve(local_model) as lport:
            want = {p: _complete(lport, p, _model_id(lport))["choices"][0] for p in (SHORT_PROMPT, LONG_PROMPT)}
        kv0 = _kv_bytes(kube, app_ns, name, "prefill") + _kv_bytes(kube, app_ns, name, "decode")
        with port_forward(kube, app_ns, f"svc/{name}-router", 8000) as port:
            model = _model_id(port)
            got = {p: _complete(port, p, model) for p in (SHORT_PROMPT, LONG_PROMPT)}
        for p in (SHORT_PROMPT, LONG_PROMPT):
            c = got[p]["choices"][0]
            assert c["token_ids"] == want[p]["token_ids"], (p, c, want[p])
            assert got[p]["usage"]["completion_tokens"] == len(want[p]["token_ids"])
        assert got[LONG_PROMPT]["usage"]["prompt_tokens"] > 16, got[LONG_PROMPT]["usage"]
        # the long prompt's KV crossed from the prefill pod to the decode pod
        kv1 = _kv_bytes(kube, app_ns, name, "prefill") + _kv_bytes(kube, app_ns, name, "decode")
        assert kv1 > kv0, (kv0, kv1)
        print(f"\nKV bytes moved between the pods: {kv1 - kv0:.0f}")
        # and the same text (checked last: the token ids and the KV path are facts of their own)
        for p in (SHORT_PROMPT, LONG_PROMPT):
            assert got[p]["choices"][0]["text"] == want[p]["text"], (p, got[p]["choices"][0], want[p])
    except BaseException:
        print(dump(kube, app_ns))
        raise
