"""`pdcluster serve`: one inference worker (prefill, decode or both) behind the OpenAI API.

Every mistake a user can make on the command line (a bad flag value, a model folder that is
not a model, CUDA asked for on a CPU machine) ends as one `pdcluster serve: error: ...` line
and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path
from typing import Any, NoReturn

from pdcluster.worker import options as declared
from pdcluster.worker.api import cli_args, tracing
from pdcluster.worker.api.tool_calls import PARSERS
from pdcluster.worker.engine.options import ENGINE_OPTIONS
from pdcluster.worker.transfer import options as kv_options
from pdcluster.worker.transfer.options import TransferOptions

log = logging.getLogger("pdcluster.serve")
PROG = "pdcluster serve"


class UsageError(Exception):
    """A user mistake: reported as one line, exit code 2."""


class StartupError(Exception):
    """The environment failed us (I/O, device memory): one line, exit code 1."""


def _error(self: argparse.ArgumentParser, message: str) -> NoReturn:
    # argparse would print the whole usage block; one line that names the problem is clearer.
    print(f"{PROG}: error: {message} (see --help)", file=sys.stderr)
    raise SystemExit(2)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, generated from its one declaration (pdcluster.worker.engine.options)."""
    declared.add_arguments(parser.add_argument_group("engine"), ENGINE_OPTIONS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.error = _error.__get__(parser)  # type: ignore[method-assign]
    a = parser.add_argument
    a("--model", required=True, metavar="DIR", help="Hugging Face model folder (config.json, *.safetensors)")
    a("--role", choices=["both", "prefill", "decode"], default="both", help="which phase this worker serves")
    a("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a container)")
    a("--port", type=cli_args.port, default=8000)
    a("--max-queue-depth", type=cli_args.positive_int, default=None, help="429 when this many requests wait")
    a("--request-timeout", type=cli_args.non_negative_float, default=None, metavar="S", help="504 after S seconds")
    a("--served-model-name", default=None, help="model id in the API (default: the folder's name)")
    a("--chat-template", default=None, metavar="FILE",
      help="Jinja chat template to use instead of the model's (tokenizer_config.json / chat_template.jinja)")
    a("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    a("--tool-call-parser", choices=list(PARSERS), default=None,
      help='parse tool calls out of the text for tool_choice "auto" (and tools sent without tool_choice): hermes '
           'reads Hermes / Qwen <tool_call>{json}</tool_call> blocks. A named or "required" tool_choice needs no '
           'parser. (default: none; "auto" is refused)')
    a("--api-key", default=None, metavar="KEY",
      help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize (else $PDCLUSTER_API_KEY; "
           "default: no key). The router calls workers' /internal/* routes, which take the internal token instead")
    a("--tensor-parallel-size", type=cli_args.positive_int, default=1, metavar="N",
      help="shard the model over N ranks, one process each, started by this worker (CPU: gloo; CUDA: one GPU "
           "per rank, NCCL); N must divide the attention heads, and the KV heads or be a multiple of them "
           "(default 1)")
    tracing.add_argument(parser)
    # from the KV transfer's one declaration (transfer/options.py)
    kv_options.add_arguments(parser.add_argument_group("KV transfer (prefill -> decode)"))
    add_engine_arguments(parser)


def transfer_options(args: argparse.Namespace) -> TransferOptions:
    """The --kv-transfer-* flags as the object passed down to the transfer path (values checked at parse time)."""
    opts = TransferOptions.from_args(args)
    if opts.secret_file and not Path(opts.secret_file).is_file():
        raise UsageError(f"--kv-transfer-secret-file {opts.secret_file!r} does not exist")
    return opts


def check_model_folder(path: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise UsageError(f"--model {path!r} is not a directory")
    if not (folder / "config.json").is_file():
        raise UsageError(f"--model {path!r} is not a Hugging Face model folder (no config.json)")
    return folder


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Flag values under EngineConfig's field names (the flags' dests are those names)."""
    values = {"model": args.model, **{opt.name: getattr(args, opt.name) for opt in ENGINE_OPTIONS}}
    return {**values, "tensor_parallel_size": getattr(args, "tensor_parallel_size", 1)}


def make_config(config_cls: Any, values: dict[str, Any]) -> Any:
    # None = "derive it" (model length, KV budget, threads): leave it to the config's own default.
    return config_cls(**{k: v for k, v in values.items() if v is not None})


def check_port_free(host: str, port: int) -> None:
    # uvicorn would report a busy port only after the model has loaded; fail fast instead.
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r} cannot be resolved ({e})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None


def check_tensor_parallel(args: argparse.Namespace, folder: Path) -> None:
    """--tensor-parallel-size must fit the model's head counts (and the GPUs) before anything loads."""
    tp = getattr(args, "tensor_parallel_size", 1)
    if tp == 1:
        return
    import torch

    from pdcluster.worker.engine.config import ModelConfig
    from pdcluster.worker.engine.parallel.shard import check_tp

    try:
        check_tp(ModelConfig.from_folder(folder), tp)
    except ValueError as e:
        raise UsageError(f"--tensor-parallel-size {tp} does not fit {str(folder)!r}: {e}") from None
    # --role prefill/decode: each rank sends/receives its own KV heads (server/tp_direct.py), or rank 0
    # relays whole layers (parallel/kv_relay.py): any prefill layout pairs with any decode layout
    if args.device == "cuda" and torch.cuda.device_count() < tp:
        raise UsageError(f"--tensor-parallel-size {tp} needs {tp} GPUs; {torch.cuda.device_count()} visible")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # the engine's config/loader name what is wrong in a ValueError
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except StartupError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    folder = check_model_folder(args.model)
    transfer = transfer_options(args)
    chat_template = None
    if getattr(args, "chat_template", None):
        from pdcluster.worker.engine.tokenizer import read_chat_template

        chat_template = read_chat_template(args.chat_template)  # before the model loads: fail fast
    check_port_free(args.host, args.port)
    tracing.configure(args.role, getattr(args, "otlp_endpoint", None))  # a bad $OTEL_* endpoint: ValueError, exit 2
    if args.full_precision_layers and args.kv_cache_dtype == "auto":
        log.warning("--full-precision-layers has no effect with --kv-cache-dtype auto")

    from pdcluster.worker.engine.omp_spin import apply_spin_defaults

    # before torch loads OpenMP: a short bounded spin between parallel regions (why: worker/engine/omp_spin.py)
    log.debug("OpenMP defaults: %s", apply_spin_defaults() or "none (set by the user, or torch already loaded)")
    import torch  # deferred: `pdcluster serve --help` must stay fast

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was given but no CUDA device is available")
    check_tensor_parallel(args, folder)


    from pdcluster.worker.engine.async_engine import AsyncEngine
    from pdcluster.worker.engine.llm_engine import EngineConfig
    from pdcluster.worker.engine.thread_policy import yield_on_wakeup
    from pdcluster.worker.server.app import build_app

    config = make_config(EngineConfig, engine_config_kwargs(args))
    log.info("loading %s", folder)
    try:
        engine = AsyncEngine.from_config(config)  # a ValueError names what is wrong with the folder
    except (OSError, RuntimeError, MemoryError) as e:  # unreadable files, CUDA/OOM: not a usage error
        raise StartupError(f"cannot load the model from {str(folder)!r}: {type(e).__name__}: {e}") from None
    if chat_template is not None:
        if engine.tokenizer is None:
            raise UsageError("--chat-template needs the model's tokenizer (the folder has no tokenizer.json)")
        engine.tokenizer.chat_template = chat_template
    name = args.served_model_name or folder.resolve().name
    # Prefill/decode KV transfer: the /internal/* routes and the transfer listener (docs/disaggregation.md).
    # Without a shared secret there is no transfer listener (logged); an unusable one is a usage error.
    from pdcluster.worker.server.internal_routes import Disaggregation
    from pdcluster.worker.server.prefix_events import prefix_events_router

    disagg = Disaggregation.from_options(engine, args.role, transfer, listen_host=args.host)

    async def start() -> None:
        engine.start()
        # after the engine thread exists (threads inherit it): HTTP work never preempts a step (thread_policy.py)
        yield_on_wakeup()

    async def stop() -> None:
        await asyncio.to_thread(engine.shutdown)
        await asyncio.to_thread(engine.engine.close)  # tensor-parallel followers, if any

    app = build_app(
        engine,
        role=args.role,
        served_model_name=name,
        model_aliases=[args.model, str(folder.resolve()), folder.resolve().name],
        max_queue_depth=args.max_queue_depth,
        request_timeout=args.request_timeout,
        routers=[disagg.router, prefix_events_router(engine, disagg.secret)],  # the router's prefix index
        on_startup=[start, disagg.start],
        on_shutdown=[disagg.stop, stop],
        internal_secret=disagg.secret,  # /drain and /undrain take the same token as /internal/*
        tool_call_parser=args.tool_call_parser,
    )
    from pdcluster.worker.api import api_key

    api_key.install(app, api_key.resolve(args.api_key))
    log.info("serving %s as %r (role=%s) on http://%s:%d", folder, name, args.role, args.host, args.port)
    from pdcluster.worker.api.http_limits import serve

    # read timeouts and a connection limit: slow or idle clients cannot hold connections forever
    serve(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=30)
    return 0

