# The README's two commands are `make demo` and `make test`; each installs what it needs first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTEST := $(VENV)/bin/pytest
export PATH := $(HOME)/.local/bin:$(PATH)

.PHONY: setup setup-test generate demo test test-quick lint bench bench-sim bench-sweep bench-prefix bench-ratio bench-kernels bench-quality demo-model e2e e2e-build e2e-kind cluster-up cluster-down clean

setup:
	@scripts/setup.sh python
	@$(PY) -m pdcluster.kernels.cpu   # the C++ CPU kernels, built once into the cache (torch paths without them)

setup-test:
	@scripts/setup.sh test
	@$(PY) -m pdcluster.kernels.cpu
	@e2e/build.sh helm   # the chart tests drive a real helm binary (cached in ~/.cache/pdcluster)

# Deploy artefacts with a source elsewhere (CRD from the models, the chart's copies of the alert rules,
# dashboard and operator RBAC): scripts/generate.py; the tests fail when they are stale.
generate: setup
	$(PY) scripts/generate.py

demo: setup
	$(VENV)/bin/pdcluster up --demo

# On every core (pytest-xdist): 652 s against 890 s serial for the whole suite on 2 cores (docs/e2e.md). The
# process-stack tests wait on states the workers report, with bounds made for a loaded machine.
test: setup-test
	$(PYTEST) -q -p no:cacheprovider -n auto tests

# The loop while you work: everything but the tests that start stacks of processes (marker `stack`,
# tests/conftest.py) and the `slow` ones; `make test` still runs all of them.
test-quick: setup-test
	$(PYTEST) -q -p no:cacheprovider -n auto -m "not stack and not slow" tests

lint: setup
	$(VENV)/bin/ruff check src tests e2e benchmarks scripts
	$(VENV)/bin/mypy

# The figures in docs/benchmarks.md; each benchmark is a script under benchmarks/ (outside the wheel).
# Side by side against Hugging Face and raw TCP (minutes; run on a quiet machine).
bench: setup
	$(PY) -m benchmarks.engine_vs_hf --threads 2 --repeats 3
	$(PY) -m benchmarks.served_vs_hf --threads 2 --repeats 3 --native-off-too
	$(PY) -m benchmarks.disagg_transfer
	$(PY) -m benchmarks.vs_vllm --threads 2 --rounds 3 --json docs/benchmarks/vs_vllm.json

# Trace-driven simulation of the autoscaler (seconds; real traces from ../shared/traces, docs/benchmarks.md).
TRACES ?= ../shared/traces
bench-sim: setup
	$(VENV)/bin/pdcluster simulate --trace $(TRACES)/azure2023_code.csv --out docs/benchmarks/sim/azure2023_code
	$(VENV)/bin/pdcluster simulate --trace $(TRACES)/mooncake_conversation.jsonl --slo-ttft 15 --out docs/benchmarks/sim/mooncake_conversation
	$(VENV)/bin/pdcluster simulate --trace $(TRACES)/azure2023_code.csv --cold --out docs/benchmarks/sim/azure2023_code-cold
	$(VENV)/bin/pdcluster simulate --trace $(TRACES)/mooncake_conversation.jsonl --slo-ttft 15 --cold --out docs/benchmarks/sim/mooncake_conversation-cold

# The autoscaler on 60 held-out synthetic traces (seeds 101-120 of each shape), primed and cold, aggregation off
# and on (~10 min on 2 cores; docs/benchmarks/autoscaler.md, "Sixty traces"); traces stay in the temp folder.
bench-sweep: setup
	@t=$$(mktemp -d) && for agg in off on; do \
	  $(PY) -m pdcluster.bench.sim.sweep --out $$t/$$agg --seeds 101-120 $$([ $$agg = on ] && echo --load-aggregation) && \
	  mkdir -p docs/benchmarks/sweep/$$agg && cp $$t/$$agg/summary.md $$t/$$agg/runs.jsonl docs/benchmarks/sweep/$$agg/ || exit 1; \
	done; rm -rf $$t

