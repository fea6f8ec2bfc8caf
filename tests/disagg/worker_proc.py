"""A worker as a real OS process for the fault/launcher tests: `python worker_proc.py <pdcluster serve flags>`
(the serve flags, wired like serve_cli plus the disaggregation routes; see bench/disagg_worker.py)."""

from pdcluster.bench.disagg_worker import main

if __name__ == "__main__":
    raise SystemExit(main())
