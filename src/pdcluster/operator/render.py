"""Pure rendering: (PDCluster identity, validated spec, replica counts, KV secret) -> child objects.

No I/O. Every object carries the standard labels and a controller owner reference to the PDCluster, so
Kubernetes garbage-collects children when the PDCluster is deleted. The operator applies these with
server-side apply; fields it does not render (status, defaults the API server fills in) stay untouched. What
differs for `engine: vllm` pods is in `render_vllm`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import secrets
from typing import Any

from pdcluster.operator import (  # render_vllm builds on this module's pieces (at call time)
    models,
    render_vllm,
)
from pdcluster.operator.models import KV_TRANSFER_PORT, WORKER_PORT, PDClusterSpec
from pdcluster.operator.naming import (
    WORKER_ROLES,
    Owner,
    child_name,
    config_map_name,
    instance_labels,
    meta,
    role_labels,
    secret_name,
    selector_labels,
    service_url,
)
from pdcluster.operator.parallel import GPU_RESOURCE, shm_size_limit
from pdcluster.operator.podoptions import apply_pod_options
from pdcluster.operator.policies import render_network_policy, render_pdb

ROLES = ("prefill", "decode", "router")
KV_SECRET_KEY = "key"
KV_SECRET_DIR = "/etc/pdcluster/kv-secret"
CONFIG_DIR = "/etc/pdcluster/config"
MODEL_MOUNT = "/models"
RUN_AS = 65532


class RenderError(ValueError):
    """A spec the schema accepted but the operator cannot render (reported as Degraded)."""


# ---- model volume ----------------------------------------------------------------------------------

def model_source(uri: str) -> tuple[str, dict[str, Any] | None, str | None]:
    """(model dir inside the container, volume or None, subPath or None) for a model URI."""
    if uri.startswith("pvc://"):
        rest = uri[len("pvc://"):]
        claim, _, sub = rest.partition("/")
        if not claim:
            raise RenderError(f"model.uri {uri!r}: missing claim name")
        sub = sub.strip("/")
        vol = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        return (f"{MODEL_MOUNT}/{sub}" if sub else MODEL_MOUNT), vol, None
    if uri.startswith("hostpath://"):
        path = uri[len("hostpath://"):]
        if not path.startswith("/") or path == "/":
            raise RenderError(f"model.uri {uri!r}: hostpath needs an absolute directory")
        return MODEL_MOUNT, {"name": "model", "hostPath": {"path": path, "type": "Directory"}}, None
    if uri.startswith("file://"):
        path = uri[len("file://"):]
        if not path.startswith("/"):
            raise RenderError(f"model.uri {uri!r}: file:// needs an absolute path")
        return path, None, None
    if uri.startswith("/"):
        return uri, None, None
    raise RenderError(f"model.uri {uri!r}: unsupported scheme (use pvc://, hostpath://, file:// or /path)")


# ---- worker and router commands --------------------------------------------------------------------

def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def worker_command(spec: PDClusterSpec, role: str, model_dir: str) -> list[str]:
    pool = spec.prefill if role == "prefill" else spec.decode
    kv, tr = spec.kvCache, spec.kvTransfer
    cmd = [
        "pdcluster", "serve",
        "--model", model_dir,
        "--role", role,
        "--served-model-name", spec.model.name,  # the name clients send, not the mounted folder's
        # Both servers default to loopback for local use; in a pod they must listen on all interfaces.
        "--host", "0.0.0.0",
        "--port", str(WORKER_PORT),
        "--block-size", str(kv.blockSize),
        "--kv-cache-dtype", kv.dtype,
        "--max-batch-size", str(pool.maxBatchSize),
        "--max-batch-tokens", str(pool.maxBatchTokens),
        "--kv-transfer-compression", tr.compression,
        "--kv-transfer-backend", tr.backend,  # integrity only when set: pods of before stay unchanged
        *(["--kv-transfer-integrity", tr.integrity] if tr.integrity != "mac" else []),
        "--kv-transfer-timeout", _num(tr.timeoutSeconds),
        "--kv-transfer-max-retries", str(tr.maxRetries),
        "--kv-transfer-port", str(KV_TRANSFER_PORT),
        "--kv-transfer-secret-file", f"{KV_SECRET_DIR}/{KV_SECRET_KEY}",
        "--swap-space", _num(kv.swapSpaceGiB),
        "--preemption", kv.preemption,
        "--gpu-memory-utilization", _num(kv.gpuMemoryUtilization),
        "--swap-watermark", _num(kv.swapWatermark),
    ]
    if spec.model.maxModelLen:
        cmd += ["--max-model-len", str(spec.model.maxModelLen)]
    if spec.model.dtype != "auto":
        cmd += ["--dtype", spec.model.dtype]
    if kv.fullPrecisionLayers:
        cmd += ["--full-precision-layers", ",".join(str(i) for i in kv.fullPrecisionLayers)]
    if pool.tensorParallelSize > 1:  # TP 1 renders as before: no rollout of existing pools on upgrade
        cmd += ["--tensor-parallel-size", str(pool.tensorParallelSize)]
    return cmd + list(pool.engineArgs)


def router_command(owner: Owner, spec: PDClusterSpec) -> list[str]:
    r = spec.router
    return [
        "pdcluster", "router",
        "--prefill-service", service_url(owner, "prefill"),
        "--decode-service", service_url(owner, "decode"),
        "--host", "0.0.0.0",
        "--port", str(WORKER_PORT),
        "--cluster-name", owner.name,
        "--max-queue-depth", str(r.maxQueueDepth),
        "--request-timeout", _num(r.requestTimeoutSeconds),
        "--disaggregation-threshold", str(r.disaggregationThreshold),
        # the declared TTFT target also drives the router's load-driven aggregation (router/aggregate.py); unset,
        # the flag is left out and the router command (so the pod) is what it was
        *(["--ttft-slo", _num(spec.autoscaling.slo.ttftSeconds)] if spec.autoscaling.slo.ttftSeconds else []),
        # the workers' KV secret also authenticates the router's /internal/* calls (derived bearer token)
        "--internal-secret-file", f"{KV_SECRET_DIR}/{KV_SECRET_KEY}",
        # vLLM pools: the router speaks vLLM's kv_transfer_params handshake (pdcluster pools: unchanged flags)
        *(["--engine", spec.engine] if spec.engine != "pdcluster" else []),
    ]


# ---- pod template pieces ---------------------------------------------------------------------------

def _env(owner: Owner, role: str) -> list[dict[str, Any]]:
    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}

    return [
        {"name": "NODE_NAME", **field("spec.nodeName")},
        {"name": "POD_NAME", **field("metadata.name")},
        {"name": "POD_NAMESPACE", **field("metadata.namespace")},
        {"name": "POD_IP", **field("status.podIP")},
        {"name": "PDCLUSTER_NAME", "value": owner.name},
        {"name": "PDCLUSTER_ROLE", "value": role},
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/.triton"},
    ]


def _probes() -> dict[str, Any]:
    http = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        # Model loading can take many minutes: the startup probe holds liveness off meanwhile.
        "startupProbe": {**http, "periodSeconds": 10, "failureThreshold": 180, "timeoutSeconds": 5},
        "readinessProbe": {**http, "periodSeconds": 5, "failureThreshold": 2, "timeoutSeconds": 3},
        # Generous: a draining worker answers 503 on /health while it finishes in-flight work.
        "livenessProbe": {**http, "periodSeconds": 10, "failureThreshold": 12, "timeoutSeconds": 5},
    }


def _container_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def worker_resources(spec: models.PDClusterSpec, pool: models.PrefillPool | models.DecodePool,
                     role: str) -> dict[str, Any]:
    """A worker container's resources, either engine: the pool's, plus one GPU per rank (a CPU pool requests
    none)."""
    resources = _resources(pool.resources)
    if gpus := spec.gpus_per_pod(role):
        resources.setdefault("limits", {})[GPU_RESOURCE] = gpus
    return resources


def _resources(res: models.Resources) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if res.requests:
        out["requests"] = dict(res.requests)
    if res.limits:
        out["limits"] = dict(res.limits)
    return out


def _topology_spread(owner: Owner, role: str) -> list[dict[str, Any]]:
    return [{
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": selector_labels(owner, role)},
    }, {
        "maxSkew": 1,
        "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": selector_labels(owner, role)},
    }]


def _scrape_annotations() -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(WORKER_PORT),
            "prometheus.io/path": "/metrics"}


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def secret_fingerprint(key: bytes) -> str:
    return hashlib.sha256(b"pdcluster-kv-secret:" + key).hexdigest()[:16]


def _deployment(owner: Owner, role: str, replicas: int, pod_spec: dict[str, Any],
                template_annotations: dict[str, str], strategy: dict[str, Any]) -> dict[str, Any]:
    labels = role_labels(owner, role)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(owner, child_name(owner, role), labels),
        "spec": {
            "replicas": int(replicas),
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": 1800,
            "selector": {"matchLabels": selector_labels(owner, role)},
            "strategy": strategy,
            "template": {
                "metadata": {"labels": labels, "annotations": template_annotations},
                "spec": pod_spec,
            },
        },
    }


# Gateway API Inference Extension / llm-d endpoint pickers tell prefill from decode pods by this label.
LLMD_ROLE_LABEL = "llm-d.ai/role"


def render_worker_deployment(owner: Owner, spec: PDClusterSpec, role: str, replicas: int,
                             kv_secret_fingerprint: str) -> dict[str, Any]:
    if spec.engine == "vllm":
        dep = render_vllm.render_worker_deployment(owner, spec, role, replicas)
    else:
        dep = _pdcluster_worker_deployment(owner, spec, role, replicas, kv_secret_fingerprint)
    dep["spec"]["template"]["metadata"]["labels"][LLMD_ROLE_LABEL] = role
    return dep


def _pdcluster_worker_deployment(owner: Owner, spec: PDClusterSpec, role: str, replicas: int,
                                 kv_secret_fingerprint: str) -> dict[str, Any]:
    model_dir, model_volume, _ = model_source(spec.model.uri)
    pool = spec.prefill if role == "prefill" else spec.decode
    command = worker_command(spec, role, model_dir)
    mounts = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "kv-secret", "mountPath": KV_SECRET_DIR, "readOnly": True},
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size_limit(pool.tensorParallelSize)}},
        {"name": "kv-secret", "secret": {"secretName": secret_name(owner), "defaultMode": 0o440}},
        {"name": "config", "configMap": {"name": config_map_name(owner)}},
    ]
    if model_volume is not None:
        volumes.append(model_volume)
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    resources = worker_resources(spec, pool, role)
    container = {
        "name": "worker",
        "image": spec.pool_image(role),
        "imagePullPolicy": spec.imagePullPolicy,
        "command": command,
        "ports": [
            {"name": "http", "containerPort": WORKER_PORT, "protocol": "TCP"},
            {"name": "kv-transfer", "containerPort": KV_TRANSFER_PORT, "protocol": "TCP"},
        ],
        "env": _env(owner, role),
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": _container_security(),
        **_probes(),
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(),
        # In-flight requests get the router's timeout to finish after SIGTERM.
        "terminationGracePeriodSeconds": int(math.ceil(spec.router.requestTimeoutSeconds)) + 30,
        "containers": [container],
        "volumes": volumes,
        "topologySpreadConstraints": _topology_spread(owner, role),
    }
    if spec.nodeSelector:
        pod_spec["nodeSelector"] = dict(spec.nodeSelector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.model_dump(exclude_none=True) for t in spec.tolerations]
    annotations = apply_pod_options(pool, pod_spec, container, {
        **_scrape_annotations(),
        "pdcluster.dev/config-hash": _hash([command, spec.kvCache.model_dump(), spec.kvTransfer.model_dump()]),
        "pdcluster.dev/kv-secret-hash": kv_secret_fingerprint,
    })
    # Workers hold their GPUs: roll without surging so an upgrade never needs a spare GPU.
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return _deployment(owner, role, replicas, pod_spec, annotations, strategy)


def render_router_deployment(owner: Owner, spec: PDClusterSpec, kv_secret_fingerprint: str) -> dict[str, Any]:
    command = router_command(owner, spec)
    container = {
        "name": "router",
        "image": spec.worker_image,
        "imagePullPolicy": spec.imagePullPolicy,
        "command": command,
        "ports": [{"name": "http", "containerPort": WORKER_PORT, "protocol": "TCP"}],
        "env": _env(owner, "router"),
        "resources": _resources(spec.router.resources),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         {"name": "kv-secret", "mountPath": KV_SECRET_DIR, "readOnly": True}],
        "securityContext": _container_security(),
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5,
                           "failureThreshold": 2, "timeoutSeconds": 3},
        # /health is 503 while no decode worker is healthy (readiness); /live only says the process
        # serves, so a long decode outage does not restart the router too.
        "livenessProbe": {"httpGet": {"path": "/live", "port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 6, "timeoutSeconds": 5, "initialDelaySeconds": 10},
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": _pod_security(),
        "terminationGracePeriodSeconds": int(math.ceil(spec.router.requestTimeoutSeconds)) + 30,
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}},
                    {"name": "kv-secret", "secret": {"secretName": secret_name(owner), "defaultMode": 0o440}}],
        "topologySpreadConstraints": _topology_spread(owner, "router"),
    }
    # The router reads the secret once at start (it derives the /internal token from it): a rotated
    # secret must roll the router together with the workers.
    annotations = apply_pod_options(spec.router, pod_spec, container, {
        **_scrape_annotations(), "pdcluster.dev/config-hash": _hash(command),
        "pdcluster.dev/kv-secret-hash": kv_secret_fingerprint})
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    return _deployment(owner, "router", spec.router.replicas, pod_spec, annotations, strategy)


def render_service(owner: Owner, spec: PDClusterSpec, role: str) -> dict[str, Any]:
    svc_spec: dict[str, Any] = {
        "selector": selector_labels(owner, role),
        "ports": [{"name": "http", "port": WORKER_PORT, "targetPort": "http", "protocol": "TCP"}],
    }
    if role in WORKER_ROLES:
        # Headless: DNS returns every ready worker, which is how the router discovers endpoints.
        svc_spec["clusterIP"] = "None"
        if spec.engine == "vllm":
            svc_spec["ports"] += render_vllm.service_ports()
        else:
            svc_spec["ports"].append({"name": "kv-transfer", "port": KV_TRANSFER_PORT,
                                      "targetPort": "kv-transfer", "protocol": "TCP"})
    else:
        svc_spec["type"] = spec.router.serviceType
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": meta(owner, child_name(owner, role), role_labels(owner, role)), "spec": svc_spec}


def render_config_map(owner: Owner, spec: PDClusterSpec) -> dict[str, Any]:
    config = {
        "name": owner.name,
        "model": spec.model.model_dump(),
        "kvCache": spec.kvCache.model_dump(),
        "kvTransfer": spec.kvTransfer.model_dump(),
        # pod placement and environment are the Deployments' business, not the processes' config
        "router": {k: v for k, v in spec.router.model_dump().items()
                   if k != "resources" and k not in models.PodOptions.model_fields},
        "services": {r: service_url(owner, r) for r in ROLES},
        "ports": {"http": WORKER_PORT, "kvTransfer": KV_TRANSFER_PORT},
    }
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": meta(owner, config_map_name(owner), instance_labels(owner)),
            "data": {"pdcluster.json": json.dumps(config, indent=2, sort_keys=True)}}


def new_kv_secret_key() -> bytes:
    """32 random bytes, URL-safe base64 text (the worker strips whitespace and needs >= 16 bytes)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=")


