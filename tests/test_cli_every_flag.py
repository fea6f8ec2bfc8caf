"""Every flag of every `pdcluster` subcommand (issue 14 §5): its default is shown in --help, and a numeric flag
refuses nonsense (not a number, NaN, a huge negative, a port out of range, zero threads or workers) at parse
time with one `error: argument --flag: ...` line and exit code 2, never a traceback and never accepted to fail
later. The parsers are built exactly as `pdcluster NAME` builds them (pdcluster.cli.build_parser)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from pdcluster.cli import SUBCOMMANDS, build_parser, main

# Flags for which a negative number is meaningful (a kopf peering priority orders operators either way).
NEGATIVE_OK = {("operator", "--peering-priority")}
# Counts of which 0 is nonsense: a worker process with 0 threads, a stack of 0 workers, 0 requests.
ZERO_NONSENSE = ("--threads", "--max-workers", "--decode", "--requests", "--repeats", "--concurrency", "--batch",
                 "--health-interval", "--autoscale-interval", "--speedup", "--knee-frac")


def _options(name: str) -> list[argparse.Action]:
    return [a for a in build_parser(name)._actions if a.option_strings and not isinstance(
        a, argparse._HelpAction | argparse._VersionAction)]


def _rendered(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    formatter.add_argument(action)
    return " ".join(formatter.format_help().split())


def _shown(default: Any) -> list[str]:
    forms = [str(default)]
    if isinstance(default, float):
        forms.append(f"{default:g}")
    return forms


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_option_with_a_default_shows_it(name: str) -> None:
    parser = build_parser(name)
    hidden = []
    for action in _options(name):
        d = action.default
        if action.required or action.nargs == 0 or d is None or (isinstance(d, str | list | tuple) and not d):
            continue  # nothing to show: no default, an off switch, or an empty value
        text = _rendered(parser, action)
        if "default" not in text.lower() or not any(f in text for f in _shown(d)):
            hidden.append((action.option_strings[-1], d))
    assert not hidden, f"pdcluster {name}: --help does not show these defaults: {hidden}"


def _numeric(action: argparse.Action) -> bool:
    if action.type is None or action.choices is not None or action.nargs == 0:
        return False
    try:
        value = action.type("1")  # type: ignore[misc]
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return False
    return isinstance(value, int | float) and not isinstance(value, bool)


def _refuses(name: str, flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> str | None:
    """None when `pdcluster NAME FLAG VALUE` is refused as it should be, else what went wrong."""
    try:
        main([name, flag, value, "--help"])  # --help after the bad value: nothing ever runs
    except SystemExit as e:
        err = capsys.readouterr().err.strip().splitlines()
        if e.code != 2:
            return f"exit {e.code} (shown help: the value was accepted)"
        if not err or f"error: argument {flag}" not in err[-1] or any("Traceback" in line for line in err):
            return f"not one clear line: {err[-3:]}"
        return None
    return "no exit"


NUMERIC = [(n, a.option_strings[-1]) for n in sorted(SUBCOMMANDS) for a in _options(n) if _numeric(a)]


@pytest.mark.parametrize("name,flag", NUMERIC, ids=[f"{n}:{f}" for n, f in NUMERIC])
def test_numeric_flags_refuse_nonsense_at_parse_time(name: str, flag: str, capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    bad = ["abc", "nan", "inf", "1e999"]
    if (name, flag) not in NEGATIVE_OK:
        bad.append("-1000000")
    if "port" in flag:
        bad.append("99999")
    if flag.endswith(ZERO_NONSENSE):
        bad.append("0")
    problems = {v: p for v in bad if (p := _refuses(name, flag, v, capsys)) is not None}
    assert not problems, f"pdcluster {name} {flag}: {problems}"


def test_the_issue_examples(capsys: pytest.CaptureFixture[str]) -> None:
    """`up --port 99999` printed a traceback and `up --threads 0` restarted workers forever."""
    for argv in (["up", "--port", "99999"], ["up", "--threads", "0"], ["serve", "--model", "x", "--threads", "0"],
                 ["router", "--decode", "http://127.0.0.1:1", "--max-retries", "-1"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert "error: argument " + argv[-2] in err[-1] and "Traceback" not in "\n".join(err), err


def test_help_renders_for_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        assert "(default: " in capsys.readouterr().out or name == "operator", name