# Prefix-aware vs least-loaded routing, two `pdcluster up` stacks interleaved on the Mooncake trace (~17 min;
# docs/benchmarks.md).
bench-prefix: setup
	$(PY) -m benchmarks.prefix_routing --trace $(TRACES)/mooncake_conversation.jsonl --out docs/benchmarks/prefix_routing

# The P:D ratio on the real stack (about 30 min on the shared 2-core VM; docs/benchmarks.md):
# scan the load (one colocated run at 2x, 3x, 4x: the highest speed it still mostly meets the SLO at), profile
# a 1:1 `pdcluster up` (C_p, C_d, t_join; C_p and t_join under a stream at the sweep's rate), replay one Azure slice (prompts shrunk to fit, outputs at
# their real lengths up to 256) through every split of 4 workers (2 rounds), each worker under its own CPU
# limit (cgroup v1 quota, 0.4 CPU; needs root), then a rise-and-fall slice through `pdcluster up --autoscale`
# with the capacities of the (unlimited) t_join sweep.
bench-ratio: setup
	$(PY) -m benchmarks.ratio_sweep --trace $(TRACES)/azure2023_code.csv --start 1320 --duration 60 \
	  --scan-speedups 2,3,4 --max-model-len 1024 --max-output-tokens 256 --worker-cpu 0.4 --router-cpu 0.4 \
	  --out docs/benchmarks/ratio_sweep/stream
	$(PY) -m benchmarks.autoscale_replay --trace $(TRACES)/azure2023_code.csv \
	  --capacity-from docs/benchmarks/ratio_sweep/join/summary.json --out docs/benchmarks/ratio_sweep

bench-kernels: setup
	$(PY) -m benchmarks.kernels

# KV-cache quantization quality on the trained demo model (trains it first if it is not cached: minutes).
bench-quality: setup
	$(PY) -m benchmarks.kv_quality --check-engine --out docs/benchmarks/kv_quality.json

demo-model: setup
	$(PY) scripts/train_demo_model.py

# The e2e suite needs a real control plane: built from the Go module proxy on first use (slow, cached
# in ~/.cache/pdcluster keyed by version), started on loopback, torn down afterwards. As root, the cluster
# also gets one real node (kubelet + containerd, e2e/node.sh) running the images e2e/images.sh builds with
# buildah; `PDCLUSTER_REAL_NODE=0` keeps kwok nodes only. docs/e2e.md says what each step costs.
E2E_PYTEST_FLAGS ?= -q -p no:cacheprovider -o timeout=600
REAL_NODE := $(shell if [ "$${PDCLUSTER_REAL_NODE:-$$( [ $$(id -u) = 0 ] && echo 1 || echo 0)}" = 1 ]; then echo 1; else echo 0; fi)
e2e-build:
	@e2e/build.sh all

# the real node's packages (Debian), kubelet + CoreDNS (Go proxy) and the images (buildah)
e2e-node:
	@e2e/node-deps.sh
	@e2e/build.sh node
	@e2e/images.sh all

images:
	@e2e/node-deps.sh
	@e2e/images.sh all

cluster-up: e2e-build $(if $(filter 1,$(REAL_NODE)),e2e-node)
	@PDCLUSTER_REAL_NODE=$(REAL_NODE) e2e/cluster.sh up

cluster-down:
	@e2e/cluster.sh down

e2e: setup-test e2e-build $(if $(filter 1,$(REAL_NODE)),e2e-node)
	@PDCLUSTER_REAL_NODE=$(REAL_NODE) e2e/cluster.sh up >/dev/null || { e2e/cluster.sh down; exit 1; }
	@rc=0; $(PYTEST) $(E2E_PYTEST_FLAGS) e2e || rc=$$?; \
	  if [ "$(REAL_NODE)" = 1 ]; then $(PYTEST) $(E2E_PYTEST_FLAGS) e2e/realnode || rc=$$?; fi; \
	  if [ -z "$$PDCLUSTER_E2E_KEEP" ]; then e2e/cluster.sh down; fi; exit $$rc

e2e-kind:
	@e2e/kind/run.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
