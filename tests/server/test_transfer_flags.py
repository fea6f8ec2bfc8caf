"""`pdcluster serve`'s KV-transfer flags reach the options the transfer path is built from."""

import argparse
import asyncio

import pytest

from pdcluster.worker.server import cli


def _options(*argv: str) -> cli.TransferOptions:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return cli.transfer_options(p.parse_args(["--model", "m", *argv]))


def test_nixl_integrity_defaults_to_mac_and_takes_fabric() -> None:
    assert _options().nixl_integrity == "mac"
    assert _options("--kv-transfer-nixl-integrity", "fabric").nixl_integrity == "fabric"
    with pytest.raises(SystemExit):
        _options("--kv-transfer-nixl-integrity", "none")


def test_the_backend_builds_a_nixl_connector_with_that_integrity() -> None:
    from pdcluster.worker.transfer import backend
    from pdcluster.worker.transfer.nixl_agent import availability

    if not availability().ok:
        pytest.skip(availability().reason)
    conn, choice = backend.build("nixl", b"s" * 32, nixl_integrity="fabric")
    tcp, _ = backend.build("tcp", b"s" * 32, nixl_integrity="fabric")  # ignored by tcp
    try:
        assert choice.backend == "nixl" and conn.integrity == "fabric"
        assert not hasattr(tcp, "integrity")
    finally:
        asyncio.run(conn.close())
        asyncio.run(tcp.close())
