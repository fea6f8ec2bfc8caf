"""How long OpenMP workers spin between parallel regions, chosen for a served engine before torch loads.

libgomp (PyTorch's OpenMP on Linux) makes an idle worker spin up to 300,000 times before it sleeps, but only
1,000 times once the process has more OpenMP threads than CPUs — which a server has as soon as two threads
(the engine thread and the main thread, which touched torch while loading) each own a team. So how a served
step ran depended on that accident. Measured here (benchmarks/served_vs_hf.py, docs/benchmarks/engine.md at 5f904a5) on the 2-core VM
under load from other processes: a batch-1 decode step in the main thread ran at 2.3-2.7 tok/s with the full
spin and 34-49 tok/s with GOMP_SPINCOUNT=2000 or OMP_WAIT_POLICY=PASSIVE: a spinning worker burns the time
slice its partner needs to reach the barrier. A short bounded spin keeps that win while still catching the
next parallel region of a step (back to back, microseconds apart) without a futex sleep.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

SPIN_COUNT = "2000"
# Any of these means the user chose the OpenMP wait behaviour: never override it.
USER_KNOBS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")


def spin_defaults(env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``env`` (empty when the user set any OpenMP wait knob)."""
    if any(k in env for k in USER_KNOBS):
        return {}
    return {"GOMP_SPINCOUNT": SPIN_COUNT}


def apply_spin_defaults(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the defaults in the process environment and return what was set. libgomp reads them once, when
    torch is first imported: once torch is loaded (e.g. serve run inside a test process) this sets nothing."""
    if "torch" in sys.modules:
        return {}
    env = os.environ if env is None else env
    added = spin_defaults(env)
    env.update(added)
    return added
