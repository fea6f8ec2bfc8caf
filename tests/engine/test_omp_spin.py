"""The served engine's OpenMP spin default: set before torch loads, never over a user's own setting."""

from __future__ import annotations

import subprocess
import sys

from pdcluster.worker.engine.omp_spin import SPIN_COUNT, apply_spin_defaults, spin_defaults


def test_default_spin_when_unset() -> None:
    assert spin_defaults({}) == {"GOMP_SPINCOUNT": SPIN_COUNT}


def test_user_setting_wins() -> None:
    for knob in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME"):
        assert spin_defaults({knob: "x"}) == {}


def test_nothing_set_once_torch_is_loaded() -> None:
    import torch  # noqa: F401  (this test process has it loaded anyway)

    env: dict[str, str] = {}
    assert apply_spin_defaults(env) == {} and env == {}


def test_serve_applies_it_before_torch_loads() -> None:
    """`pdcluster serve`'s module must not import torch, or the setting would come too late for libgomp."""
    code = (
        "import sys, pdcluster.cli, pdcluster.worker.server.cli as c\n"
        "assert 'torch' not in sys.modules\n"
        "from pdcluster.worker.engine.omp_spin import apply_spin_defaults\n"
        "env = {}\n"
        "print(apply_spin_defaults(env))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == str({"GOMP_SPINCOUNT": SPIN_COUNT})
