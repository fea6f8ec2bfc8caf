"""The native C++ CPU kernels (AVX-512, ``kernels/cpu/``), as the engine and the KV transfer use them.

The one door into ``pdcluster.kernels.cpu``: callers import this module, never the folder behind it
(tests/test_layout.py). Every kernel is optional and bit-for-bit with the torch path it stands in for;
where it cannot run (no AVX-512, no compiler and no prebuilt build, a CUDA tensor) the caller's torch path
runs.

One switch, ``PDCLUSTER_NATIVE_KERNELS``, read at each call: unset or ``1`` every kernel, ``0`` none (nothing
is built or loaded), ``-name[,-name...]`` every kernel but those named (``KERNELS``), e.g. ``-attention`` to
serve the torch decode attention beside the other native kernels. The only other variable,
``PDCLUSTER_NATIVE_PREBUILT``, is not a switch: it names the folder of builds an image ships
(docker/worker.Dockerfile), looked in before the build cache.
"""

from __future__ import annotations

from pdcluster.kernels.cpu import argmax as _argmax
from pdcluster.kernels.cpu import attention as _attention
from pdcluster.kernels.cpu import linear as _linear
from pdcluster.kernels.cpu import native as _loader
from pdcluster.kernels.cpu import norm as _norm
from pdcluster.kernels.cpu import quant as _quant
from pdcluster.kernels.cpu import rope as _rope
from pdcluster.kernels.cpu import screen as _screen
from pdcluster.kernels.cpu import step as _step

# the switch
SWITCH = _loader.ENV_SWITCH
KERNELS = _loader.KERNELS
enabled = _loader.enabled  # (kernel) -> the switch lets it run now
unavailable_reason = _loader.unavailable_reason  # why none can be built or run here, or None
unrunnable_reason = _loader.unrunnable_reason  # why none can run on this CPU (a prebuilt build needs no compiler)
outcomes = _loader.outcomes  # module -> loaded, for /metrics
step_module = _step.module  # the decode step's compiled module (linear, attention, norm, rope, ...), or None
loaded_pool_stats = _step.loaded_pool_stats  # the step pool's counters, without loading it

# greedy sampling: x.argmax(-1) of fp32 rows
argmax = _argmax.argmax

# paged decode attention over a host cache
ATTENTION_PARALLEL_MIN = _attention.PARALLEL_MIN
attention_available = _attention.available  # (cache pool, head_dim) -> this kernel serves that layer
paged_decode_attention = _attention.paged_decode_attention_cpu

# fp32 small-M linear on packed 64-column panels
linear_ready = _linear.ready
pack_linear = _linear.pack  # [N, K] -> panels
unpack_linear = _linear.unpack  # panels -> [N, K] (a copy)
linear_rows = _linear.rows  # rows of W read from its panels (a tied embedding)
linear = _linear.linear
linear_grain = _linear.grain  # panels per shared item of a product
mkl_packed = _linear.mkl_packed  # the large-M product by MKL on the same panels

# add + RMSNorm, RoPE + cache write: entry points decided once per module
norm_kernel_for = _norm.kernel_for
rope_kernel_for = _rope.kernel_for

# greedy's LM head screened in bf16
ScreenedHead = _screen.ScreenedHead
SCREEN_MAX_CANDIDATES = _screen.MAX_CANDIDATES
screen_unavailable_reason = _screen.unavailable_reason
screen_max_rows = _screen.max_rows
screen_dot_rate_ratio = _screen.dot_rate_ratio

# int8 per-vector KV (de)quantization
quant_ready = _quant.ready
quantize8 = _quant.quantize8  # -> (codes, scales), or None when the kernel cannot take x
dequantize = _quant.dequantize  # kv_quant.dequantize_kv, through the kernel where it can
