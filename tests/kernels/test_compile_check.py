"""Every Triton kernel variant compiles for sm_90 (no GPU needed): the interpreter-run tests cannot catch
GPU compile errors. Runs `python -m pdcluster.kernels.compile_check` in a subprocess because the test process
has the interpreter switched on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.triton
def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend to compile sm_90 for")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "pdcluster.kernels.compile_check", "--arch", "90"], env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "all kernels compile" in proc.stdout
