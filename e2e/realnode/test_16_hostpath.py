"""Real-node scenario 2b: a PDCluster whose model is `hostpath:///DIR` is served: the kubelet mounts the
node's folder (a demo model built here with another seed than the image's /models/demo) at /models, the
pods serve it under the CRD's `spec.model.name` (not the mounted folder's name), and a completion through the
router Service sent with that name equals `pdcluster serve` here on that folder."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from node_e2e import CLUSTER_DIR, NODE_NAME, dump, http_json, local_serve, pods, port_forward
from pdc_e2e import Kube, example_pdc, wait_ready

NAME = "tiny-hostpath"
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def host_model() -> Iterator[Path]:
    """A demo model on the node's filesystem (this machine), readable by the pods' uid 65532."""
    from pdcluster.worker.local.demo_model import build_demo_model

    folder = CLUSTER_DIR / "hostpath-models" / "demo-seed7"
    if not (folder / "model.safetensors").is_file():
        build_demo_model(folder, seed=7, num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                         num_attention_heads=4, num_key_value_heads=2)
    for p in [folder, *folder.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    yield folder


def test_hostpath_model_is_mounted_and_served(kube: Kube, app_ns: str, host_model: Path):
    doc = example_pdc(NAME, model={"uri": f"hostpath://{host_model}"})
    kube.apply(doc, ns=app_ns)
    try:
        wait_ready(kube, app_ns, NAME, timeout=420)
        (decode,) = pods(kube, app_ns, f"app.kubernetes.io/instance={NAME},pdcluster.dev/role=decode")
        assert decode["spec"]["nodeName"] == NODE_NAME
        vols = {v["name"]: v for v in decode["spec"]["volumes"]}
        assert vols["model"]["hostPath"]["path"] == str(host_model), vols
        args = decode["spec"]["containers"][0].get("command", []) + decode["spec"]["containers"][0].get("args", [])
        assert args[args.index("--model") + 1] == "/models", args
        # the weights the pod sees are the node's file (not the image's /models/demo)
        remote = kube.run("exec", "-n", app_ns, decode["metadata"]["name"], "--", "python3.11", "-c",
                          "import hashlib; print(hashlib.sha256(open('/models/model.safetensors','rb')"
                          ".read()).hexdigest())").stdout.strip()
        assert remote == hashlib.sha256((host_model / "model.safetensors").read_bytes()).hexdigest()

        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        with local_serve(host_model) as lport:
            model = http_json(f"http://127.0.0.1:{lport}/v1/models")["data"][0]["id"]
            want = http_json(f"http://127.0.0.1:{lport}/v1/completions", {**body, "model": model})["choices"][0]
        served = doc["spec"]["model"]["name"]
        assert served != "models"  # the folder mounted at /models: what the pods served before the fix
        with port_forward(kube, app_ns, f"svc/{NAME}-router", 8000) as port:
            listed = [m["id"] for m in http_json(f"http://127.0.0.1:{port}/v1/models")["data"]]
            assert listed == [served], listed
            got = http_json(f"http://127.0.0.1:{port}/v1/completions", {**body, "model": served})["choices"][0]
        assert (got["token_ids"], got["text"]) == (want["token_ids"], want["text"]), (got, want)
    except BaseException:
        print(dump(kube, app_ns))
        raise
    finally:
        kube.run("delete", "pdc", NAME, "-n", app_ns, "--wait=true", "--timeout=120s", check=False)