def render_secret(owner: Owner, key: bytes) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": meta(owner, secret_name(owner), instance_labels(owner)),
            "data": {KV_SECRET_KEY: base64.b64encode(key).decode()}}


def render_children(owner: Owner, spec: PDClusterSpec, replicas: dict[str, int],
                    kv_secret_fingerprint: str) -> list[dict[str, Any]]:
    """Everything applied with server-side apply, in apply order (the Secret is handled separately:
    it is created once and never overwritten)."""
    objs: list[dict[str, Any]] = [render_config_map(owner, spec)]
    for role in WORKER_ROLES:
        objs.append(render_service(owner, spec, role))
    objs.append(render_service(owner, spec, "router"))
    for role in WORKER_ROLES:
        objs.append(render_worker_deployment(owner, spec, role, replicas[role], kv_secret_fingerprint))
    objs.append(render_router_deployment(owner, spec, kv_secret_fingerprint))
    for role in ROLES:
        objs.append(render_pdb(owner, role))
    if spec.networkPolicy.enabled and spec.engine == "vllm":
        tp = max(spec.prefill.tensorParallelSize, spec.decode.tensorParallelSize)
        objs.append(render_network_policy(owner, worker_rules=render_vllm.network_policy_rules(owner, tp)))
    elif spec.networkPolicy.enabled:
        objs.append(render_network_policy(owner, spec.decode.tensorParallelSize))  # every decode rank receives
    return objs
