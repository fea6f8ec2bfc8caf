"""One default per knob (issue 35): the KV transfer's and the router's options are declared once
(worker/transfer/options.py, worker/router/options.py), and a process started by hand, one started by
`pdcluster up` and one rendered by the operator from a spec that leaves the knob unset get the same value.

Before, the disaggregation threshold was 256 (router) / 64 (`up`, CRD), the queue depth 256 / 64 / 256, the KV
transfer retries 3 on the command line but 2 in three constructors, and the backend `auto` vs `tcp`.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import pathlib
import typing
from typing import Any

import pytest
import yaml

from pdcluster.operator import models, naming, render
from pdcluster.worker.local import launcher
from pdcluster.worker.options import Option
from pdcluster.worker.router import cli as router_cli
from pdcluster.worker.router.options import ROUTER_OPTIONS, RouterOptions
from pdcluster.worker.server import cli as serve_cli
from pdcluster.worker.transfer.options import TRANSFER_OPTIONS, TransferOptions

ROOT = pathlib.Path(__file__).resolve().parents[1]
# spec field -> declared option
KV_TRANSFER = {"compression": "compression", "backend": "backend", "integrity": "integrity",
               "timeoutSeconds": "timeout_s", "maxRetries": "max_retries"}
ROUTER = {"maxQueueDepth": "max_queue_depth", "requestTimeoutSeconds": "request_timeout",
          "disaggregationThreshold": "disaggregation_threshold"}
CASES = [(models.KVTransfer, "kvTransfer", KV_TRANSFER, TRANSFER_OPTIONS),
         (models.Router, "router", ROUTER, ROUTER_OPTIONS)]


def _row(table: tuple[Option, ...], name: str) -> Option:
    return next(o for o in table if o.name == name)


@pytest.mark.parametrize("model,key,fields,table", CASES, ids=[c[1] for c in CASES])
def test_spec_defaults_choices_and_bounds_are_the_declarations(model: Any, key: str, fields: dict[str, str],
                                                               table: tuple[Option, ...]) -> None:
    for field, name in fields.items():
        opt, info = _row(table, name), model.model_fields[field]
        assert info.default == opt.default, f"spec.{key}.{field}: {info.default!r} != {opt.flag} {opt.default!r}"
        if opt.choices is not None:
            assert typing.get_args(info.annotation) == opt.choices, field
        # the spec may be stricter than the flag (no unbounded queue in a cluster), never wider
        meta = {type(m).__name__: m for m in info.metadata}
        low = meta["Ge"].ge if "Ge" in meta else meta["Gt"].gt if "Gt" in meta else None
        if opt.minimum is not None:
            assert low is not None and low >= opt.minimum, field
        if opt.maximum is not None:
            assert "Le" in meta and meta["Le"].le <= opt.maximum, field


def test_the_committed_crd_carries_the_declared_defaults() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "pdcluster.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for _, key, fields, table in CASES:
        for field, name in fields.items():
            assert spec[key]["properties"][field]["default"] == _row(table, name).default, f"{key}.{field}"


@pytest.mark.parametrize("cls,table", [(TransferOptions, TRANSFER_OPTIONS), (RouterOptions, ROUTER_OPTIONS)])
def test_the_typed_objects_are_the_tables(cls: Any, table: tuple[Option, ...]) -> None:
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    assert fields == {o.name: o.default for o in table}
    for opt in table:  # each value is checked against its row, whoever builds the object
        if opt.choices is not None or opt.minimum is not None:
            bad = "nope" if opt.choices is not None else (opt.minimum or 0) - 1
            with pytest.raises(ValueError, match=opt.name):
                cls(**{opt.name: bad})


def _parse(module: Any, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(exit_on_error=False)
    module.add_arguments(p)
    return p.parse_args(argv)


def _rendered_commands() -> dict[str, list[str]]:
    """The operator's pods for a spec that sets no transfer or router knob."""
    spec = models.parse_spec({"model": {"name": "m", "uri": "pvc://models/m"}})
    children = render.render_children(naming.Owner("c", "ns", "uid"), spec, {"prefill": 1, "decode": 1}, "fp")
    return {d["metadata"]["name"].rsplit("-", 1)[1]: d["spec"]["template"]["spec"]["containers"][0]["command"]
            for d in children if d["kind"] == "Deployment"}


def _after(cmd: list[str], sub: str) -> list[str]:
    return cmd[cmd.index(sub) + 1:]


def test_a_router_by_hand_by_up_and_by_the_operator_gets_the_same_options() -> None:
    by_hand = RouterOptions.from_args(_parse(router_cli, ["--decode", "http://d:1"]))
    up = launcher.router_cmd(_parse(launcher, []), ["http://127.0.0.1:8081"], ["http://127.0.0.1:8082"])
    by_up = RouterOptions.from_args(_parse(router_cli, _after(up, "router")))
    rendered = RouterOptions.from_args(_parse(router_cli, _after(_rendered_commands()["router"], "router")))
    assert by_hand == RouterOptions()
    # `up` probes its loopback workers more often; every other knob is the declared default
    assert dataclasses.replace(by_up, health_interval=by_hand.health_interval) == by_hand
    assert rendered == by_hand


