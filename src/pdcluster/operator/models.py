"""The PDCluster spec as pydantic models.

These models are the single source of truth: `pdcluster.operator.crd` generates the CRD's structural
OpenAPI schema (types, enums, ranges, defaults, CEL rules) from them, and a test checks that the
committed `crds/pdcluster.yaml` equals the generated one, so the two can never drift.

Field names are the camelCase names of the CRD. Every cross-field CEL rule
(`x-kubernetes-validations`) is mirrored by a pydantic validator, so a cluster whose API server does
not run CEL (or a spec applied before the CRD was updated) is still checked by the operator, which
reports a `Degraded` condition instead of crashing. The pod-level parts live in `pod_spec`, what `spec.engine`
changes in `engines`; both are re-exported here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from pdcluster import __version__
from pdcluster.operator import parallel
from pdcluster.operator.engines import (  # noqa: F401  (re-exported)
    DEFAULT_VLLM_IMAGE,
    ENGINE_ARGS_RULE,
    NIXL_SIDE_CHANNEL_PORT,
    VLLM_CEL_RULES,
    VLLM_IMAGE_REPOSITORY,
    engine_args_error,
    vllm_error,
)
from pdcluster.operator.pod_spec import (
    POD_OPTION_RULES,
    RESERVED_ENV,
    EnvVar,
    IntOrString,
    LocalObjectReference,
    PodOptions,
    Resources,
    SpecModel,
    Toleration,
    cel,
)
from pdcluster.operator.ratio_spec import Ratio
from pdcluster.worker.router.options import default as router_default
from pdcluster.worker.transfer.options import default as kv_default

API_GROUP = "pdcluster.dev"
API_VERSION = "v1alpha1"
KIND = "PDCluster"
PLURAL = "pdclusters"
SINGULAR = "pdcluster"
SHORT_NAMES = ["pdc"]

WORKER_PORT = 8000
# `spec.image` when omitted: the worker image of the operator's own version (docker/worker.Dockerfile;
# the chart's operator image is pdcluster/operator of the same version). Upgrading the operator therefore
# rolls the workers of PDClusters that do not pin an image.
WORKER_IMAGE_REPOSITORY = "pdcluster/worker"
DEFAULT_WORKER_IMAGE = f"{WORKER_IMAGE_REPOSITORY}:{__version__}"
KV_TRANSFER_PORT = 9000

# Model URIs the operator knows how to mount; anything else is caught by the schema pattern.
MODEL_URI_PATTERN = r"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|hostpath:///.+|file:///.+|/.+)$"


# models.py names (the spec's classes below use them)
_cel = cel
_POD_OPTION_RULES = POD_OPTION_RULES
__all__ = ["RESERVED_ENV", "EnvVar", "IntOrString", "LocalObjectReference", "PodOptions", "Resources",
           "Toleration"]


class Model(SpecModel):
    """The model every worker serves."""

    name: str = Field(min_length=1, description="Served model name (the OpenAI `model` field).")
    uri: str = Field(
        pattern=MODEL_URI_PATTERN,
        description=(
            "Where the weights live: pvc://CLAIM[/SUBPATH] (mounted read-only), hostpath:///PATH, "
            "or file:///PATH (or /PATH) for a directory already inside the image."
        ),
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        default="auto", description="Weight/activation dtype passed to the worker (--dtype)."
    )
    maxModelLen: int | None = Field(default=None, ge=1, description="Longest sequence (prompt + output).")


_POOL_RULES: Any = [
    _cel("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas"),
    _cel(
        "!has(self.replicas) || (self.replicas >= self.minReplicas && self.replicas <= self.maxReplicas)",
        "replicas must be within [minReplicas, maxReplicas]",
    ),
    # An explicit GPU count must be one GPU per rank. Compared as text: a resource value is an int or a
    # quantity string ("4"), and string() of either is what the user wrote (parallel.gpu_count_error).
    ENGINE_ARGS_RULE,
    *(_cel(f"!has(self.resources) || !has(self.resources.{kind}) || "
           f"!('{parallel.GPU_RESOURCE}' in self.resources.{kind}) || "
           f"string(self.resources.{kind}['{parallel.GPU_RESOURCE}']) == string(self.tensorParallelSize)",
           parallel.GPU_COUNT_MESSAGE) for kind in ("requests", "limits")),
]


class _Pool(PodOptions):
    replicas: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Replicas when autoscaling is disabled; the starting point when it is enabled. "
            "Defaults to minReplicas."
        ),
    )
    minReplicas: int = Field(default=1, ge=1, le=1000, description="Fewest replicas the autoscaler keeps.")
    maxReplicas: int = Field(default=8, ge=1, le=1000, description="Most replicas the autoscaler creates.")
    resources: Resources = Field(default_factory=Resources, description="Resources of each worker container.")
    tensorParallelSize: int = Field(
        default=1, ge=1, le=max(parallel.TP_SIZES), strict=True,
        description="Ranks (one GPU each) one worker pod shards the model over: `pdcluster serve "
        "--tensor-parallel-size`, and nvidia.com/gpu per pod when the pool runs on GPUs. 1, 2, 4, 8 or 16: "
        "one pod's GPUs on one node. One pod is one instance: capacities stay per pod.",
        json_schema_extra={"x-kubernetes-validations": [
            _cel("self in " + str(list(parallel.TP_SIZES)), parallel.TP_RULE_MESSAGE)]},
    )

    image: str | None = Field(
        default=None, min_length=1, max_length=512,
        description="Image of this pool's workers (default: spec.image for engine pdcluster, "
        f"{VLLM_IMAGE_REPOSITORY}:<version> for engine vllm).")
    engineArgs: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list, max_length=64,
        description="Extra command-line arguments appended to the engine's server (`pdcluster serve`, or "
        "vLLM's OpenAI server, e.g. [\"--enforce-eager\"]); the flags the operator renders itself are refused.")

    @model_validator(mode="after")
    def _bounds(self) -> _Pool:
        if self.minReplicas > self.maxReplicas:
            raise ValueError("minReplicas must be <= maxReplicas")
        if self.replicas is not None and not (self.minReplicas <= self.replicas <= self.maxReplicas):
            raise ValueError("replicas must be within [minReplicas, maxReplicas]")
        error = parallel.gpu_count_error(self.resources.requests, self.resources.limits, self.tensorParallelSize)
        if error:
            raise ValueError(error)
        if error := engine_args_error(self.engineArgs):
            raise ValueError(error)
        return self

    @field_validator("tensorParallelSize", mode="before")
    @classmethod
    def _tp(cls, v: Any) -> Any:
        # before the bounds, so that 32 gets the CEL rule's message too, not only "<= 16"
        if isinstance(v, int) and not isinstance(v, bool) and parallel.tp_error(v):
            raise ValueError(parallel.TP_RULE_MESSAGE)
        return v

    @property
    def initial_replicas(self) -> int:
        return self.replicas if self.replicas is not None else self.minReplicas


class PrefillPool(_Pool):
    """The prefill pool: workers that compute prompts and stream their KV cache to decode workers."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _POOL_RULES + _POD_OPTION_RULES})
    maxBatchTokens: int = Field(default=8192, ge=1, description="Token budget of one prefill batch.")
    maxBatchSize: int = Field(default=64, ge=1, description="Sequences in one prefill batch.")


