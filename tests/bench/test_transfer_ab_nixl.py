"""The NIXL before/after bench: cache to cache against staging, both through the real connectors, one run."""

import asyncio

import pytest

from pdcluster.bench import transfer_ab, transfer_pair
from pdcluster.worker.transfer.nixl_agent import availability

AVAILABLE = availability()


def test_module_suffixes_choose_registration_and_integrity() -> None:
    calls: list[int] = []

    class Takes:
        def register_cache(self, caches: list) -> None:
            calls.append(len(caches))

    transfer_pair.register(Takes(), transfer_pair.NIXL + transfer_pair.STAGED, [])
    transfer_pair.register(Takes(), transfer_pair.NIXL + transfer_pair.FABRIC, [])
    assert calls == [0]  # only a module without +staged registers its caches
    if not AVAILABLE.ok:
        return
    made = [transfer_pair.connector(transfer_pair.NIXL + suffix, 1 << 16) for suffix in ("", transfer_pair.FABRIC)]
    try:
        (mac, mod), (fabric, _) = made
        assert type(mac).__name__ == "NixlConnector" and mod.__name__.endswith("transfer.connector")
        assert (mac.integrity, fabric.integrity) == ("mac", "fabric")
    finally:
        for conn, _ in made:
            asyncio.run(conn.close())


@pytest.mark.skipif(not AVAILABLE.ok, reason=AVAILABLE.reason)
def test_nixl_staged_mode_measures_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    assert transfer_ab.main(["--nixl-staged", "--sizes-mib", "1", "--reps", "1", "--cases", "fp32"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("1 MiB x 32 layers") and "fp32" in line and " x" in line, line