def test_a_worker_by_hand_by_up_and_by_the_operator_gets_the_same_transfer_options(tmp_path: pathlib.Path) -> None:
    by_hand = TransferOptions.from_args(_parse(serve_cli, ["--model", "m"]))
    up = launcher.worker_cmd(_parse(launcher, []), tmp_path, "decode", 8082)
    by_up = TransferOptions.from_args(_parse(serve_cli, _after(up, "serve")))
    rendered = TransferOptions.from_args(_parse(serve_cli, _after(_rendered_commands()["decode"], "serve")))
    assert by_hand == by_up == TransferOptions()
    # a pod gets a fixed port (its NetworkPolicy names it) and the mounted secret; the knobs are the defaults
    assert dataclasses.replace(rendered, port=None, secret_file=None) == by_hand


KNOBS = {"timeout", "timeout_s", "max_retries", "compression", "backend", "integrity", "tp_path", "threshold",
         "disaggregation_threshold", "decode_wait", "max_queue_depth", "request_timeout"}


def _internal_constructors() -> list[Any]:
    from pdcluster.worker.router.app import RouterState
    from pdcluster.worker.router.flow import Flow
    from pdcluster.worker.server.internal_routes import Disaggregation
    from pdcluster.worker.transfer import backend
    from pdcluster.worker.transfer.connector import TCPConnector
    from pdcluster.worker.transfer.nixl_connector import NixlConnector
    from pdcluster.worker.transfer.outbox import Outbox

    return [RouterState.__init__, Flow.__init__, Disaggregation.__init__, Disaggregation.from_options,
            backend.build, TCPConnector.__init__, NixlConnector.__init__, Outbox.__init__]


@pytest.mark.parametrize("fn", _internal_constructors(), ids=lambda f: f.__qualname__)
def test_no_default_below_the_command_line(fn: Any) -> None:
    """The knobs come down as TransferOptions / RouterOptions (or as values taken from them): a constructor
    with a default of its own for one is how the 2-vs-3 retries and `tcp`-vs-`auto` drift happened."""
    defaulted = [p.name for p in inspect.signature(fn).parameters.values()
                 if p.name in KNOBS and p.default is not inspect.Parameter.empty]
    assert not defaulted, defaulted


def test_the_declared_ttft_target_reaches_the_router() -> None:
    """--ttft-slo has no spec.router field of its own: the router reuses spec.autoscaling.slo.ttftSeconds (its
    load-driven aggregation aims at the target the autoscaler guards); unset, the flag is left out (0: off)."""
    def router_opts(spec_extra: dict[str, Any]) -> RouterOptions:
        spec = models.parse_spec({"model": {"name": "m", "uri": "pvc://models/m"}, **spec_extra})
        children = render.render_children(naming.Owner("c", "ns", "uid"), spec, {"prefill": 1, "decode": 1}, "fp")
        cmd = next(d for d in children if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router"))
        return RouterOptions.from_args(_parse(router_cli, _after(cmd["spec"]["template"]["spec"]["containers"][0]
                                                                  ["command"], "router")))

    assert router_opts({}).ttft_slo == 0.0 == RouterOptions().ttft_slo
    assert router_opts({"autoscaling": {"slo": {"ttftSeconds": 2.5}}}).ttft_slo == 2.5
    up = launcher.router_cmd(_parse(launcher, ["--ttft-slo", "1.5"]), ["http://p:1"], ["http://d:2"])
    assert RouterOptions.from_args(_parse(router_cli, _after(up, "router"))).ttft_slo == 1.5


def test_role_flips_are_on_by_default_in_up_and_in_the_crd() -> None:
    """`spec.roleFlips` and `up --autoscale`'s `--role-flips` are one knob: on unless turned off, and `up`
    names why it cannot flip where the operator's RoleFlips condition would (engine, tensor-parallel sizes)."""
    crd = yaml.safe_load((ROOT / "crds" / "pdcluster.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    up = _parse(launcher, [])
    assert models.PDClusterSpec.model_fields["roleFlips"].default is True is spec["roleFlips"]["default"]
    assert up.role_flips is True and launcher.role_flips_off(up, vllm=False) is None
    assert launcher.role_flips_off(_parse(launcher, ["--no-role-flips"]), vllm=False) == "--no-role-flips"
    assert "vllm" in (launcher.role_flips_off(up, vllm=True) or "")
    assert "--decode-tp 2" in (launcher.role_flips_off(_parse(launcher, ["--decode-tp", "2"]), vllm=False) or "")


def test_the_flip_window_is_the_crds_in_up() -> None:
    """`spec.autoscaling.flipWindowSeconds` and `up --autoscale`'s `--flip-window` are one knob with one
    default (the CRD model's), 0 turning it off in both."""
    crd = yaml.safe_load((ROOT / "crds" / "pdcluster.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    info = models.Autoscaling.model_fields["flipWindowSeconds"]
    assert _parse(launcher, []).flip_window == info.default == spec["autoscaling"]["properties"][
        "flipWindowSeconds"]["default"]
    assert _parse(launcher, ["--flip-window", "0"]).flip_window == 0.0
    assert models.Autoscaling(flipWindowSeconds=0).flipWindowSeconds == 0
