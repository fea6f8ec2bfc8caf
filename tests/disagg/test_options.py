"""How a worker's transfer path is configured from `pdcluster serve` flags (Disaggregation.from_options)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pdcluster.worker.engine.kv_connector import KVLayout
from pdcluster.worker.server.internal_routes import Disaggregation
from pdcluster.worker.transfer.options import TransferOptions
from pdcluster.worker.transfer.secret import SecretError

ENGINE = SimpleNamespace(kv_layout=KVLayout(num_layers=2, kv_heads=1, head_dim=4, block_size=16))


def opts(**kw: Any) -> TransferOptions:
    return TransferOptions(**{"timeout_s": 5.0, "max_retries": 1, **kw})


def test_without_a_secret_there_is_no_transfer_listener(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("PDCLUSTER_KV_SECRET", raising=False)
    for role in ("prefill", "decode", "both"):
        assert Disaggregation.from_options(ENGINE, role, opts()).connector is None
    assert "cannot send or receive KV" in caplog.text  # loud for prefill/decode
    monkeypatch.setenv("PDCLUSTER_KV_SECRET", "short")
    with pytest.raises(SecretError):  # a secret that is there but unusable is an error, not a silent fallback
        Disaggregation.from_options(ENGINE, "decode", opts())


def test_secret_from_env_or_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDCLUSTER_KV_SECRET", "e" * 32)
    d = Disaggregation.from_options(ENGINE, "decode", opts(compression="int8"))
    assert d.connector is not None and d.connector.secret == b"e" * 32 and d.connector.compression == "int8"
    assert Disaggregation.from_options(ENGINE, "both", opts()).connector is not None
    f = tmp_path / "secret"
    f.write_text("f" * 40)
    assert Disaggregation.from_options(ENGINE, "prefill", opts(secret_file=str(f))).connector.secret == b"f" * 40  # type: ignore[union-attr]
    with pytest.raises(FileNotFoundError):
        Disaggregation.from_options(ENGINE, "both", opts(secret_file=str(tmp_path / "missing")))
