"""The `pdcluster` console script.

Each subcommand lives next to the code it drives and is imported only when chosen, so
`pdcluster plan` or `pdcluster operator` never imports torch. A subcommand module exposes
`add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pdcluster.worker.server.cli", "run one inference worker (prefill, decode or both)"),
    "router": ("pdcluster.worker.router.cli", "run the router in front of prefill and decode pools"),
    "up": ("pdcluster.worker.local.launcher", "run router + workers locally as separate processes"),
    "operator": ("pdcluster.operator.cli", "run the kopf operator against the current kubeconfig"),
    "plan": ("pdcluster.operator.plan_cli", "compute prefill/decode replicas for a workload"),
    "kv-budget": ("pdcluster.operator.kv_budget_cli", "KV-cache memory for a model and workload"),
    "bench": ("pdcluster.bench.cli", "load generator: TTFT/TPOT grid sweeps and heat maps"),
    "profile": ("pdcluster.bench.profile", "measure a worker's prefill and decode capacity"),
    "simulate": ("pdcluster.bench.sim.cli", "replay a trace through a simulated P/D cluster and the autoscaler"),
}


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdcluster",
        description="Prefill/decode-disaggregated LLM inference on Kubernetes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="subcommands:\n"
        + "\n".join(f"  {n:<10} {h}" for n, (_, h) in SUBCOMMANDS.items())
        + "\n\nRun `pdcluster <subcommand> --help` for its options.",
    )
    p.add_argument("subcommand", choices=sorted(SUBCOMMANDS), metavar="subcommand")
    p.add_argument("--version", action="version", version="pdcluster 0.1.0")
    return p


def _quiet_default(action: argparse.Action) -> bool:
    """Defaults not worth a "(default: ...)": none at all, an off switch, or an empty value."""
    d = action.default
    return (action.required or action.nargs == 0 or d is None or d is argparse.SUPPRESS
            or (isinstance(d, str | list | tuple) and not d))


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(default: X)" to every option whose help does not already say its default, so each
    subcommand's --help shows every default without each module spelling it out."""
    for action in parser._actions:
        text = action.help or ""
        if action.help is argparse.SUPPRESS or _quiet_default(action) or "default" in text.lower():
            continue
        action.help = f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def build_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one subcommand, as `pdcluster NAME` uses it (its module's flags, defaults shown)."""
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"pdcluster {name}", description=help_text)
    module.add_arguments(parser)
    show_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0].startswith("-"):
        top.parse_args(argv or ["--help"])
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        top.error(f"unknown subcommand {name!r} (choose from {', '.join(SUBCOMMANDS)})")
    try:
        parser = build_parser(name)
    except ModuleNotFoundError as e:
        print(f"pdcluster {name}: not available in this install ({e})", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
