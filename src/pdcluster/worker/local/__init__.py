"""pdcluster.worker.local: `pdcluster up`, the embedded default cluster on one machine.

`launcher.py` starts the router and the workers as separate OS processes on loopback, `supervisor.py`
restarts them (and stops `up` on a usage error), `demo.py` drives traffic and prints TTFT/TPOT and the P:D
decision, `autoscale.py` resizes the pools with the operator's own autoscaler core, `demo_model.py`
builds the small built-in model, `workload.py` generates the demo's requests.

Must not: be imported by the engine, server or router.
"""
