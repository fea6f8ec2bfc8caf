"""Real-node scenario 3, in-cluster half: a client pod asks the router through its ClusterIP Service.

The pod runs the worker image (already on the node; Python's stdlib is the whole client) and calls
`http://<pdc>-router.<ns>.svc:<port>`: CoreDNS answers the Service's ClusterIP, and kube-proxy's iptables
rules (masqueradeAll) carry the connection through the host back into the bridge to the router pod, which
sends it prefill -> decode. The pod prints what it resolved and each completion as JSON lines and exits
non-zero on any error. Its answers must equal, token for token, those through `kubectl port-forward
svc/<pdc>-router` (test_12_completion checks that path against `pdcluster serve` here)."""

from __future__ import annotations

import ipaddress
import json
import uuid
from typing import Any

from node_e2e import SERVICE_CIDR, assert_route_to, assert_routes, dump, http_json, port_forward
from pdc_e2e import Kube, wait_until

PROMPTS = ["Hello, my name is",
           # > 16 prompt tokens (the example's disaggregationThreshold): prefill pod -> KV -> decode pod
           "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly and a "
           "wizard's job is to vex chumps quickly in fog; pack my box with five dozen jugs"]
MAX_TOKENS = 12

# what the pod runs (python3 -c SCRIPT BASE_URL PROMPTS_JSON MAX_TOKENS)
CLIENT = """
import json, socket, sys, urllib.request
base, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
host = base.split("//", 1)[1].rsplit(":", 1)[0]
print(json.dumps({"host": host, "resolved": socket.gethostbyname(host)}), flush=True)
def call(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())
model = call("/v1/models")["data"][0]["id"]
for p in prompts:
    out = call("/v1/completions", {"model": model, "prompt": p, "max_tokens": max_tokens,
                                   "temperature": 0, "return_token_ids": True})
    print(json.dumps({"prompt": p, "choice": out["choices"][0], "usage": out["usage"]}), flush=True)
"""


def _client_pod(name: str, image: str, base: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "pdcluster-e2e-client"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [{
                "name": "client", "image": image, "imagePullPolicy": "Never",
                "command": ["python3", "-c", CLIENT, base, json.dumps(PROMPTS), str(MAX_TOKENS)],
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
                "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "readOnlyRootFilesystem": True,
                                    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
            }],
        },
    }


def _phase(kube: Kube, ns: str, name: str) -> str | None:
    phase = ((kube.get("pod", name, ns) or {}).get("status") or {}).get("phase")
    return phase if phase in ("Succeeded", "Failed") else None


def test_client_pod_reaches_router_through_cluster_ip(kube: Kube, app_ns: str, example_name: str):
    svc = kube.json("get", "service", f"{example_name}-router", "-n", app_ns)
    cluster_ip, port = svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["port"]
    assert ipaddress.ip_address(cluster_ip) in ipaddress.ip_network(SERVICE_CIDR), cluster_ip
    (router,) = kube.json("get", "deploy", f"{example_name}-router", "-n", app_ns)["spec"]["template"]["spec"][
        "containers"]
    base = f"http://{example_name}-router.{app_ns}.svc:{port}"
    pod = f"client-{uuid.uuid4().hex[:6]}"
    # the hard network rule, before any traffic: pod/Service ranges via the bridge, PDC-NODE-FWD first
    assert_routes()
    assert_route_to(cluster_ip)
    kube.apply(_client_pod(pod, router["image"], base), ns=app_ns)
    try:
        phase = wait_until(f"client pod {pod} finished", lambda: _phase(kube, app_ns, pod), timeout=240, interval=1)
        logs = kube.run("logs", pod, "-n", app_ns).stdout
        assert phase == "Succeeded", f"client pod {phase}:\n{logs}"
        first, *answers = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
        # the name resolved (CoreDNS) to the Service's ClusterIP: only kube-proxy's DNAT makes that address work
        assert first == {"host": f"{example_name}-router.{app_ns}.svc", "resolved": cluster_ip}, first
        assert [a["prompt"] for a in answers] == PROMPTS, logs
        assert answers[1]["usage"]["prompt_tokens"] > 16, answers[1]["usage"]

        with port_forward(kube, app_ns, f"svc/{example_name}-router", port) as lport:
            model = http_json(f"http://127.0.0.1:{lport}/v1/models")["data"][0]["id"]
            want = [http_json(f"http://127.0.0.1:{lport}/v1/completions",
                              {"model": model, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                               "return_token_ids": True})["choices"][0] for p in PROMPTS]
        for a, w in zip(answers, want, strict=True):
            assert a["usage"]["completion_tokens"] >= 1, a
            assert (a["choice"]["token_ids"], a["choice"]["text"]) == (w["token_ids"], w["text"]), (a, w)
        print(f"\nclient pod {pod}: {base} -> {cluster_ip}: {[a['choice']['text'] for a in answers]}")
    except BaseException:
        print(kube.run("logs", pod, "-n", app_ns, check=False).stdout[-4000:])
        print(dump(kube, app_ns))
        raise
    finally:
        kube.run("delete", "pod", pod, "-n", app_ns, "--wait=true", "--timeout=60s", check=False)