class DecodePool(_Pool):
    """The decode pool: workers that receive KV caches and generate the output tokens."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _POOL_RULES + _POD_OPTION_RULES})
    maxBatchSize: int = Field(default=16, ge=1, le=1024, description="Sequences decoded together.")
    maxBatchTokens: int = Field(default=8192, ge=1, description="Token budget of one decode step.")


class KVCache(SpecModel):
    """Every worker's paged KV cache."""

    blockSize: Literal[8, 16, 32] = Field(default=16, description="Tokens per KV-cache block.")
    dtype: Literal["auto", "int8", "int4"] = Field(default="auto", description="KV-cache element type.")
    fullPrecisionLayers: list[int] = Field(
        default_factory=list, description="Layers kept at full precision when dtype is int8/int4."
    )
    gpuMemoryUtilization: float = Field(
        default=0.9, ge=0.1, le=0.99,
        description="Fraction of accelerator memory the worker may use (weights, activations, KV cache).")
    swapSpaceGiB: float = Field(default=4.0, ge=0, le=1024, description="CPU swap space for preempted KV.")
    preemption: Literal["swap", "recompute", "auto"] = Field(
        default="auto", description="What a preempted sequence loses: swap its KV to CPU, recompute it, "
        "or auto (swap while swap space lasts).")
    swapWatermark: float = Field(
        default=0.15, ge=0, le=0.5,
        description="Admission watermark (despite its name, unrelated to swapSpaceGiB): "
        "the fraction of KV blocks kept free when admitting new work while others run (useful range "
        "0.10-0.20); running sequences grow into it instead of preempting each other at once.",
    )


