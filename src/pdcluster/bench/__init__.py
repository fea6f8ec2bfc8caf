"""pdcluster.bench: what users run to measure and plan a deployment (`pdcluster bench`, `profile`, `simulate`).

Load generation, trace replay and latency heat maps (`bench`), a worker's prefill and decode capacity
(`profile`), and the trace-driven cluster and autoscaler simulator (`simulate`, in sim/). The benchmarks behind
the figures in docs/benchmarks.md are scripts in the repository's top-level benchmarks/ folder, outside the
wheel; they may import from here, never the other way round.

Depends on the runtime packages; no runtime module imports anything from here.
"""
