"""The NIXL before/after bench: cache to cache against staging, both through the real connectors, one run."""

import pytest

from pdcluster.bench import transfer_ab, transfer_pair
from pdcluster.worker.transfer.nixl_agent import availability

AVAILABLE = availability()


def test_staged_suffix_names_the_same_connector_without_registered_caches() -> None:
    conn, mod = transfer_pair.connector(transfer_pair.NIXL + transfer_pair.STAGED, 1 << 16) if AVAILABLE.ok \
        else (None, None)
    calls: list[int] = []

    class Takes:
        def register_cache(self, caches: list) -> None:
            calls.append(len(caches))

    transfer_pair.register(Takes(), transfer_pair.NIXL + transfer_pair.STAGED, [])
    transfer_pair.register(Takes(), transfer_pair.NIXL, [])
    assert calls == [0]  # only the unsuffixed module registers
    if conn is not None:
        assert type(conn).__name__ == "NixlConnector" and mod.__name__.endswith("transfer.connector")
        assert conn.integrity == "mac"
        fabric, _ = transfer_pair.connector(transfer_pair.NIXL + transfer_pair.FABRIC, 1 << 16)
        assert fabric.integrity == "fabric"


@pytest.mark.skipif(not AVAILABLE.ok, reason=AVAILABLE.reason)
def test_nixl_staged_mode_measures_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    assert transfer_ab.main(["--nixl-staged", "--sizes-mib", "1", "--reps", "1", "--cases", "fp32"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("1 MiB x 32 layers") and "fp32" in line and " x" in line, line
