"""The benchmarks behind the figures in docs/benchmarks.md, outside the wheel: plain scripts run from the
repository root as `python -m benchmarks.<name>` (the Makefile's `bench*` targets run them).

They may import `pdcluster.*`; nothing under src/ imports them (tests/test_layout.py).
"""
