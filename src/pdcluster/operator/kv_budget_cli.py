"""`pdcluster kv-budget`: KV-cache bytes for a model shape and a workload, and per tensor-parallel rank
(KV heads split across ranks, replicated when there are fewer than ranks; weights split evenly)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pdcluster.operator import parallel
from pdcluster.operator.planner import DTYPE_BYTES, PlanError, kv_budget
from pdcluster.worker.api import cli_args


def params(text: str) -> float:
    try:
        return parallel.parse_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # the model shape and workload are required (no defaults to show); bad values are refused at parse time
    a = parser.add_argument
    a("--layers", type=cli_args.positive_int, required=True, help="transformer layers")
    a("--kv-heads", type=cli_args.positive_int, required=True, help="KV heads per layer (GQA: fewer than heads)")
    a("--head-dim", type=cli_args.positive_int, required=True, help="dimension of one head")
    a("--dtype", required=True, type=str.lower, choices=sorted(DTYPE_BYTES), help="KV element type")
    a("--seq-len", type=cli_args.positive_int, required=True, help="tokens per sequence (prompt + output)")
    a("--batch", type=cli_args.positive_int, required=True, help="sequences held at once")
    a("--tensor-parallel-size", type=int, choices=parallel.TP_SIZES, default=1,
      help="ranks (GPUs) of one worker, as spec.<pool>.tensorParallelSize: KV and weights per rank "
           "(default: %(default)s)")
    a("--heads", type=cli_args.positive_int, default=None,
      help="attention heads per layer: also check that the TP size divides them (default: not checked)")
    a("--params", type=params, default=None, metavar="N",
      help="model parameters (70B, 8e9, ...): weights in total and per rank (default: not reported)")
    a("--weight-dtype", type=str.lower, choices=sorted(DTYPE_BYTES), default="bf16",
      help="weight element type with --params (default: %(default)s)")
    a("--json", action="store_true", help="print one JSON object (default: text)")


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB ({n / 2**30:.1f} GiB)"


def budget(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the command prints, as one JSON-able dict (PlanError / ValueError on bad input)."""
    tp = args.tensor_parallel_size
    b = kv_budget(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                  seq_len=args.seq_len, batch=args.batch)
    per_rank_heads = parallel.kv_heads_per_rank(args.kv_heads, tp, args.heads)
    r = kv_budget(layers=args.layers, kv_heads=per_rank_heads, head_dim=args.head_dim, dtype=args.dtype,
                  seq_len=args.seq_len, batch=args.batch)
    out = b.to_dict()
    out["inputs"].update(tensor_parallel_size=tp, heads=args.heads)
    out.update(tensor_parallel_size=tp, kv_heads_per_rank=per_rank_heads,
               kv_replication=parallel.kv_replication(args.kv_heads, tp),
               bytes_per_token_per_rank=r.bytes_per_token, total_bytes_per_rank=r.total_bytes,
               total_bytes_with_scales_per_rank=r.total_bytes_with_scales)
    if args.params is not None:
        width = DTYPE_BYTES[args.weight_dtype]
        out["inputs"].update(params=args.params, weight_dtype=args.weight_dtype)
        out.update(weight_bytes=parallel.weight_bytes_per_rank(args.params, width, 1),
                   weight_bytes_per_rank=parallel.weight_bytes_per_rank(args.params, width, tp))
    return out


def run(args: argparse.Namespace) -> int:
    try:
        out = budget(args)
    except (PlanError, ValueError) as e:
        print(f"pdcluster kv-budget: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    tp = out["tensor_parallel_size"]
    print(f"per token: {out['bytes_per_token']:,} B ({out['bytes_per_token'] / 2**20:.3g} MiB) "
          f"= 2 x {args.layers} layers x {args.kv_heads} kv heads x {args.head_dim} x {args.dtype}")
    if out["scale_bytes_per_token"]:
        print(f"           + {out['scale_bytes_per_token']:,} B of float32 scales")
    print(f"total:     {out['total_bytes']:,} B = {_gb(out['total_bytes'])} "
          f"for {args.seq_len} tokens x {args.batch} sequences")
    if out["scale_bytes_per_token"]:
        print(f"           {out['total_bytes_with_scales'] / 1e9:.1f} GB with scales")
    if tp > 1:
        rep = out["kv_replication"]
        how = f"each KV head on {rep} ranks" if rep > 1 else f"{args.kv_heads} / {tp}"
        print(f"per rank:  TP {tp}: {out['kv_heads_per_rank']} kv head(s) ({how}): "
              f"{out['bytes_per_token_per_rank']:,} B/token, {_gb(out['total_bytes_per_rank'])}"
              + (f", {out['total_bytes_with_scales_per_rank'] / 1e9:.1f} GB with scales"
                 if out["scale_bytes_per_token"] else ""))
    if "weight_bytes" in out:
        line = f"weights:   {args.params / 1e9:.4g}B params x {args.weight_dtype} = {_gb(out['weight_bytes'])}"
        if tp > 1:
            line += f"; per rank (TP {tp}): {_gb(out['weight_bytes_per_rank'])}"
        print(line)
        rank = out["weight_bytes_per_rank"] + out["total_bytes_with_scales_per_rank"]
        print(f"one rank:  weights + KV = {_gb(rank)} (plus activations and the CUDA context)")
    return 0
