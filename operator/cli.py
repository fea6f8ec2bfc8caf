"""`pdcluster operator`: run the kopf operator against the in-cluster service account or the kubeconfig."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                        help="watch only this namespace (repeatable, exact names); default: all namespaces")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--standalone", action="store_true", default=True,
                      help="run without kopf peering (the default; run one replica)")
    mode.add_argument("--peering", metavar="NAME", default=None,
                      help="use kopf peering NAME for active/standby replicas (needs kopf's peering CRDs)")
    parser.add_argument("--metrics-port", type=int, default=8080,
                        help="serve the operator's Prometheus metrics on this port (0: off)")
    parser.add_argument("--metrics-address", default="0.0.0.0", metavar="ADDR",
                        help="bind the metrics server to this address (default 0.0.0.0, as in a pod; "
                             "127.0.0.1 for a local run)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8081/healthz",
                        help="kopf liveness endpoint URL ('' to disable)")
    parser.add_argument("--resync-seconds", type=float, default=60.0,
                        help="periodic reconcile of every PDCluster (drift correction)")
    parser.add_argument("-v", "--verbose", action="store_true")


def run(args: argparse.Namespace) -> int:
    import kopf
    from pdcluster.operator import handlers, opmetrics
    from prometheus_client import start_http_server

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # kopf logs every handler run at INFO (one line per watched Deployment/Service change): keep
        # its per-object chatter to warnings and errors; our own decisions log at INFO.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.resync_seconds <= 0:
        print("pdcluster operator: error: --resync-seconds must be > 0", file=sys.stderr)
        return 2
    handlers.RUNTIME.resync_seconds = args.resync_seconds
    if args.metrics_port:
        try:
            start_http_server(args.metrics_port, addr=args.metrics_address, registry=opmetrics.REGISTRY)
        except OSError as e:  # address not local, port taken, bad name
            print(f"pdcluster operator: error: cannot serve metrics on {args.metrics_address}:{args.metrics_port}: "
                  f"{e}", file=sys.stderr)
            return 2
    namespaces = list(args.namespace)
    try:
        asyncio.run(kopf.operator(
            clusterwide=not namespaces,
            namespaces=namespaces,
            standalone=args.peering is None,
            peering_name=args.peering,
            liveness_endpoint=args.liveness or None,
        ))
    except KeyboardInterrupt:
        return 130
    return 0
