"""`pdcluster router`: the OpenAI-compatible front of a prefill pool and a decode pool."""

from __future__ import annotations

import argparse
import logging
import sys

from pdcluster.worker.api import cli_args, tracing
from pdcluster.worker.api.cli_args import port, worker_url
from pdcluster.worker.api.tool_calls import PARSERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--prefill", nargs="*", type=worker_url, default=[], metavar="URL",
      help="prefill worker URLs (http://host:port)")
    a("--decode", nargs="*", type=worker_url, default=[], metavar="URL",
      help="decode worker URLs (a `both` worker goes here too)")
    a("--prefill-service", action="append", default=[], metavar="NAME[:PORT]",
      help="Kubernetes (headless) Service of the prefill pool (NAME[:PORT] or http://NAME:PORT), re-resolved "
           "via DNS every probe interval")
    a("--decode-service", action="append", default=[], metavar="NAME[:PORT]",
      help="Kubernetes (headless) Service of the decode pool")
    a("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a container)")
    a("--port", type=port, default=8080)
    a("--max-queue-depth", type=cli_args.non_negative_int, default=256,
      help="requests waiting for their first token beyond which the router answers 429 (0: unbounded)")
    a("--disaggregation-threshold", type=cli_args.non_negative_int, default=256, metavar="TOKENS",
      help="prompts shorter than this prefill on the decode worker itself (0: always disaggregate)")
    a("--request-timeout", type=cli_args.non_negative_float, default=300.0, metavar="S", help="504 after S seconds (0: none)")
    a("--max-retries", type=cli_args.non_negative_int, default=2, help="re-runs of a request on another worker pair after failures")
    a("--decode-wait", type=cli_args.non_negative_float, default=30.0, metavar="S",
      help="how long a request waits for any healthy decode worker (e.g. the only one restarting) before it "
           "ends with a 503 / error event; keep it well under --request-timeout")
    a("--routing", choices=["prefix", "least-loaded"], default="prefix",
      help="prefix: prefer the worker believed to hold the prompt's longest cached prefix, within a load cap; "
           "least-loaded: ignore prefix caches (default: %(default)s)")
    a("--health-interval", type=cli_args.positive_float, default=1.0, metavar="S")
    a("--internal-secret-file", default=None, metavar="PATH",
      help="shared secret (the workers' --kv-transfer-secret-file; else $PDCLUSTER_KV_SECRET) that authenticates "
           "the router's /internal/* calls to workers")
    a("--api-key", default=None, metavar="KEY",
      help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize (else $PDCLUSTER_API_KEY; "
           "default: no key)")
    a("--cluster-name", default=None, help="value of the `pdcluster` metrics label")
    a("--tool-call-parser", choices=list(PARSERS), default=None,
      help='parse tool calls out of the text for tool_choice "auto" (and tools sent without tool_choice): hermes '
           'reads Hermes / Qwen <tool_call>{json}</tool_call> blocks. A named or "required" tool_choice needs no '
           'parser. On the router path the router\'s flag decides (default: none; "auto" is refused)')
    tracing.add_argument(parser)
    a("--log-level", choices=["debug", "info", "warning", "error"], default="info")


def build(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pdcluster.worker.router.app import RouterState, build_router_app
    from pdcluster.worker.router.pool import Pool
    from pdcluster.worker.transfer.secret import optional_secret

    pool = Pool(prefill_urls=list(args.prefill), decode_urls=list(args.decode),
                prefill_services=list(args.prefill_service), decode_services=list(args.decode_service),
                interval=args.health_interval, prefix_routing=getattr(args, "routing", "prefix") == "prefix",
                secret=optional_secret(getattr(args, "internal_secret_file", None)))
    state = RouterState(pool, max_queue_depth=args.max_queue_depth or None, threshold=args.disaggregation_threshold,
                        request_timeout=args.request_timeout or None, max_retries=args.max_retries,
                        cluster=args.cluster_name, decode_wait=args.decode_wait,
                        tool_call_parser=getattr(args, "tool_call_parser", None))
    from pdcluster.worker.api import api_key

    return build_router_app(state, api_key=api_key.resolve(getattr(args, "api_key", None)))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (args.decode or args.decode_service):
        print("pdcluster router: error: at least one --decode URL or --decode-service is required", file=sys.stderr)
        return 2
    if args.max_retries < 0 or args.max_queue_depth < 0 or args.disaggregation_threshold < 0 or not (
            args.decode_wait >= 0):
        print("pdcluster router: error: --max-retries, --max-queue-depth, --disaggregation-threshold and "
              "--decode-wait must be >= 0", file=sys.stderr)
        return 2

    from pdcluster.worker.transfer.secret import SecretError

    try:
        tracing.configure("router", getattr(args, "otlp_endpoint", None), cluster=args.cluster_name)
        app = build(args)
    except (SecretError, OSError, ValueError) as e:
        print(f"pdcluster router: error: {e}", file=sys.stderr)
        return 2
    logging.getLogger(__name__).info("router on http://%s:%d (prefill %s, decode %s)", args.host, args.port,
                                     args.prefill or args.prefill_service, args.decode or args.decode_service)
    from pdcluster.worker.api.http_limits import serve

    # read timeouts and a connection limit: slow or idle clients cannot hold connections forever
    serve(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=10)
    return 0
