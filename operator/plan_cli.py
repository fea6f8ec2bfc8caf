"""`pdcluster plan`: prefill/decode replicas for a workload, on the autoscaler's own formula."""

from __future__ import annotations

import argparse
import json
import sys

from pdcluster.operator.planner import Bounds, PlanError, plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=float, required=True, help="mean prompt tokens per request (I)")
    parser.add_argument("--output-len", type=float, required=True, help="mean output tokens per request (O)")
    parser.add_argument("--prefill-capacity", type=float, required=True,
                        help="prompt tokens/s one prefill instance sustains (C_p)")
    parser.add_argument("--decode-capacity", type=float, required=True,
                        help="output tokens/s one decode instance sustains (C_d)")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="requests/s to provision for (λ); without it only the ratio is computed")
    parser.add_argument("--headroom", type=float, default=1.5, help="provision for this multiple of λ (1.5)")
    parser.add_argument("--min-prefill", type=int, default=1)
    parser.add_argument("--max-prefill", type=int, default=None)
    parser.add_argument("--min-decode", type=int, default=1)
    parser.add_argument("--max-decode", type=int, default=None)
    parser.add_argument("--max-total-replicas", type=int, default=None,
                        help="budget for prefill + decode together (scaled down keeping the ratio)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        result = plan(
            input_len=args.input_len,
            output_len=args.output_len,
            prefill_capacity=args.prefill_capacity,
            decode_capacity=args.decode_capacity,
            request_rate=args.request_rate,
            headroom=args.headroom,
            bounds=Bounds(args.min_prefill, args.max_prefill, args.min_decode, args.max_decode,
                          args.max_total_replicas),
        )
    except PlanError as e:
        print(f"pdcluster plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), sort_keys=True))
        return 0
    print(f"prefill: {result.prefill_seconds_per_request:.4g} s/request "
          f"(input {args.input_len:g} tokens / {args.prefill_capacity:g} tok/s)")
    print(f"decode:  {result.decode_seconds_per_request:.4g} s/request "
          f"(output {args.output_len:g} tokens / {args.decode_capacity:g} tok/s)")
    print(f"ratio:   {result.ratio:.4g} decode instances per prefill instance (1:{result.ratio:.3g})")
    if result.prefill_replicas is None:
        print("replicas: pass --request-rate for replica counts")
    else:
        print(f"replicas at {args.request_rate:g} req/s x{args.headroom:g} headroom: "
              f"{result.prefill_replicas} prefill, {result.decode_replicas} decode "
              f"(unrounded {result.raw_prefill:.4g} / {result.raw_decode:.4g})")
        if result.limited:
            print(f"limited by: {', '.join(result.limited_by)}")
    return 0
