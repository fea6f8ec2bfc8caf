"""`pdcluster serve`'s KV-transfer flags reach the options the transfer path is built from."""

import argparse
import asyncio

import pytest

from pdcluster.worker.server import cli
from pdcluster.worker.transfer.options import TransferOptions


def _options(*argv: str) -> cli.TransferOptions:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return cli.transfer_options(p.parse_args(["--model", "m", *argv]))


def test_integrity_defaults_to_mac_and_takes_fabric() -> None:
    assert _options().integrity == "mac"
    assert _options("--kv-transfer-integrity", "fabric").integrity == "fabric"
    assert _options("--kv-transfer-nixl-integrity", "fabric").integrity == "fabric"  # its name before tcp had it
    with pytest.raises(SystemExit):
        _options("--kv-transfer-integrity", "none")


def test_the_backend_builds_a_tcp_connector_with_that_integrity() -> None:
    from pdcluster.worker.transfer import backend

    conn, choice = backend.build(TransferOptions(backend="tcp", integrity="fabric"), b"s" * 32)
    try:
        assert choice.backend == "tcp" and conn.integrity == "fabric" and conn.limits.trust_fabric
    finally:
        asyncio.run(conn.close())


def test_the_backend_builds_a_nixl_connector_with_that_integrity() -> None:
    from pdcluster.worker.transfer import backend
    from pdcluster.worker.transfer.nixl_agent import availability

    if not availability().ok:
        pytest.skip(availability().reason)
    conn, choice = backend.build(TransferOptions(backend="nixl", integrity="fabric"), b"s" * 32)
    try:
        assert choice.backend == "nixl" and conn.integrity == "fabric"
        assert conn.limits.trust_fabric  # its layers over the channel go untagged too
    finally:
        asyncio.run(conn.close())
