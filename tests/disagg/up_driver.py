"""Run `pdcluster up` (launcher.run) in a child process for test_faults.py: the launcher's supervision,
restart and shutdown with real worker processes (`pdcluster serve`, which mounts the disaggregation routes)."""

from __future__ import annotations

import argparse
import sys

from pdcluster.worker.local import launcher

if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="pdcluster up")
    launcher.add_arguments(p)
    sys.exit(launcher.run(p.parse_args(sys.argv[1:])))
