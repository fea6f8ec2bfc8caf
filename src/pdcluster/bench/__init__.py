"""pdcluster.bench: benchmarks, profiling and simulation (`pdcluster bench`, `profile`, `simulate`).

Load generation and heat maps, capacity profiling, engine-vs-HF and KV-transfer benchmarks, the Triton
kernel benchmarks and AOT compile check, KV-quantization quality, and the demo model's trainer.

Depends on the runtime packages; no runtime module imports anything from here.
"""
