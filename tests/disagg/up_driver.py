"""Run `pdcluster up` (launcher.run) with worker processes started through worker_proc.py when the
installed serve CLI does not mount the disaggregation routes itself (so the launcher's supervision,
restart and shutdown are tested either way)."""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

from pdcluster.worker.local import launcher
from pdcluster.worker.server import cli as serve_cli

if __name__ == "__main__":
    if "disagg_routes" not in inspect.getsource(serve_cli):
        plain = launcher.worker_cmd

        def via_worker_proc(args, model, role, port):  # type: ignore[no-untyped-def]
            cmd = plain(args, model, role, port)
            i = cmd.index("serve")
            return [sys.executable, str(Path(__file__).with_name("worker_proc.py")), *cmd[i + 1:]]

        launcher.worker_cmd = via_worker_proc  # type: ignore[assignment]
    p = argparse.ArgumentParser()
    launcher.add_arguments(p)
    sys.exit(launcher.run(p.parse_args(sys.argv[1:])))
