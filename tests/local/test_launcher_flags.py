"""`pdcluster up` hands its KV-transfer flags to every worker it starts."""

import argparse
from pathlib import Path

from pdcluster.worker.local import launcher


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    launcher.add_arguments(p)
    return p.parse_args(list(argv))


def test_integrity_is_passed_only_when_not_the_default() -> None:
    cmd = launcher.worker_cmd(_args(), Path("m"), "prefill", 9001)
    assert "--kv-transfer-integrity" not in cmd  # the command line of before
    cmd = launcher.worker_cmd(_args("--kv-transfer-backend", "nixl", "--kv-transfer-integrity", "fabric"),
                              Path("m"), "decode", 9002)
    assert cmd[cmd.index("--kv-transfer-integrity") + 1] == "fabric"
    assert cmd[cmd.index("--kv-transfer-backend") + 1] == "nixl"
