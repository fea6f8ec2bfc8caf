"""Options declared once: one `Option` row per knob (name, flag, type, default, choices, bounds, help), from
which the command lines are generated and against which the typed option objects and the operator's
PDCluster spec are checked.

The tables live next to what they configure: the engine's in `engine/options.py`, the KV transfer's in
`transfer/options.py`, the router's in `router/options.py`. Each flag's default is the table's, so a process
started by hand, one started by `pdcluster up` and one rendered by the operator get the same value unless
someone sets it (tests/test_option_defaults.py holds the CRD's defaults to the tables).

Stdlib only: the operator (no torch, no HTTP stack) imports the tables for its spec defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    name: str  # the field of the typed options object (EngineConfig, TransferOptions, RouterOptions)
    flag: str  # the command-line flag
    kind: type  # int | float | str | tuple (of layer indices)
    default: Any  # None: no value (nullable), or a default derived later (EngineConfig's model/device rules)
    help: str
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    min_exclusive: bool = False  # the minimum itself is not allowed
    nullable: bool = False  # None is a valid value (= derive it, or: not set)
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # CLI text -> value, when not kind(text)
    dest: str | None = None  # argparse dest when it is not `name` (serve's --kv-transfer-port beside --port)
    aliases: tuple[str, ...] = ()  # older spellings of the flag, still accepted

    @property
    def arg(self) -> str:
        """Where argparse stores the value."""
        return self.dest or self.name

    def check(self, value: Any) -> None:
        """ValueError naming the field when ``value`` is not allowed."""
        if value is None and self.nullable:
            return
        if self.kind is tuple:
            _check_layers(self.name, value)
            return
        if self.kind is str:
            ok = isinstance(value, str)
        elif self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:  # float accepts ints too
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            raise ValueError(f"{self.name} must be {_kind_name(self.kind)}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.name} must be one of {', '.join(map(str, self.choices))}, got {value!r}")
        lo, hi = self.minimum, self.maximum
        if lo is not None and (value < lo or (self.min_exclusive and value == lo)):
            raise ValueError(f"{self.name} must be {'>' if self.min_exclusive else '>='} {lo}, got {value!r}")
        if hi is not None and value > hi:
            raise ValueError(f"{self.name} must be <= {hi}, got {value!r}")

    def argv(self, value: Any) -> list[str]:
        """The flag and its text for ``value``, as the parser reads it back (`pdcluster up` forwarding)."""
        if self.kind is tuple:
            return [self.flag, ",".join(str(i) for i in value)]
        return [self.flag, str(value)]


def _kind_name(kind: type) -> str:
    return {int: "an integer", float: "a finite number", str: "a string"}.get(kind, kind.__name__)


def _check_layers(name: str, value: Any) -> None:
    if isinstance(value, str | bytes) or not isinstance(value, tuple | list):  # "0,1" would iterate as chars
        raise ValueError(f"{name} must be a sequence of layer indices, got {value!r}")
    for i in value:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"{name}: {i!r} is not a layer index (an int >= 0)")


def by_name(table: Iterable[Option]) -> Mapping[str, Option]:
    return {o.name: o for o in table}


def default(table: Iterable[Option], name: str) -> Any:
    """The declared default of ``name`` (a typed options object's field default, a spec model's default)."""
    return by_name(table)[name].default


def validate(table: Iterable[Option], values: Mapping[str, Any]) -> None:
    """Check every declared option present in ``values`` (e.g. ``vars(EngineConfig)``)."""
    rows = by_name(table)
    for name, value in values.items():
        opt = rows.get(name)
        if opt is not None:
            opt.check(value)


def check_fields(obj: Any, table: Iterable[Option]) -> None:
    """A typed options object (a dataclass over ``table``): every field's value is checked against its row."""
    validate(table, {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})


def argparse_type(opt: Option) -> Callable[[str], Any]:
    """argparse type of one option: parse the text, then the option's own check (bounds, choices)."""

    def convert(text: str) -> Any:
        try:
            value = opt.parse(text) if opt.parse else opt.kind(text)
            opt.check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).replace(opt.name, opt.flag, 1)) from None
        return value

    convert.__name__ = opt.kind.__name__  # argparse names it in "invalid <type> value"
    return convert


def add_arguments(group: argparse._ActionsContainer, table: Iterable[Option], *, help_prefix: str = "") -> None:
    """One flag per row, its default the row's (shown in --help)."""
    for opt in table:
        shown = "" if opt.default in (None, ()) else f" (default: {opt.default})"
        group.add_argument(opt.flag, *opt.aliases, dest=opt.arg, type=argparse_type(opt), default=opt.default,
                           choices=opt.choices, metavar=opt.metavar, help=help_prefix + opt.help + shown)


def values_of(args: argparse.Namespace, table: Iterable[Option]) -> dict[str, Any]:
    """The parsed values of ``table``'s flags under the rows' names (the typed object's fields)."""
    return {opt.name: getattr(args, opt.arg) for opt in table}


def changed_argv(args: argparse.Namespace, table: Iterable[Option]) -> list[str]:
    """Flags for the values that differ from the declared defaults: what `pdcluster up` hands its children
    (an unset flag means the same default in the child, which reads the same table)."""
    out: list[str] = []
    for opt in table:
        value = getattr(args, opt.arg)
        if value != opt.default and value is not None:
            out += opt.argv(value)
    return out
