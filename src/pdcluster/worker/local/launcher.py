"""`pdcluster up`: the embedded default — a router and N prefill + M decode workers as separate OS processes on
loopback, supervised (a dying worker is restarted) and stopped cleanly on Ctrl-C/SIGTERM.

With no --model a small demo Llama is built once into the cache directory. With --demo it starts the cluster,
drives a short mixed workload through the router, prints TTFT/TPOT percentiles, throughput and the P:D
decision of the operator's planner for what it measured, and shuts down.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pdcluster.worker import options as declared
from pdcluster.worker.api import cli_args as types
from pdcluster.worker.api import tracing
from pdcluster.worker.api.tool_calls import PARSERS
from pdcluster.worker.engine import options as engine_options
from pdcluster.worker.local.supervisor import USAGE_ERROR, CrashLoop, Supervisor
from pdcluster.worker.router import options as router_options
from pdcluster.worker.transfer import options as kv_options

log = logging.getLogger("pdcluster.up")

START_TIMEOUT = 180.0  # seconds; `--start-timeout`
# The knobs `up` takes and hands on: generated from their declarations, forwarded when set to another value
UP_TRANSFER = ("compression", "backend", "integrity")
UP_ROUTER = ("disaggregation_threshold", "max_queue_depth", "request_timeout", "decode_wait", "routing",
             "ttft_slo")


def crd_flip_window() -> float:
    """`--flip-window`'s default: the CRD's `spec.autoscaling.flipWindowSeconds` (one default per knob)."""
    from pdcluster.operator.models import Autoscaling

    return float(Autoscaling.model_fields["flipWindowSeconds"].default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default=None, metavar="DIR", help="Hugging Face model folder (default: a built-in demo model)")
    a("--engine", choices=["pdcluster", "vllm"], default="pdcluster",
      help="what the workers run: pdcluster, or vllm (vLLM's OpenAI server with the NixlConnector, from the "
           "environment `scripts/setup.sh vllm` builds; docs/vllm.md)")
    a("--max-model-len", type=types.positive_int, default=None, metavar="N",
      help="with --engine vllm: the longest sequence (vLLM sizes its KV profiling by it)")
    a("--prefill", type=types.non_negative_int, default=1, metavar="N",
      help="prefill workers (0: decode workers prefill everything)")
    a("--decode", type=types.positive_int, default=1, metavar="M", help="decode workers (>= 1)")
    a("--prefill-tp", type=types.positive_int, default=1, metavar="N",
      help="tensor-parallel ranks per prefill worker (serve --tensor-parallel-size; one process each)")
    a("--decode-tp", type=types.positive_int, default=1, metavar="N",
      help="tensor-parallel ranks per decode worker; may differ from --prefill-tp")
    a("--port", type=types.port, default=8080, help="router port; workers take the ports after it")
    a("--host", default="127.0.0.1")
    a("--threads", type=types.positive_int, default=1, help="torch threads per worker")
    declared.add_arguments(parser, [engine_options.BY_NAME["block_size"]])  # serve's own flag, passed on
    # the same declarations (and so the same defaults) as `pdcluster serve` and `pdcluster router`
    kv_options.add_arguments(parser.add_argument_group("KV transfer (passed to every worker)"), UP_TRANSFER)
    router_options.add_arguments(parser.add_argument_group("router (passed to the router)"), UP_ROUTER)
    a("--autoscale", action="store_true",
      help="resize the pools from live metrics with the operator's autoscaler (up to --max-workers each)")
    a("--max-workers", type=types.positive_int, default=3, help="per pool, with --autoscale")
    a("--prefill-capacity", type=types.positive_float, default=None, metavar="TOK/S",
      help="with --autoscale: prompt tokens/s one prefill worker sustains (`pdcluster profile`); default: learned")
    a("--decode-capacity", type=types.positive_float, default=None, metavar="TOK/S",
      help="with --autoscale: output tokens/s one decode worker sustains; default: learned")
    a("--decode-join-seconds", type=types.non_negative_float, default=None, metavar="S",
      help="with --autoscale and --decode-capacity: decode seconds of admitting one transferred request (t_join "
           "from `pdcluster profile --stream-rate`), as `pdcluster plan` takes it; default: the live series")
    a("--autoscale-interval", type=types.positive_float, default=15.0, metavar="S", help="seconds between decisions")
    a("--scale-down-stabilization", type=types.non_negative_float, default=300.0, metavar="S",
      help="with --autoscale: a pool shrinks only after it was oversized this long (default: %(default)s s, "
           "the CRD's)")
    a("--role-flips", action=argparse.BooleanOptionalAction, default=True,
      help="with --autoscale: grow a pool by moving a running worker of the other pool (a role flip, no restart) "
           "where both pools run the same tensor-parallel size, before starting one (the CRD's spec.roleFlips; "
           "default: %(default)s)")
    a("--flip-window", type=types.non_negative_float, default=crd_flip_window(), metavar="SECONDS",
      help="with --autoscale and role flips: every quarter of this many seconds (5 at least) between decisions, "
           "flip workers toward the split the last SECONDS of traffic ask for (flips only; the CRD's "
           "spec.autoscaling.flipWindowSeconds, default: %(default)s; 0 = off)")
    a("--tool-call-parser", choices=list(PARSERS), default=None,
      help='passed to the router and every worker: parse tool calls out of the text for tool_choice "auto" '
           '(hermes: <tool_call>{json}</tool_call> blocks); default none, "auto" is refused')
    a("--start-timeout", type=types.positive_float, default=START_TIMEOUT, metavar="S",
      help="how long the router and the started workers may take to become healthy before `up` gives up "
           "(a CPU-limited worker on a busy machine can take minutes to import and load) (default: %(default)s)")
    a("--demo", action="store_true", help="start, run a short mixed workload, print the figures, stop")
    a("--cache-dir", default=None, help="where the demo model lives (default: $XDG_CACHE_HOME/pdcluster)")
    tracing.add_argument(parser)  # passed on to the router and every worker (each exports its own spans)


def cache_dir(arg: str | None) -> Path:
    base = arg or os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdcluster" if not arg else Path(arg)


def ensure_demo_model(cache: Path) -> Path:
    folder = cache / "demo-model"
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    print(f"building the demo model in {folder} (once) ...", flush=True)
    from pdcluster.worker.local.demo_model import build_demo_model

    # Built in a scratch folder and renamed: a half-written model is never mistaken for a finished one.
    tmp = Path(tempfile.mkdtemp(prefix="demo-model.", dir=cache if cache.exists() else None))
    cache.mkdir(parents=True, exist_ok=True)
    build_demo_model(tmp, num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=8,
                     num_key_value_heads=4, max_position_embeddings=2048)
    tmp.rename(folder)
    return folder


def worker_cmd(args: argparse.Namespace, model: Path, role: str, port: int) -> list[str]:
    return [sys.executable, "-m", "pdcluster", "serve", "--model", str(model), "--role", role, "--port", str(port),
            "--host", args.host, "--threads", str(args.threads), "--block-size", str(args.block_size),
            "--log-level", "warning", *declared.changed_argv(args, kv_options.rows(UP_TRANSFER)),
            *_otlp(args), *_tool_calls(args), *_tp(args, role)]


def _tp(args: argparse.Namespace, role: str) -> list[str]:
    tp = int(getattr(args, f"{role}_tp", 1) or 1)
    return ["--tensor-parallel-size", str(tp)] if tp > 1 else []  # TP 1: the command line of before


def _tool_calls(args: argparse.Namespace) -> list[str]:
    parser = getattr(args, "tool_call_parser", None)
    return ["--tool-call-parser", parser] if parser else []


def _otlp(args: argparse.Namespace) -> list[str]:
    endpoint = getattr(args, "otlp_endpoint", None)
    return ["--otlp-endpoint", endpoint] if endpoint else []


def router_cmd(args: argparse.Namespace, prefill: list[str], decode: list[str]) -> list[str]:
    # the knobs the user set; `up` probes its loopback workers every 0.5 s (a router's default is 1 s)
    cmd = [sys.executable, "-m", "pdcluster", "router", "--host", args.host, "--port", str(args.port),
           *declared.changed_argv(args, router_options.rows(UP_ROUTER)), "--health-interval", "0.5",
           "--log-level", "warning", *_otlp(args), *_tool_calls(args)]
    if getattr(args, "engine", "pdcluster") == "vllm":
        cmd += ["--engine", "vllm"]
    if prefill:
        cmd += ["--prefill", *prefill]
    return cmd + ["--decode", *decode]


def wait_ready(urls: list[str], timeout: float, sup: Supervisor) -> list[str]:
    """Waits until every URL answers /health; returns those that did not within `timeout` (empty: ready)."""
    deadline = time.monotonic() + timeout
    pending = set(urls)
    while pending and time.monotonic() < deadline:
        for u in list(pending):
            try:
                if httpx.get(f"{u}/health", timeout=1.0).status_code == 200:
                    pending.discard(u)
            except httpx.HTTPError:
                pass
        for e in sup.poll():
            print(f"  {e}", flush=True)
        time.sleep(0.2)
    return sorted(pending)


def not_ready_message(timeout: float, pending: list[str]) -> str:
    """What `up` says when its start deadline passes: the deadline, the flag that sets it, who was late."""
    return (f"pdcluster up: error: the cluster did not become ready within {timeout:g} s (--start-timeout); "
            f"not healthy yet: {', '.join(pending) or 'none'}; see the logs above")


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_args(args: argparse.Namespace) -> str | None:
    """What argparse cannot check flag by flag: the flags together (before anything is built or started)."""
    n_p = args.max_workers if args.autoscale else args.prefill
    n_d = args.max_workers if args.autoscale else args.decode
    if args.port + n_p + n_d > 65535:
        return (f"--port {args.port} leaves no room for the {n_p + n_d} worker ports after it "
                f"(the last would be {args.port + n_p + n_d} > 65535)")
    if args.autoscale and (args.prefill > args.max_workers or args.decode > args.max_workers):
        return f"--prefill and --decode must be <= --max-workers ({args.max_workers}) with --autoscale"
    return None


def autoscale_policy(args: argparse.Namespace) -> Any:
    """The operator's autoscaler policy for `up --autoscale`: the CRD's defaults, the pools bounded by
    [--prefill 0 ? 0 : 1, --max-workers] and [1, --max-workers], capacities from the flags or learned."""
    from pdcluster.operator.autoscaler import Policy
    from pdcluster.operator.planner import Bounds

    return Policy(bounds=Bounds(min(1, args.prefill), args.max_workers, 1, args.max_workers),
                  stabilization_seconds=args.scale_down_stabilization,
                  prefill_capacity=args.prefill_capacity, decode_capacity=args.decode_capacity,
                  decode_join_seconds=getattr(args, "decode_join_seconds", None))


def role_flips_off(args: argparse.Namespace, vllm: bool) -> str | None:
    """Why `up --autoscale` grows a pool only by starting workers (None: it flips first, the default)."""
    if not getattr(args, "role_flips", True):
        return "--no-role-flips"
    if vllm:
        return "engine vllm: its workers cannot change role without a restart"
    if int(args.prefill_tp or 1) != int(args.decode_tp or 1):
        return f"--prefill-tp {args.prefill_tp} != --decode-tp {args.decode_tp}"
    return None


class _Stop(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = check_args(args)
    if problem:
        print(f"pdcluster up: error: {problem}", file=sys.stderr)
        return 2
    vllm = getattr(args, "engine", "pdcluster") == "vllm"
    if vllm:
        from pdcluster.worker.local import vllm_workers

        if (why := vllm_workers.missing_reason()) is not None:
            print(f"pdcluster up: error: --engine vllm: {why}", file=sys.stderr)
            return 2

    cache = cache_dir(args.cache_dir)
    model = Path(args.model) if args.model else ensure_demo_model(cache)
    if not (model / "config.json").is_file():
        print(f"pdcluster up: error: --model {model} is not a Hugging Face model folder", file=sys.stderr)
        return 2
    run_dir = Path(tempfile.mkdtemp(prefix="pdcluster-up-"))
    # One secret for this cluster's KV transfers and router -> worker /internal/* calls, passed by environment
    # (not visible in `ps`) to the workers and the router alike. A usable $PDCLUSTER_KV_SECRET is kept, so the
    # caller can reach the workers' /internal/* endpoints too; otherwise a fresh one per cluster.
    given = os.environ.get("PDCLUSTER_KV_SECRET", "").strip()
    env = {"PDCLUSTER_KV_SECRET": given if len(given.encode()) >= 16 else secrets.token_hex(32),
           "PYTHONUNBUFFERED": "1"}
    n_p = args.max_workers if args.autoscale else args.prefill
    n_d = args.max_workers if args.autoscale else args.decode
    base = f"http://{args.host}"
    prefill_ports = [args.port + 1 + i for i in range(n_p)]
    decode_ports = [args.port + 1 + n_p + i for i in range(n_d)]
    busy = [p for p in [args.port, *prefill_ports, *decode_ports] if port_in_use(args.host, p)]
    if busy:
        print(f"pdcluster up: error: port(s) {', '.join(map(str, busy))} on {args.host} are in use; "
              f"choose another --port (the router takes it, the workers the {n_p + n_d} after it)", file=sys.stderr)
        return 2
    sup = Supervisor(run_dir)
    def worker(role: str, port: int) -> tuple[list[str], dict[str, str]]:
        if vllm:
            return vllm_workers.worker_cmd(args, model, role, port), {**env, **vllm_workers.worker_env(args, port)}
        return worker_cmd(args, model, role, port), env

    def on_signal(signum: int, _: Any) -> None:
        raise _Stop(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i, port in enumerate(prefill_ports):
            sup.add(f"prefill-{i}", *worker("prefill", port), start=i < args.prefill)
        for i, port in enumerate(decode_ports):
            sup.add(f"decode-{i}", *worker("decode", port), start=i < args.decode)
        prefill_urls = [f"{base}:{p}" for p in prefill_ports]
        decode_urls = [f"{base}:{p}" for p in decode_ports]
        sup.add("router", router_cmd(args, prefill_urls, decode_urls), env)
        router = f"{base}:{args.port}"
        started = [u for u, p in zip(prefill_urls + decode_urls,
                                     [*(f"prefill-{i}" for i in range(n_p)), *(f"decode-{i}" for i in range(n_d))],
                                     strict=True) if sup.procs[p].enabled and sup.procs[p].popen is not None]
        print(f"pdcluster up: model {model}\n  logs in {run_dir}", flush=True)
        late = wait_ready([router, *started], timeout=args.start_timeout, sup=sup)
        if late:
            print(not_ready_message(args.start_timeout, late), file=sys.stderr)
            return 1
        for name, p in sup.procs.items():
            if p.popen is not None:
                flags = [f"{f} {p.cmd[p.cmd.index(f) + 1]}" for f in ("--role", "--port") if f in p.cmd]
                print(f"  {name:<10} pid {p.pid:<7} {'  '.join(flags)}", flush=True)
        print(f"ready: OpenAI API at {router}/v1  (cluster view: {router}/cluster, metrics: {router}/metrics)",
              flush=True)
        if args.demo:
            from pdcluster.worker.local.demo import demo

            return demo(router, n_prefill=args.prefill, n_decode=args.decode)
        scaler = None
        if args.autoscale:
            from pdcluster.worker.local.autoscale import Autoscaler

            workers = {f"{role}-{i}": (role, url) for role, urls in (("prefill", prefill_urls),
                                                                      ("decode", decode_urls))
                       for i, url in enumerate(urls)}
            # flips where a worker of one pool can serve the other as it is (same TP; vLLM's switch is not wired)
            why_not = role_flips_off(args, vllm)
            if why_not:
                print(f"  autoscale: role flips off ({why_not}): a growing pool starts workers", flush=True)
            elif args.flip_window:
                print(f"  autoscale: role flips on a {args.flip_window:g} s window between decisions "
                      f"(--flip-window)", flush=True)
            scaler = Autoscaler(router, sup, workers, autoscale_policy(args), interval=args.autoscale_interval,
                                flip_window=args.flip_window, secret=env["PDCLUSTER_KV_SECRET"].encode(),
                                flips=why_not is None)
        while True:
            for e in sup.poll():
                print(f"  {e}", flush=True)
            if scaler is not None:
                for e in scaler.tick():
                    print(f"  {e}", flush=True)
            time.sleep(0.5)
    except _Stop as e:
        print(f"\npdcluster up: {e}: shutting down", flush=True)
        return 0
    except CrashLoop as e:
        print(f"pdcluster up: error: {e}\npdcluster up: stopping (restarting would not help)", file=sys.stderr,
              flush=True)
        return 2 if e.code == USAGE_ERROR else 1
    except KeyboardInterrupt:
        return 0
    finally:
        sup.stop()
        for s, h in old.items():
            signal.signal(s, h)
        print("pdcluster up: all processes stopped", flush=True)
