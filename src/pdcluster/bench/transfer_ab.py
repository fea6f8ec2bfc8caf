"""Before/after of the TCP KV transport in one run: this tree's connector against a git revision's, through the
same harness (`transfer_pair.py`: raw TCP and each version's cases interleaved per round, medians).

    python -m pdcluster.bench.transfer_ab --rev 2418fda --sizes-mib 1,16,64,256 --reps 5 [--json OUT]

The revision's `worker/transfer/*.py` are copied into a temporary package (`kvt_<rev>`, its imports of
`pdcluster.worker.transfer` pointed at itself) that the spawned receiver imports from PYTHONPATH; the rest of
the tree (engine, kernels) is this one's. Prints GB/s of fp32 KV per cell, each as % of the raw TCP cell
measured beside it, and "paired" = the median over rounds of new/old in the same round.

    python -m pdcluster.bench.transfer_ab --nixl-staged --sizes-mib 1,4,16,64 --reps 7 --cases fp32

compares the NIXL backend cache to cache (`nixl_direct.py`) with the same backend through staging (its caches
left unregistered), both this tree's, the same way; `--nixl-fabric` and `--tcp-fabric` compare a backend with
`--kv-transfer-integrity fabric` against the same backend with the default `mac`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from pdcluster.bench import transfer_pair

ROOT = Path(__file__).resolve().parent.parent


def build_before(rev: str, dest: Path) -> str:
    """Write the transport of `rev` as package `kvt_<rev>` under `dest`; returns its connector's module name."""
    name = f"kvt_{rev[:12]}"
    pkg = dest / name
    pkg.mkdir(parents=True, exist_ok=True)
    files = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "worker/transfer/"],
                           check=True, capture_output=True, text=True).stdout.split()
    for f in files:
        if f.endswith(".py"):
            src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{f}"], check=True, capture_output=True,
                                 text=True).stdout
            (pkg / Path(f).name).write_text(src.replace("pdcluster.worker.transfer", name))
    return f"{name}.connector"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", default="2418fda")
    p.add_argument("--sizes-mib", default="1,16,64,256")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cases", default="fp32,int8,codes")
    p.add_argument("--nixl", action="store_true", help="also the NIXL backend (this tree), its own raw cell")
    p.add_argument("--nixl-staged", action="store_true",
                   help="instead: this tree's NIXL backend cache to cache (new) against the same backend with "
                        "its caches unregistered, i.e. through staging (before); --rev is not used")
    p.add_argument("--nixl-fabric", action="store_true",
                   help="instead: this tree's NIXL backend with --kv-transfer-integrity fabric (new) against "
                        "the default mac (before); --rev is not used")
    p.add_argument("--tcp-fabric", action="store_true",
                   help="instead: this tree's TCP backend with --kv-transfer-integrity fabric (new) against the "
                        "default mac (before); --rev is not used")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    cases = tuple(c for c in transfer_pair.CASES if c[0] in a.cases.split(","))
    out: list[dict[str, Any]] = []
    same_tree = a.nixl_staged or a.nixl_fabric or a.tcp_fabric  # both sides this tree's: no --rev, no --nixl
    with tempfile.TemporaryDirectory() as tmp:
        if a.nixl_staged:
            first, old = transfer_pair.NIXL, transfer_pair.NIXL + transfer_pair.STAGED
        elif a.nixl_fabric:
            first, old = transfer_pair.NIXL + transfer_pair.FABRIC, transfer_pair.NIXL
        elif a.tcp_fabric:
            first, old = transfer_pair.MODULE + transfer_pair.FABRIC, transfer_pair.MODULE
        else:
            first, old = transfer_pair.MODULE, build_before(a.rev, Path(tmp))
            os.environ[transfer_pair.EXTRA_PACKAGES] = tmp  # this process and the spawned receivers load it
        for mib in (int(m) for m in a.sizes_mib.split(",") if m):
            load = os.getloadavg()[0]
            mods = [first, old] + ([transfer_pair.NIXL] if a.nixl and not same_tree else [])
            r = transfer_pair.side_by_side(mib << 20, a.reps, mods, cases)
            r["load"] = (load, os.getloadavg()[0])
            out.append(r)
            raw = statistics.median(r["runs"]["raw"] + r["runs"][f"raw@{old}"])
            cells = []
            for name, _, _ in cases:
                new, before = r[name], r[f"{name}@{old}"]
                paired = statistics.median(x / y for x, y in zip(r["runs"][name], r["runs"][f"{name}@{old}"],
                                                                 strict=True))
                cells.append(f"{name} {new:.2f} ({new / raw:.0%}) / {before:.2f} ({before / raw:.0%}) x{paired:.2f}")
            if a.nixl and not same_tree:
                nx = transfer_pair.NIXL
                cells += [f"NIXL {name} {r[f'{name}@{nx}']:.2f} ({r[f'{name}@{nx}'] / raw:.0%})" for name, _, _ in cases]
            print(f"{mib:>4} MiB x {r['layers']:>2} layers, load {r['load'][0]:.1f}->{r['load'][1]:.1f}: "
                  f"raw {r['raw']:.2f} / {r[f'raw@{old}']:.2f} | " + " | ".join(cells), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
