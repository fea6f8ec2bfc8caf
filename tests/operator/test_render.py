"""Pure rendering: golden objects plus the properties every child must have."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
import yaml

from pdcluster.operator import naming, render
from pdcluster.operator.models import parse_spec

from .conftest import make_spec

GOLDEN = Path(__file__).parent / "golden" / "children.yaml"
OWNER = naming.Owner(name="llama", namespace="inference", uid="0000-1111")
FP = render.secret_fingerprint(b"k" * 32)


def _spec(**kw):
    spec = make_spec(**kw)
    spec["model"] = {"name": "llama-70b", "uri": "pvc://models/llama-70b", "dtype": "bfloat16"}
    spec["kvCache"] = {"dtype": "int8", "fullPrecisionLayers": [0, 79], "blockSize": 32}
    spec["kvTransfer"] = {"compression": "int8", "timeoutSeconds": 15, "maxRetries": 2}
    spec["router"] = {"maxQueueDepth": 512, "requestTimeoutSeconds": 120, "disaggregationThreshold": 32}
    spec["prefill"]["resources"] = {"limits": {"nvidia.com/gpu": 1}, "requests": {"cpu": 8, "memory": "64Gi"}}
    spec["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-H200"}
    spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return parse_spec(spec)


def _children():
    return render.render_children(OWNER, _spec(), {"prefill": 3, "decode": 4}, FP)


def test_golden_children() -> None:
    text = yaml.safe_dump_all(_children(), sort_keys=True)
    if os.environ.get("PDCLUSTER_UPDATE_GOLDEN") or not GOLDEN.exists():
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "rendering changed; rerun with PDCLUSTER_UPDATE_GOLDEN=1 and review the diff"


def test_every_child_is_labelled_and_owned() -> None:
    for obj in _children() + [render.render_secret(OWNER, b"x" * 32)]:
        meta = obj["metadata"]
        assert meta["namespace"] == "inference"
        assert meta["labels"]["app.kubernetes.io/instance"] == "llama"
        assert meta["labels"]["app.kubernetes.io/name"] == "pdcluster"
        (ref,) = meta["ownerReferences"]
        assert ref == {"apiVersion": "pdcluster.dev/v1alpha1", "kind": "PDCluster", "name": "llama",
                       "uid": "0000-1111", "controller": True, "blockOwnerDeletion": True}


def test_names_and_kinds() -> None:
    got = {(o["kind"], o["metadata"]["name"]) for o in _children()}
    assert got == {
        ("ConfigMap", "llama-config"),
        ("Service", "llama-prefill"), ("Service", "llama-decode"), ("Service", "llama-router"),
        ("Deployment", "llama-prefill"), ("Deployment", "llama-decode"), ("Deployment", "llama-router"),
        ("PodDisruptionBudget", "llama-prefill"), ("PodDisruptionBudget", "llama-decode"),
        ("PodDisruptionBudget", "llama-router"), ("NetworkPolicy", "llama-workers"),
    }


def _deployments():
    return {o["metadata"]["name"].split("-")[-1]: o for o in _children() if o["kind"] == "Deployment"}


def test_worker_command_carries_the_spec() -> None:
    deps = _deployments()
    prefill = deps["prefill"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert prefill[:2] == ["pdcluster", "serve"]

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1]

    assert flag(prefill, "--model") == "/models/llama-70b"
    assert flag(prefill, "--role") == "prefill"
    assert flag(prefill, "--port") == "8000"
    assert flag(prefill, "--block-size") == "32"
    assert flag(prefill, "--kv-cache-dtype") == "int8"
    assert flag(prefill, "--max-batch-tokens") == "8192"
    assert flag(prefill, "--kv-transfer-compression") == "int8"
    assert flag(prefill, "--kv-transfer-timeout") == "15"
    assert flag(prefill, "--kv-transfer-max-retries") == "2"
    assert flag(prefill, "--kv-transfer-port") == "9000"
    assert flag(prefill, "--kv-transfer-secret-file") == "/etc/pdcluster/kv-secret/key"
    assert flag(prefill, "--full-precision-layers") == "0,79"
    assert flag(prefill, "--dtype") == "bfloat16"
    decode = deps["decode"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert flag(decode, "--role") == "decode" and flag(decode, "--max-batch-size") == "16"
    router = deps["router"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert router[:2] == ["pdcluster", "router"]
    assert flag(router, "--prefill-service") == "http://llama-prefill.inference.svc:8000"
    assert flag(router, "--decode-service") == "http://llama-decode.inference.svc:8000"
    assert flag(router, "--max-queue-depth") == "512"
    assert flag(router, "--request-timeout") == "120"
    assert flag(router, "--disaggregation-threshold") == "32"


def test_pod_hardening_probes_and_scrape() -> None:
    for role, dep in _deployments().items():
        tpl = dep["spec"]["template"]
        pod = tpl["spec"]
        (c,) = pod["containers"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"] == {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                        "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        # The router's readiness falls with its decode pool; its liveness must not (a decode outage
        # would restart every router).
        assert c["livenessProbe"]["httpGet"]["path"] == ("/live" if role == "router" else "/health")
        env = {e["name"]: e for e in c["env"]}
        assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        ann = tpl["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "8000"
        assert tpl["metadata"]["labels"]["pdcluster.dev/role"] == role
        assert dep["spec"]["selector"]["matchLabels"]["pdcluster.dev/role"] == role
        assert pod["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"]["pdcluster.dev/role"] == role
    prefill = _deployments()["prefill"]
    assert prefill["spec"]["replicas"] == 3
    assert prefill["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert prefill["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    vols = {v["name"]: v for v in prefill["spec"]["template"]["spec"]["volumes"]}
    assert vols["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert vols["kv-secret"]["secret"]["secretName"] == "llama-kv-secret"


def test_network_policy_only_router_http_and_prefill_to_decode_transfer() -> None:
    (np,) = [o for o in _children() if o["kind"] == "NetworkPolicy"]
    http, transfer = np["spec"]["ingress"]
    assert http["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert http["from"][0] == {"podSelector": {"matchLabels": naming.selector_labels(OWNER, "router")}}
    assert transfer["ports"] == [{"protocol": "TCP", "port": 9000}]
    assert transfer["from"] == [{"podSelector": {"matchLabels": naming.selector_labels(OWNER, "prefill")}}]
    assert np["spec"]["policyTypes"] == ["Ingress"]


def test_secret_and_fingerprint() -> None:
    k1, k2 = render.new_kv_secret_key(), render.new_kv_secret_key()
    assert k1 != k2 and len(k1) >= 32
    sec = render.render_secret(OWNER, k1)
    assert base64.b64decode(sec["data"]["key"]) == k1
    # A new key changes the pod template, so workers restart together with matching keys.
    d1 = render.render_worker_deployment(OWNER, _spec(), "decode", 1, render.secret_fingerprint(k1))
    d2 = render.render_worker_deployment(OWNER, _spec(), "decode", 1, render.secret_fingerprint(k2))
    assert d1["spec"]["template"]["metadata"]["annotations"] != d2["spec"]["template"]["metadata"]["annotations"]


def test_rendering_is_deterministic_and_replicas_only_touch_replicas() -> None:
    a = render.render_children(OWNER, _spec(), {"prefill": 1, "decode": 1}, FP)
    b = render.render_children(OWNER, _spec(), {"prefill": 5, "decode": 1}, FP)
    assert a == render.render_children(OWNER, _spec(), {"prefill": 1, "decode": 1}, FP)
    diffs = [(x["kind"], x["metadata"]["name"]) for x, y in zip(a, b, strict=True) if x != y]
    assert diffs == [("Deployment", "llama-prefill")]


@pytest.mark.parametrize("uri,model_dir,volume", [
    ("pvc://models", "/models", "persistentVolumeClaim"),
    ("pvc://models/a/b", "/models/a/b", "persistentVolumeClaim"),
    ("hostpath:///data/tiny", "/models", "hostPath"),
    ("file:///opt/model", "/opt/model", None),
    ("/opt/model", "/opt/model", None),
])
def test_model_sources(uri, model_dir, volume) -> None:
    d, vol, _ = render.model_source(uri)
    assert d == model_dir
    assert (vol is None) == (volume is None)
    if volume:
        assert volume in vol


def test_unsupported_model_uri_is_a_render_error() -> None:
    with pytest.raises(render.RenderError):
        render.model_source("s3://bucket/model")


def test_network_policy_can_be_disabled() -> None:
    spec = make_spec(networkPolicy={"enabled": False})
    objs = render.render_children(OWNER, parse_spec(spec), {"prefill": 1, "decode": 1}, FP)
    assert not [o for o in objs if o["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("name", ["pdcluster.yaml", "pdcluster-cpu.yaml", "pdcluster-vllm.yaml"])
def test_examples_render(name: str) -> None:
    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / name).read_text())
    spec = parse_spec(doc["spec"])
    owner = naming.Owner(doc["metadata"]["name"], "demo", "uid")
    objs = render.render_children(owner, spec, {"prefill": spec.prefill.initial_replicas,
                                                "decode": spec.decode.initial_replicas}, FP)
    assert len([o for o in objs if o["kind"] == "Deployment"]) == 3


def test_integrity_reaches_the_workers_only_when_not_the_default() -> None:
    def command(spec):  # type: ignore[no-untyped-def]
        deps = {d["metadata"]["name"].rsplit("-", 1)[-1]: d for d in render.render_children(
            OWNER, spec, {"prefill": 1, "decode": 1}, FP) if d["kind"] == "Deployment"}
        return deps["prefill"]["spec"]["template"]["spec"]["containers"][0]["command"]

    assert "--kv-transfer-integrity" not in command(_spec())  # default mac: pods as they were
    spec = make_spec()
    spec["kvTransfer"] = {"backend": "nixl", "integrity": "fabric"}
    cmd = command(parse_spec(spec))
    assert cmd[cmd.index("--kv-transfer-integrity") + 1] == "fabric"
    bad = make_spec()
    bad["kvTransfer"] = {"integrity": "none"}
    with pytest.raises(Exception, match="integrity"):
        parse_spec(bad)


def test_vllm_example_keeps_the_users_vllm_deployment() -> None:
    """examples/pdcluster-vllm.yaml maps a plain `vllm serve` Deployment: the pods run the user's image and model
    name, their flags after the operator's, and the KV connector the operator adds."""
    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "pdcluster-vllm.yaml").read_text())
    spec = parse_spec(doc["spec"])
    owner = naming.Owner(doc["metadata"]["name"], "demo", "uid")
    deps = {d["metadata"]["name"].rsplit("-", 1)[-1]: d for d in render.render_children(
        owner, spec, {"prefill": 1, "decode": 2}, FP) if d["kind"] == "Deployment"}
    for role in ("prefill", "decode"):
        c = deps[role]["spec"]["template"]["spec"]["containers"][0]
        argv = [*c.get("command", []), *c.get("args", [])]
        assert c["image"] == "vllm/vllm-openai:v0.11.0"
        assert argv[argv.index("--served-model-name") + 1] == "llama-3.1-8b-instruct"
        assert argv[-3:] == ["--enable-prefix-caching", "--kv-cache-dtype", "fp8"]
        assert '"kv_buffer_device":"cuda"' in argv[argv.index("--kv-transfer-config") + 1]
