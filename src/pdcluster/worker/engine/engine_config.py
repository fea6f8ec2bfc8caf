"""EngineConfig: what one engine runs with (torch-free, so the CLI and the operator side can build and check it
without loading torch). The options shared with `pdcluster serve` and the PDCluster spec are declared once in
options.py; the fields below that are not there are internal knobs (tests, benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pdcluster.worker.engine import options


def _default(name: str) -> Any:
    return options.BY_NAME[name].default


@dataclass
class EngineConfig:
    """What one engine runs with; shared options (serve flags, spec fields) are declared in options.py."""

    model: str  # Hugging Face model folder
    dtype: str = _default("dtype")  # auto (fp32 on CPU, checkpoint dtype on CUDA) | float32 | bfloat16 | float16
    device: str = _default("device")
    block_size: int = _default("block_size")
    kv_cache_dtype: str = _default("kv_cache_dtype")  # auto (model dtype) | int8 | int4
    # Layers whose KV cache stays in the model dtype while the others use kv_cache_dtype (int8/int4); the
    # most quantization-sensitive layers (often the first ones) recover most of int4's quality loss. A
    # no-op with kv_cache_dtype "auto" (every layer is full precision already); indices must still be valid.
    full_precision_layers: tuple[int, ...] = _default("full_precision_layers")
    max_batch_size: int = _default("max_batch_size")  # decode sequences per step
    max_batch_tokens: int = _default("max_batch_tokens")  # prefill tokens per step (longer prompts are chunked)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    gpu_memory_utilization: float = _default("gpu_memory_utilization")  # CUDA: weights + KV cache share
    kv_cache_memory: int | None = None  # CPU: KV cache bytes (default: enough for the batch, <= 1 GiB)
    num_kv_blocks: int | None = None  # exact block count, overrides both budgets (tests)
    swap_space: float = _default("swap_space")  # GiB of host memory for swapped-out KV
    preemption_mode: Literal["swap", "recompute", "auto"] = _default("preemption_mode")
    watermark: float = _default("watermark")  # fraction of blocks kept free when admitting new work
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch CPU threads
    host_bandwidth: float = 8e9  # bytes/s assumed for swap, used by preemption_mode="auto"
    # Decode tokens and prefill chunks share a step (scheduler.py); False: they alternate (A/B benchmarks)
    mixed_steps: bool = True
    compile_decode: bool = False  # torch.compile the decode step (model_runner.py); costs minutes at startup
    debug_logits: bool = False  # put each sampled position's float32 logits in RequestOutput.extra["logits"]
    # Ranks the model is sharded over (one process each, parallel/runner.py); 1 = today's single process
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 60.0  # seconds a step's collective may wait for a silent rank

    def validate(self) -> None:
        """ValueError naming the field, for any declared option out of its type, choices or bounds."""
        options.validate(vars(self))
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if not self.tensor_parallel_timeout > 0:
            raise ValueError(f"tensor_parallel_timeout must be > 0, got {self.tensor_parallel_timeout!r}")

    def runner_kwargs(self, max_model_len: int) -> dict[str, Any]:
        """ModelRunner's keyword arguments (after the model config): the same on every tensor-parallel rank."""
        return dict(
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            full_precision_layers=tuple(self.full_precision_layers),
            num_blocks=self.num_kv_blocks,
            kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=max_model_len,
            max_batch_size=self.max_batch_size,
            swap_space_bytes=int(self.swap_space * (1 << 30)),
            compile_decode=self.compile_decode,
        )
