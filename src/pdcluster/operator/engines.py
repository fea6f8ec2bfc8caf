"""What `spec.engine` changes in the spec: the engines' names, defaults and the combinations `engine: vllm`
refuses, each as a CEL rule for the CRD and the same test in Python (models.py mirrors every CEL rule so a
cluster without CEL is still checked). Split from `models` to keep each file one idea; `models` re-exports it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pdcluster import __version__
from pdcluster.operator.pod_spec import cel

# `engine: vllm`: the default image of vLLM pools (docker/worker-vllm.Dockerfile: vLLM's OpenAI server plus
# NIXL) and the port of vLLM's NIXL side channel (decode workers fetch a prefill worker's KV layout there;
# rank r of a TP worker listens on NIXL_SIDE_CHANNEL_PORT + r).
VLLM_IMAGE_REPOSITORY = "pdcluster/worker-vllm"
DEFAULT_VLLM_IMAGE = f"{VLLM_IMAGE_REPOSITORY}:{__version__}"
NIXL_SIDE_CHANNEL_PORT = 5600
ENGINES = ("pdcluster", "vllm")
# Flags the operator renders itself for either engine: `engineArgs` must not repeat them (a second --port
# would silently win over the probes' port, a second --served-model-name over spec.model.name).
RESERVED_ENGINE_FLAGS = ("--model", "--host", "--port", "--served-model-name", "--role",
                         "--tensor-parallel-size", "--kv-transfer-config", "--kv-transfer-port",
                         "--kv-transfer-secret-file")


def engine_args_error(args: Sequence[str]) -> str | None:
    bad = [a for a in args if any(a == f or a.startswith(f + "=") for f in RESERVED_ENGINE_FLAGS)]
    if not bad:
        return None
    return f"{ENGINE_ARGS_MESSAGE}: {', '.join(bad)}"


ENGINE_ARGS_MESSAGE = ("engineArgs must not repeat a flag the operator renders (" + ", ".join(RESERVED_ENGINE_FLAGS)
                       + ")")
ENGINE_ARGS_RULE = cel("!has(self.engineArgs) || self.engineArgs.all(a, !(" + " || ".join(
    f"a == '{f}' || a.startsWith('{f}=')" for f in RESERVED_ENGINE_FLAGS) + "))", ENGINE_ARGS_MESSAGE)


# What `engine: vllm` cannot honour, as (CEL rule on the spec, the same test in Python, message). vLLM's
# NixlConnector moves its own cache layout over NIXL only, unauthenticated: the knobs of pdcluster's own
# transfer and cache formats have no vLLM meaning, and a knob accepted but ignored would lie to the operator.
VLLM_RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("self.kvCache.dtype == 'auto'", lambda s: s.kvCache.dtype == "auto",
     "engine vllm: kvCache.dtype int8/int4 is pdcluster's KV format; leave it auto (vLLM's own "
     "--kv-cache-dtype, e.g. fp8, goes in the pools' engineArgs)"),
    # has(): the field has no schema default, and CEL fails on an absent key ("no such key") rather than
    # reading it as empty, which refused every vllm spec without the field (found by e2e/realnode/test_17_vllm)
    ("!has(self.kvCache.fullPrecisionLayers) || size(self.kvCache.fullPrecisionLayers) == 0",
     lambda s: not s.kvCache.fullPrecisionLayers,
     "engine vllm: kvCache.fullPrecisionLayers applies to pdcluster's int8/int4 KV cache only"),
    ("self.kvCache.preemption != 'swap'", lambda s: s.kvCache.preemption != "swap",
     "engine vllm: vLLM preempts by recompute; kvCache.preemption swap is pdcluster's"),
    ("self.kvTransfer.compression == 'none'", lambda s: s.kvTransfer.compression == "none",
     "engine vllm: kvTransfer.compression int8 is pdcluster's wire format; vLLM's NixlConnector moves the "
     "cache as stored"),
    ("self.kvTransfer.backend != 'tcp'", lambda s: s.kvTransfer.backend != "tcp",
     "engine vllm: vLLM moves KV with NIXL only; kvTransfer.backend must be auto or nixl"),
    ("self.kvTransfer.integrity == 'fabric'", lambda s: s.kvTransfer.integrity == "fabric",
     "engine vllm: vLLM's NixlConnector does not MAC the KV bytes; set kvTransfer.integrity: fabric to "
     "acknowledge it runs on a trusted network"),
]


VLLM_CEL_RULES = [cel(f"self.engine != 'vllm' || {rule}", message) for rule, _, message in VLLM_RULES]


def vllm_error(spec: Any) -> str | None:
    """Every refusal that applies to `spec` (a PDClusterSpec), or None."""
    if spec.engine != "vllm":
        return None
    broken = [message for _, test, message in VLLM_RULES if not test(spec)]
    return "; ".join(broken) or None
