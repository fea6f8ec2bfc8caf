"""`python -m pdcluster.kernels.cpu`: build every native CPU kernel now, so no worker pays the compile.

`make setup` runs it once; the modules land in the cache `native.py` names, and later processes only load
them. It never fails the caller (unless `--strict`): a kernel that cannot be built here is reported and the
torch path runs. The worker image runs it with `--strict` and ships the cache folder as its prebuilt kernels
(`PDCLUSTER_NATIVE_PREBUILT`, native.py).
"""

from __future__ import annotations

import argparse
import logging
import time

from pdcluster.kernels.cpu import native, quant, step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdcluster.kernels.cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a kernel this CPU could run was not built (an image build must not ship "
                        "without them by accident); a CPU that cannot run them still exits 0")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reason = native.unrunnable_reason()
    if reason is not None:
        print(f"native CPU kernels: off ({reason}); the torch paths run")
        return 0
    failed = []
    for name, build in (("decode step (linear + attention)", step.module),
                        ("int8 KV quantization", quant.module)):
        t0 = time.monotonic()
        mod = build()
        state = "ready" if mod is not None else "not built (see the line above); its torch path runs"
        print(f"native CPU kernel {name}: {state} ({time.monotonic() - t0:.1f} s)")
        if mod is None:
            failed.append(name)
    print(f"native CPU kernels: cache folder {native.cache_root()}")
    return 1 if a.strict and failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
