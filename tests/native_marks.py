"""The skip marker of every test that runs a native CPU kernel (kernels/cpu/): such a test skips only where
the kernels cannot be built or run here, and says why (no AVX-512, no compiler or ninja, or
PDCLUSTER_NATIVE_KERNELS=0). A kernel that fails to compile does not skip it: it fails."""

from __future__ import annotations

import pytest

from pdcluster.kernels import native

needs_native = pytest.mark.skipif(native.unavailable_reason() is not None,
                                  reason=f"native kernels unavailable here: {native.unavailable_reason()}")
# The bf16 screen of greedy's LM head also needs AVX512-BF16 (kernels/cpu/screen.py says what is missing)
needs_screen = pytest.mark.skipif(native.screen_unavailable_reason() is not None,
                                  reason=f"the bf16 screen cannot run here: {native.screen_unavailable_reason()}")