class KVTransfer(SpecModel):
    """How prefill workers ship KV caches to decode workers."""

    # defaults: the worker flags' (worker/transfer/options.py), so a pod and a hand-run worker agree
    compression: Literal["none", "int8"] = Field(
        default=kv_default("compression"), description="Wire format of the KV cache: none (the cache dtype) or int8.")
    backend: Literal["auto", "nixl", "tcp"] = Field(
        default=kv_default("backend"),
        description="How KV bytes move: nixl (UCX: RDMA, NVLink, shared memory, TCP; its data plane is not "
        "authenticated, so the bytes are MAC-checked before import: use it on a trusted fabric), tcp (the "
        "authenticated transfer channel carries the bytes too), auto (nixl where it loads in the worker "
        "image, else tcp; the worker logs which one runs and why).")
    integrity: Literal["mac", "fabric"] = Field(
        default=kv_default("integrity"),
        description="KV bytes, with either backend: mac (each layer is MAC'd by the sender and checked before "
        "import; a pass over each layer on both sides) or fabric (trusted as they land, as vLLM's and Dynamo's "
        "NIXL connectors do: only where the network protects them, e.g. an isolated RDMA/NVLink fabric or "
        "mTLS/IPsec/WireGuard between nodes; the transfer connection, frame headers and request ids stay "
        "authenticated).")
    # Kept so that manifests saying `layerwise: true` keep applying, but not a knob: the transfer path only
    # streams layer by layer (whole-request shipping exists only as a baseline in benchmarks/disagg_transfer.py),
    # so `false` is refused instead of being accepted and ignored.
    layerwise: Literal[True] = Field(
        default=True,
        description="Always true: KV streams to the decode worker layer by layer while prefill proceeds "
        "(false is refused; there is no whole-request transfer path).",
        json_schema_extra={"x-kubernetes-validations": [
            _cel("self == true", "layerwise must be true: KV always streams layer by layer")]},
    )
    timeoutSeconds: float = Field(default=kv_default("timeout_s"), gt=0, le=3600,
                                  description="Bound on one KV transfer.")
    maxRetries: int = Field(default=kv_default("max_retries"), ge=0, le=20,
                            description="Retries of a failed KV transfer.")


