"""`pdcluster operator`: run the kopf operator against the in-cluster service account or the kubeconfig.

Every flag is checked at parse time (one `error: argument --x: ...` line, exit 2), as `pdcluster serve`
does, and `--help` shows each default.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import re
import socket
import sys
import time
from urllib.parse import urlsplit

from pdcluster.worker.api import cli_args

# RFC 1123 label (namespaces) and subdomain (kopf peering object names)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def namespace_name(text: str) -> str:
    if len(text) > 63 or not _DNS_LABEL.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a namespace name (RFC 1123 label)")
    return text


def peering_name(text: str) -> str:
    if len(text) > 253 or not _DNS_SUBDOMAIN.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a Kubernetes object name (RFC 1123 subdomain)")
    return text


def port_or_off(text: str) -> int:
    return 0 if text.strip() == "0" else cli_args.port(text)


def ip_address(text: str) -> str:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IP address") from None
    return text


def liveness_url(text: str) -> str:
    """http://HOST:PORT/PATH, or '' (off): kopf binds HOST:PORT and serves PATH."""
    if text == "":
        return text
    try:
        parts = urlsplit(text)
        p = parts.port
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a liveness URL ({e})") from None
    if parts.scheme != "http" or not parts.hostname or not p:
        raise argparse.ArgumentTypeError(f"{text!r} is not a liveness URL: expected http://HOST:PORT/PATH or ''")
    return text


def peering_priority(text: str) -> int | None:
    """`auto` (None) or an integer."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or 'auto'") from None


def auto_priority(now_ms: int, tiebreak: int) -> int:
    """kopf peering runs only the live peer with the highest priority, and pauses *all* peers that share
    one. So each replica takes a distinct priority that falls with its start time: the oldest replica stays
    active, a restarted or newly scheduled one waits as standby instead of taking over (no handover on
    every rollout). `tiebreak` (0..999) separates replicas started in the same millisecond."""
    return -(now_ms * 1000 + tiebreak)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--namespace", action="append", default=[], metavar="NS", type=namespace_name,
                        help="watch only this namespace (repeatable, exact names); default: all namespaces")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--standalone", action="store_true", default=True,
                      help="run without kopf peering (the default; run one replica)")
    mode.add_argument("--peering", metavar="NAME", default=None, type=peering_name,
                      help="use the kopf peering object NAME (ClusterKopfPeering, or KopfPeering in each "
                           "--namespace) for active/standby replicas; default: none (standalone)")
    parser.add_argument("--peering-priority", metavar="N|auto", default="auto", type=peering_priority,
                        help="this replica's kopf peering priority (the highest live one is active); auto: "
                             "older replicas first (default: %(default)s)")
    parser.add_argument("--metrics-port", type=port_or_off, default=8080, metavar="PORT",
                        help="serve the operator's Prometheus metrics on this port, 0: off (default: %(default)s)")
    parser.add_argument("--metrics-address", default="0.0.0.0", metavar="ADDR", type=ip_address,
                        help="bind the metrics server to this address (as in a pod; 127.0.0.1 for a local "
                             "run) (default: %(default)s)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8081/healthz", type=liveness_url, metavar="URL",
                        help="kopf liveness endpoint URL, '' to disable (default: %(default)s)")
    parser.add_argument("--resync-seconds", type=cli_args.positive_float, default=60.0, metavar="S",
                        help="periodic reconcile of every PDCluster, drift correction (default: %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (default: off)")


def run(args: argparse.Namespace) -> int:
    import kopf
    from prometheus_client import start_http_server

    from pdcluster.operator import handlers, opmetrics, peering

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # kopf logs every handler run at INFO (one line per watched Deployment/Service change): keep
        # its per-object chatter to warnings and errors; our own decisions log at INFO.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    handlers.RUNTIME.resync_seconds = args.resync_seconds
    if args.metrics_port:
        try:
            start_http_server(args.metrics_port, addr=args.metrics_address, registry=opmetrics.REGISTRY)
        except OSError as e:  # address not local, port taken
            print(f"pdcluster operator: error: cannot serve metrics on {args.metrics_address}:{args.metrics_port}: "
                  f"{e}", file=sys.stderr)
            return 2
    namespaces = list(args.namespace)
    priority = None
    handlers.RUNTIME.peering = None
    if args.peering is not None:
        import random

        priority = args.peering_priority
        if priority is None:
            priority = auto_priority(int(time.time() * 1000), random.randrange(1000))
        identity = os.environ.get("POD_ID") or f"{socket.gethostname()}/{os.getpid()}/{random.randrange(10**6)}"
        handlers.RUNTIME.peering = peering.Peering(name=args.peering, identity=identity, priority=priority,
                                                   clusterwide=not namespaces)
        logging.getLogger(__name__).info("kopf peering %r as %r with priority %d", args.peering, identity, priority)
    try:
        asyncio.run(kopf.operator(
            clusterwide=not namespaces,
            namespaces=namespaces,
            standalone=args.peering is None,
            peering_name=args.peering,
            priority=priority,
            # kopf types this as its Identity (a NewType of str) without exporting the name: a str is what it takes
            identity=handlers.RUNTIME.peering.identity if handlers.RUNTIME.peering else None,  # type: ignore[arg-type]
            liveness_endpoint=args.liveness or None,
        ))
    except KeyboardInterrupt:
        return 130
    return 0
