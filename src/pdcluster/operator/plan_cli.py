"""`pdcluster plan`: prefill/decode replicas for a workload, on the autoscaler's own formula.

Capacities are per instance, an instance being one worker pod of its pool's layout: with
`--prefill-tp/--decode-tp` (spec.<pool>.tensorParallelSize) the replica counts do not change, only the GPUs
they hold (replicas x TP), which the plan reports. Measure the capacities at the layout you will deploy.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdcluster.operator import parallel
from pdcluster.operator.planner import Bounds, Plan, PlanError, plan
from pdcluster.worker.api import cli_args


def headroom(text: str) -> float:
    v = cli_args.positive_float(text)
    if v < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1 (a multiple of the request rate)")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Bad numbers are refused at parse time (as `pdcluster serve` does); the cross-flag rules (max >= min,
    # budget >= the minimums) are the planner's, reported as one `error:` line by run().
    a = parser.add_argument
    a("--input-len", type=cli_args.positive_float, required=True, help="mean prompt tokens per request (I)")
    a("--output-len", type=cli_args.positive_float, required=True, help="mean output tokens per request (O)")
    a("--prefill-capacity", type=cli_args.positive_float, required=True,
      help="prompt tokens/s one prefill instance sustains (C_p)")
    a("--decode-capacity", type=cli_args.positive_float, required=True,
      help="output tokens/s one decode instance sustains (C_d)")
    a("--decode-join-seconds", type=cli_args.non_negative_float, default=0.0,
      help="decode instance-seconds of admitting one transferred request (t_join: KV import, first step), "
           "from `pdcluster profile --url ROUTER` (default: %(default)s, the formula without it)")
    a("--slo-tpot", type=cli_args.positive_float, default=None,
      help="TPOT objective in seconds: the colocation advice also says colocate when one prompt's prefill (I/C_p) "
           "fits within it (default: none, that rule off)")
    a("--request-rate", type=cli_args.non_negative_float, default=None,
      help="requests/s to provision for (λ) (default: none, only the ratio is computed)")
    a("--headroom", type=headroom, default=1.5, help="provision for this multiple of λ (default: %(default)s)")
    a("--min-prefill", type=cli_args.non_negative_int, default=1, help="fewest prefill replicas (default: %(default)s)")
    a("--max-prefill", type=cli_args.positive_int, default=None,
      help="most prefill replicas (default: no limit)")
    a("--min-decode", type=cli_args.non_negative_int, default=1, help="fewest decode replicas (default: %(default)s)")
    a("--max-decode", type=cli_args.positive_int, default=None, help="most decode replicas (default: no limit)")
    a("--max-total-replicas", type=cli_args.positive_int, default=None,
      help="budget for prefill + decode together, scaled down keeping the ratio (default: no limit)")
    a("--prefill-tp", type=int, choices=parallel.TP_SIZES, default=1,
      help="tensor-parallel size (GPUs) of one prefill instance; --prefill-capacity is per such instance "
           "(default: %(default)s)")
    a("--decode-tp", type=int, choices=parallel.TP_SIZES, default=1,
      help="tensor-parallel size (GPUs) of one decode instance; --decode-capacity is per such instance "
           "(default: %(default)s)")
    a("--json", action="store_true", help="print one JSON object (default: text)")


def gpus(result: Plan, prefill_tp: int, decode_tp: int) -> dict[str, int | None]:
    """GPUs the planned pools hold: replicas x TP (None without a request rate)."""
    p = parallel.pool_gpus(result.prefill_replicas, prefill_tp)
    d = parallel.pool_gpus(result.decode_replicas, decode_tp)
    return {"prefill_tp": prefill_tp, "decode_tp": decode_tp, "prefill_gpus": p, "decode_gpus": d,
            "total_gpus": None if p is None or d is None else p + d}


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
            decode_join_seconds=args.decode_join_seconds,
            slo_tpot=args.slo_tpot,
        )
    except PlanError as e:
        print(f"pdcluster plan: error: {e}", file=sys.stderr)
        return 2
    layout = gpus(result, args.prefill_tp, args.decode_tp)
    if args.json:
        print(json.dumps({**result.to_dict(), **layout}, sort_keys=True))
        return 0
    print(f"prefill: {result.prefill_seconds_per_request:.4g} s/request "
          f"(input {args.input_len:g} tokens / {args.prefill_capacity:g} tok/s)")
    join = f" + {args.decode_join_seconds:g} s joining" if args.decode_join_seconds else ""
    print(f"decode:  {result.decode_seconds_per_request:.4g} s/request "
          f"(output {args.output_len:g} tokens / {args.decode_capacity:g} tok/s{join})")
    print(f"ratio:   {result.ratio:.4g} decode instances per prefill instance (1:{result.ratio:.3g})")
    if result.prefill_replicas is None:
        print("replicas: pass --request-rate for replica counts")
    else:
        print(f"replicas at {args.request_rate:g} req/s x{args.headroom:g} headroom: "
              f"{result.prefill_replicas} prefill, {result.decode_replicas} decode "
              f"(unrounded {result.raw_prefill:.4g} / {result.raw_decode:.4g})")
        if args.prefill_tp > 1 or args.decode_tp > 1:
            print(f"GPUs:    {layout['prefill_gpus']} prefill ({result.prefill_replicas} x TP {args.prefill_tp}) + "
                  f"{layout['decode_gpus']} decode ({result.decode_replicas} x TP {args.decode_tp}) "
                  f"= {layout['total_gpus']}")
        if result.limited:
            print(f"limited by: {', '.join(result.limited_by)}")
    print(f"advice:  {result.advice['message']}")
    return 0
