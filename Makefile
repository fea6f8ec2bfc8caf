# The README's two commands are `make demo` and `make test`; each installs what it needs first.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTEST := $(VENV)/bin/pytest
export PATH := $(HOME)/.local/bin:$(PATH)

.PHONY: setup setup-test demo test lint bench bench-kernels demo-model e2e e2e-kind clean

setup:
	@scripts/setup.sh python

setup-test:
	@scripts/setup.sh test

demo: setup
	$(VENV)/bin/pdcluster up --demo

test: setup-test
	$(PYTEST) -q -p no:cacheprovider tests

lint: setup
	$(VENV)/bin/ruff check src operator worker kernels tests e2e
	$(VENV)/bin/mypy src operator worker kernels

bench: setup
	$(PY) -m pdcluster.worker.bench.engine_vs_hf --out docs/benchmarks

bench-kernels: setup
	$(PY) kernels/bench.py

demo-model: setup
	$(PY) -m pdcluster.worker.bench.train_demo_model

e2e: setup-test
	$(PYTEST) -q -p no:cacheprovider e2e

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
