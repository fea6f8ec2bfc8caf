"""`pdcluster kv-budget`: KV-cache bytes for a model shape and a workload."""

from __future__ import annotations

import argparse
import json
import sys

from pdcluster.operator.planner import DTYPE_BYTES, PlanError, kv_budget
from pdcluster.worker.api import cli_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # every flag is required (no defaults to show); bad values are refused at parse time, as serve does
    a = parser.add_argument
    a("--layers", type=cli_args.positive_int, required=True, help="transformer layers")
    a("--kv-heads", type=cli_args.positive_int, required=True, help="KV heads per layer (GQA: fewer than heads)")
    a("--head-dim", type=cli_args.positive_int, required=True, help="dimension of one head")
    a("--dtype", required=True, type=str.lower, choices=sorted(DTYPE_BYTES), help="KV element type")
    a("--seq-len", type=cli_args.positive_int, required=True, help="tokens per sequence (prompt + output)")
    a("--batch", type=cli_args.positive_int, required=True, help="sequences held at once")
    a("--json", action="store_true", help="print one JSON object (default: text)")


def run(args: argparse.Namespace) -> int:
    try:
        b = kv_budget(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                      seq_len=args.seq_len, batch=args.batch)
    except PlanError as e:
        print(f"pdcluster kv-budget: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(b.to_dict(), sort_keys=True))
        return 0
    print(f"per token: {b.bytes_per_token:,} B ({b.bytes_per_token / 2**20:.3g} MiB) "
          f"= 2 x {args.layers} layers x {args.kv_heads} kv heads x {args.head_dim} x {args.dtype}")
    if b.scale_bytes_per_token:
        print(f"           + {b.scale_bytes_per_token:,} B of float32 scales")
    print(f"total:     {b.total_bytes:,} B = {b.total_bytes / 1e9:.1f} GB ({b.total_bytes / 2**30:.1f} GiB) "
          f"for {args.seq_len} tokens x {args.batch} sequences")
    if b.scale_bytes_per_token:
        print(f"           {b.total_bytes_with_scales / 1e9:.1f} GB with scales")
    return 0
