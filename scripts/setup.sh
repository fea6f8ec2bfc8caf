#!/usr/bin/env bash
# Installs everything `make test` / `make demo` need. Idempotent and quick when cached:
# Python packages come from the uv cache (~/.cache/uv), system tools from apt.
set -euo pipefail
cd "$(dirname "$0")/.."

want_system=${1:-python}   # python | test (adds the system tools the suite drives, and vLLM) | vllm

if [ "$want_system" = "vllm" ]; then
  # vLLM gets its own environment outside the repo: its wheel pins a torch the project's .venv does not use.
  exec scripts/setup-vllm.sh
fi

UV=(uv)
if ! command -v uv >/dev/null 2>&1; then
  python3 -m pip install --quiet --user uv || python3 -m pip install --quiet uv
  # Wherever pip put the binary, the package runs as a module (no PATH or pyenv-shim assumptions).
  UV=(python3 -m uv)
fi

# uv.lock pins every version; --frozen refuses to silently re-resolve.
"${UV[@]}" sync --frozen --extra worker --extra dev --quiet

if [ "$want_system" = "test" ]; then
  # A real Prometheus server backs the autoscaler's metrics-source tests.
  if ! command -v prometheus >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq >/dev/null
      apt-get install -y -qq --no-install-recommends prometheus >/dev/null
      # The Debian package starts a system service on :9090; the tests run their own.
      (systemctl stop prometheus 2>/dev/null || service prometheus stop 2>/dev/null || true) >/dev/null
    else
      echo "setup: prometheus not found and apt-get unavailable; install Prometheus >= 2.x" >&2
      exit 1
    fi
  fi
  # The vLLM environment behind tests/local/test_up_vllm.py (docs/vllm.md: ~2.5 min and 6.4 GB of downloads
  # cold, ~26 s from a warm uv cache, instant when built); PDCLUSTER_SKIP_VLLM=1 leaves it out (that test is
  # then skipped, saying why).
  if [ "${PDCLUSTER_SKIP_VLLM:-0}" != "1" ]; then
    scripts/setup-vllm.sh
  fi
fi
