"""`python -m pdcluster.kernels.cpu`: build every native CPU kernel now, so no worker pays the compile.

`make setup` runs it once; the modules land in the cache `native.py` names, and later processes only load
them. It never fails the caller: a kernel that cannot be built here is reported and the torch path runs.
"""

from __future__ import annotations

import logging
import time

from pdcluster.kernels.cpu import native, quant, step


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reason = native.unrunnable_reason()
    if reason is not None:
        print(f"native CPU kernels: off ({reason}); the torch paths run")
        return 0
    for name, build in (("decode step (linear + attention)", step.module),
                        ("int8 KV quantization", quant.module)):
        t0 = time.monotonic()
        mod = build()
        state = "ready" if mod is not None else "not built (see the line above); its torch path runs"
        print(f"native CPU kernel {name}: {state} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
