"""`pdcluster operator`, `plan` and `kv-budget`: every flag shows its default in --help and a bad value is
refused at parse time with one `error: argument --flag: ...` line and exit code 2, as `pdcluster serve`
does (never a traceback, never accepted and failing later)."""

from __future__ import annotations

import argparse

import pytest

from pdcluster.cli import main
from pdcluster.operator import cli, kv_budget_cli, plan_cli

MODULES = {"operator": cli, "plan": plan_cli, "kv-budget": kv_budget_cli}
PLAN = ["--input-len", "2048", "--output-len", "512", "--prefill-capacity", "1e4", "--decode-capacity", "2000"]
KV = ["--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--dtype", "fp16", "--seq-len", "2048",
      "--batch", "16"]


def _parser(name: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"pdcluster {name}", exit_on_error=False)
    MODULES[name].add_arguments(p)
    return p


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_optional_flag_shows_its_default(name: str) -> None:
    undocumented = []
    for action in _parser(name)._actions:
        if isinstance(action, argparse._HelpAction) or action.required:
            continue
        text = action.help or ""
        if "default" not in text and "%(default)" not in text:
            undocumented.append(action.option_strings[0])
    assert not undocumented, f"pdcluster {name}: flags whose --help hides the default: {undocumented}"


def test_defaults_are_rendered_in_help() -> None:
    text = _parser("operator").format_help()
    for shown in ("(default: 8080)", "(default: 0.0.0.0)", "(default: 60.0)", "http://0.0.0.0:8081/healthz"):
        assert shown in " ".join(text.split()), shown
    assert "(default: 1.5)" in _parser("plan").format_help()


BAD = [
    ("operator", ["--metrics-port", "99999"]),
    ("operator", ["--metrics-port", "-1"]),
    ("operator", ["--metrics-address", "not-an-ip"]),
    ("operator", ["--resync-seconds", "0"]),
    ("operator", ["--resync-seconds", "nan"]),
    ("operator", ["--namespace", "Bad_NS"]),
    ("operator", ["--peering", "UPPER"]),
    ("operator", ["--peering-priority", "high"]),
    ("operator", ["--liveness", "ftp://x/healthz"]),
    ("operator", ["--liveness", "http://0.0.0.0/healthz"]),
    ("plan", [*PLAN, "--headroom", "0.5"]),
    ("plan", [*PLAN, "--min-prefill", "-1"]),
    ("plan", [*PLAN, "--max-decode", "0"]),
    ("plan", [*PLAN, "--max-total-replicas", "two"]),
    ("plan", [*PLAN, "--request-rate", "inf"]),
    ("plan", ["--input-len", "-5", *PLAN[2:]]),
    ("kv-budget", [*KV[:-2], "--batch", "0"]),
    ("kv-budget", [*KV[:-4], "--seq-len", "1.5", "--batch", "1"]),
    ("kv-budget", [*KV[:6], "--dtype", "fp7", *KV[8:]]),
]


@pytest.mark.parametrize("name,argv", BAD, ids=[f"{n}:{' '.join(a[-2:])}" for n, a in BAD])
def test_bad_flag_is_one_error_line_and_exit_2(name: str, argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main([name, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"pdcluster {name}: error: argument -"), err
    assert "Traceback" not in "\n".join(err)


def test_good_values_parse() -> None:
    a = _parser("operator").parse_args(["--metrics-port", "0", "--liveness", "", "--peering", "pdc.example",
                                        "--peering-priority", "-5", "-n", "team-a"])
    assert (a.metrics_port, a.liveness, a.peering, a.peering_priority, a.namespace) == (0, "", "pdc.example",
                                                                                       -5, ["team-a"])
    assert _parser("operator").parse_args([]).peering_priority is None  # auto
    assert _parser("kv-budget").parse_args([*KV[:6], "--dtype", "FP16", *KV[8:]]).dtype == "fp16"


def test_auto_priority_keeps_the_oldest_replica_active() -> None:
    older = cli.auto_priority(1_700_000_000_000, 999)
    newer = cli.auto_priority(1_700_000_000_001, 0)
    assert older > newer  # kopf runs the highest priority: the replica that started first
    assert cli.auto_priority(5, 1) != cli.auto_priority(5, 2)  # same millisecond: still distinct
