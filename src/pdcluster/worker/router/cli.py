"""`pdcluster router`: the OpenAI-compatible front of a prefill pool and a decode pool."""

from __future__ import annotations

import argparse
import logging
import sys

from pdcluster.worker.api import tracing
from pdcluster.worker.api.cli_args import port, worker_url
from pdcluster.worker.api.tool_calls import PARSERS
from pdcluster.worker.router import options
from pdcluster.worker.router.options import RouterOptions


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
    options.add_arguments(parser)  # the knobs, from their one declaration (router/options.py)
    a("--engine", choices=["pdcluster", "vllm"], default="pdcluster",
      help="what the workers run: pdcluster (our /internal/* disaggregation) or vllm (vLLM OpenAI servers with "
           "the NixlConnector: the router drives vLLM's kv_transfer_params handshake; docs/vllm.md)")
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

    opts = RouterOptions.from_args(args)
    pool = Pool(prefill_urls=list(args.prefill), decode_urls=list(args.decode),
                prefill_services=list(args.prefill_service), decode_services=list(args.decode_service),
                interval=opts.health_interval, prefix_routing=opts.routing == "prefix",
                secret=optional_secret(args.internal_secret_file), engine=args.engine)
    state = RouterState(pool, opts, cluster=args.cluster_name, tool_call_parser=args.tool_call_parser)
    from pdcluster.worker.api import api_key

    return build_router_app(state, api_key=api_key.resolve(args.api_key))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (args.decode or args.decode_service):
        print("pdcluster router: error: at least one --decode URL or --decode-service is required", file=sys.stderr)
        return 2
    from pdcluster.worker.transfer.secret import SecretError

    try:
        tracing.configure("router", args.otlp_endpoint, cluster=args.cluster_name)
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
