"""Engine options declared once (pdcluster.worker.engine.options): serve's flags are generated from the table,
EngineConfig.validate checks against it, the operator's spec offers the same choices and bounds, and none of
it needs torch (the operator image has none)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import typing

import pytest

from pdcluster.operator import models
from pdcluster.worker.engine import options
from pdcluster.worker.engine.engine_config import EngineConfig
from pdcluster.worker.server import cli


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(exit_on_error=False)
    cli.add_arguments(p)
    return p.parse_args(["--model", "m", *argv])


def test_every_option_is_a_serve_flag_with_the_declared_default() -> None:
    args = _parse()
    config = cli.make_config(EngineConfig, cli.engine_config_kwargs(args))
    for opt in options.ENGINE_OPTIONS:
        assert getattr(args, opt.name) == opt.default, opt.flag
        assert getattr(config, opt.name) == (opt.default if opt.default is not None else getattr(EngineConfig, opt.name))


@pytest.mark.parametrize("opt", options.ENGINE_OPTIONS, ids=lambda o: o.name)
def test_cli_and_engine_config_refuse_the_same_values(opt: options.Option) -> None:
    bad: list[tuple[str, object]] = []  # (CLI text, python value)
    if opt.choices is not None:
        bad.append(("12" if opt.kind is int else "nope", 12 if opt.kind is int else "nope"))
    if opt.minimum is not None:
        below = opt.minimum if opt.min_exclusive else opt.minimum - 1
        bad.append((str(below), below))
    if opt.maximum is not None:
        bad.append((str(opt.maximum + 1), opt.maximum + 1))
    if opt.kind is tuple:
        bad.append(("0,-1", (0, -1)))
    assert bad, f"{opt.name}: nothing to refuse?"
    for text, value in bad:
        with pytest.raises((SystemExit, argparse.ArgumentError)):
            _parse(opt.flag, text)
        with pytest.raises(ValueError, match=opt.name):
            EngineConfig(model="m", **{opt.name: value}).validate()


def test_watermark_bounds_agree_everywhere() -> None:
    """Before: the CLI allowed [0, 0.5], EngineConfig [0, 1), the spec [0, 0.5]."""
    with pytest.raises(ValueError, match="watermark"):
        EngineConfig(model="m", watermark=0.7).validate()
    assert _parse("--swap-watermark", "0.5").watermark == 0.5


def _literal(model: type, field: str) -> tuple[object, ...]:
    return typing.get_args(model.model_fields[field].annotation)


def _bounds(model: type, field: str) -> tuple[object, object]:
    meta = model.model_fields[field].metadata
    ge = next((m.ge for m in meta if hasattr(m, "ge")), None)
    le = next((m.le for m in meta if hasattr(m, "le")), None)
    return ge, le


def test_operator_spec_offers_the_engine_choices_and_bounds() -> None:
    assert _literal(models.KVCache, "blockSize") == options.BLOCK_SIZES
    assert _literal(models.KVCache, "dtype") == options.KV_CACHE_DTYPES
    assert set(_literal(models.KVCache, "preemption")) == set(options.PREEMPTION_MODES)
    assert set(_literal(models.Model, "dtype")) == set(options.DTYPES)
    assert _bounds(models.KVCache, "swapWatermark") == (0, options.WATERMARK_MAX)
    ge, le = _bounds(models.KVCache, "gpuMemoryUtilization")  # the spec may be stricter, never wider
    opt = options.BY_NAME["gpu_memory_utilization"]
    assert opt.minimum < ge and le <= opt.maximum
    assert _bounds(models.KVCache, "swapSpaceGiB")[0] == options.BY_NAME["swap_space"].minimum


def test_options_and_engine_config_import_without_torch() -> None:
    code = ("import sys; import pdcluster.worker.engine, pdcluster.worker.engine.options, "
            "pdcluster.worker.engine.engine_config, pdcluster.worker.engine.kv_connector, pdcluster.operator.models; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