class Router(PodOptions):
    """The OpenAI-compatible router in front of the pools."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _POD_OPTION_RULES})
    replicas: int = Field(default=1, ge=1, le=100, description="Router replicas (not autoscaled).")
    # defaults: the router flags' (worker/router/options.py), so a router pod and a hand-run router agree
    maxQueueDepth: int = Field(
        default=router_default("max_queue_depth"), ge=1, description="Requests queued at the router before it answers 429.")
    requestTimeoutSeconds: float = Field(
        default=router_default("request_timeout"), gt=0, le=86400,
        description="Bound on one request, end to end; pods get it plus 30 s to finish after SIGTERM.")
    disaggregationThreshold: int = Field(
        default=router_default("disaggregation_threshold"), ge=0, description="Prompts shorter than this many tokens prefill on the decode worker."
    )
    serviceType: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        default="ClusterIP", description="Type of the router's Service (the cluster's endpoint).")
    resources: Resources = Field(default_factory=Resources, description="Resources of each router container.")


class Capacity(SpecModel):
    """Per-instance throughputs; unset ones are learned from Prometheus."""

    prefillTokensPerSecond: float | None = Field(
        default=None, gt=0, description="Prompt tokens/s one prefill instance sustains (C_p)."
    )
    decodeTokensPerSecond: float | None = Field(
        default=None, gt=0, description="Output tokens/s one decode instance sustains (C_d)."
    )


class SLO(SpecModel):
    ttftSeconds: float | None = Field(
        default=None, gt=0, le=3600,
        description="Time-to-first-token target at `percentile`; when broken the prefill pool grows "
        "even if the formula says it is big enough.",
    )
    tpotSeconds: float | None = Field(
        default=None, gt=0, le=60,
        description="Time-per-output-token target at `percentile`; when broken the decode pool grows.",
    )
    percentile: float = Field(default=0.99, gt=0, lt=1, description="The latency quantile checked (0..1).")


class Autoscaling(SpecModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!self.enabled || (has(self.prometheusUrl) && size(self.prometheusUrl) > 0)",
                    "autoscaling.prometheusUrl is required when autoscaling is enabled",
                ),
            ]
        }
    )
    enabled: bool = Field(default=False, description="Size the pools from Prometheus metrics.")
    prometheusUrl: str | None = Field(
        default=None, pattern=r"^https?://.+", description="Prometheus base URL (required when enabled).")
    intervalSeconds: int = Field(default=30, ge=5, le=3600, description="Seconds between decisions.")
    windowSeconds: int = Field(default=120, ge=10, le=86400, description="Metrics window of one decision.")
    headroom: float = Field(default=1.5, ge=1.0, le=10.0, description="Provision for this multiple of the "
                            "observed request rate (with adaptiveHeadroom: the most, for bursty load).")
    adaptiveHeadroom: bool = Field(
        default=True,
        description="Headroom follows the window's variability: the full headroom when the peak burst rate is "
        "at least twice the mean, down to none when it is within the chance peak of a steady rate (smooth "
        "load: two standard deviations of a Poisson count over burstWindowSeconds); false = always the full "
        "headroom.")
    scaleDownStabilizationSeconds: int = Field(
        default=300, ge=0, le=86400,
        description="A pool shrinks only after lower recommendations for this many seconds, to the "
        "highest load seen meanwhile.")
    maxScaleUpStep: int = Field(default=4, ge=1, le=1000, description="Most replicas added per decision.")
    maxScaleDownStep: int = Field(default=1, ge=1, le=1000, description="Most replicas removed per decision.")
    maxTotalReplicas: int | None = Field(
        default=None, ge=2, description="Budget for prefill + decode replicas together."
    )
    rolloutTimeoutSeconds: int = Field(
        default=600, ge=0, le=86400,
        description="How long to wait for a previous scale change to become ready before deciding anyway.",
    )
    capacity: Capacity = Field(default_factory=Capacity)
    slo: SLO = Field(default_factory=SLO, description="Latency targets guarded by the autoscaler.")
    ratio: Ratio = Field(
        default_factory=Ratio,
        description="Bounds of prefill:decode (P/D) that every autoscaler decision keeps: the short pool grows "
        "to meet them (the other shrinks only where a maxReplicas or maxTotalReplicas leaves no room).")
    burstWindowSeconds: int = Field(
        default=10, ge=0, le=3600,
        description="Short window for the peak request rate within windowSeconds (a burst must fit "
        "without headroom; needs a router scrape interval of at most half of it, else 3x it is "
        "tried); 0 = use the mean rate only.",
    )
    burstMemorySeconds: int = Field(
        default=3600, ge=0, le=86400,
        description="How long the replicas a burst needed are kept (bursts recur; pods start too late "
        "for the burst that asked for them).",
    )
    flipWindowSeconds: int = Field(
        default=20, ge=0, le=600,
        description="With role flips: every quarter of this many seconds (5 at least), read the last "
        "flipWindowSeconds of request rate, prompt/output lengths and queues, and flip workers toward the "
        "split they ask for when the window holds at least 30 requests (flips only: no pod is started or "
        "removed); a decision's scale-up that window does not ask for is held. Needs the router scraped "
        "every 5 s (the chart's PodMonitor does). 0 = off: flips only as decisions on windowSeconds ask.",
    )

    @model_validator(mode="after")
    def _url(self) -> Autoscaling:
        if self.enabled and not self.prometheusUrl:
            raise ValueError("autoscaling.prometheusUrl is required when autoscaling is enabled")
        return self


class NetworkPolicySpec(SpecModel):
    """The NetworkPolicy around the workers."""

    enabled: bool = Field(default=True, description="Render a NetworkPolicy for the worker pods.")


class PDClusterSpec(SpecModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!has(self.autoscaling.maxTotalReplicas) || "
                    "self.autoscaling.maxTotalReplicas >= self.prefill.minReplicas + self.decode.minReplicas",
                    "autoscaling.maxTotalReplicas must be >= prefill.minReplicas + decode.minReplicas",
                ),
                *VLLM_CEL_RULES,
            ]
        }
    )
    model: Model = Field(description="The model every worker serves.")
    engine: Literal["pdcluster", "vllm"] = Field(
        default="pdcluster",
        description="What the prefill and decode pods run: pdcluster (this project's engine: layer-wise KV "
        "push over its TCP or NIXL transport) or vllm (vLLM's OpenAI server with its NixlConnector; the router "
        "drives vLLM's kv_transfer_params handshake). The router, autoscaler and drain serve both.")
    image: str | None = Field(
        default=None, min_length=1,
        description="Image with the `pdcluster` CLI (worker extra installed) for workers and router. "
        f"Default: the worker image of the operator's own version ({WORKER_IMAGE_REPOSITORY}:<version>).",
    )
    imagePullPolicy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Pull policy of `image`.")
    prefill: PrefillPool = Field(default_factory=PrefillPool, description="The prefill pool.")
    decode: DecodePool = Field(default_factory=DecodePool, description="The decode pool.")
    kvCache: KVCache = Field(default_factory=KVCache, description="Every worker's paged KV cache.")
    kvTransfer: KVTransfer = Field(default_factory=KVTransfer, description="Prefill-to-decode KV transfer.")
    router: Router = Field(default_factory=Router, description="The OpenAI-compatible router.")
    autoscaling: Autoscaling = Field(default_factory=Autoscaling, description="The prefill/decode autoscaler.")
    roleFlips: bool = Field(
        default=True,
        description="Grow a pool by moving running workers from the other pool (a role flip: no restart, the "
        "weights stay loaded) when the other pool shrinks or, with autoscaling, has replicas above its need; "
        "pods start only for the rest. Used where the pools' pods are interchangeable: engine pdcluster and "
        "the same tensorParallelSize, resources, image, engineArgs, env, affinity and priorityClassName; "
        "elsewhere pods start, and the RoleFlips condition says why. false: pools grow by starting pods only.")
    networkPolicy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, description="The NetworkPolicy around the workers.")
    nodeSelector: dict[str, str] = Field(default_factory=dict, description="Applied to worker pods.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Applied to worker pods.")

    @property
    def worker_image(self) -> str:
        return self.image or DEFAULT_WORKER_IMAGE

    def pool_image(self, role: str) -> str:
        """The image of one pool's workers: its own, else the engine's default (the router keeps worker_image)."""
        own = self.pool(role).image
        if own:
            return own
        return (self.image or DEFAULT_WORKER_IMAGE) if self.engine == "pdcluster" else DEFAULT_VLLM_IMAGE

    def pool(self, role: str) -> PrefillPool | DecodePool:
        return self.prefill if role == "prefill" else self.decode

    def gpus_per_pod(self, role: str) -> int:
        """nvidia.com/gpu of one `role` pod: its TP size on GPU pools, 0 on CPU (parallel.runs_on_gpus)."""
        pool = self.pool(role)
        res = pool.resources
        on_gpus = parallel.runs_on_gpus(res.requests, res.limits, self.nodeSelector,
                                        (t.key for t in self.tolerations))
        return pool.tensorParallelSize if on_gpus else 0

    @model_validator(mode="after")
    def _budget(self) -> PDClusterSpec:
        budget = self.autoscaling.maxTotalReplicas
        if budget is not None and budget < self.prefill.minReplicas + self.decode.minReplicas:
            raise ValueError(
                "autoscaling.maxTotalReplicas must be >= prefill.minReplicas + decode.minReplicas"
            )
        if error := vllm_error(self):
            raise ValueError(error)
        return self


def parse_spec(spec: dict[str, Any] | Any) -> PDClusterSpec:
    """Validate a CR's `.spec` (raises pydantic.ValidationError)."""
    return PDClusterSpec.model_validate(dict(spec or {}))


def short_error(exc: Exception) -> str:
    """One line describing a validation error (for conditions and Events)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = []
        for e in errors()[:3]:
            loc = ".".join(str(p) for p in e.get("loc", ()))
            msg = e.get("msg", "invalid")
            parts.append(f"spec.{loc}: {msg}" if loc else msg)
        return "; ".join(parts)
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
