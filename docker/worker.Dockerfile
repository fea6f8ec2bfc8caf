# syntax=docker/dockerfile:1
# The pdcluster worker image: `pdcluster serve|router|up` with torch. PyPI's Linux torch wheel carries the
# CUDA runtime (nvidia-* wheels) and runs on CPU as well, so this one image serves examples/pdcluster.yaml
# (GPUs; the NVIDIA container toolkit injects the driver) and examples/pdcluster-cpu.yaml (CPU).
#   docker build -f docker/worker.Dockerfile -t pdcluster/worker:0.1.0 .
# Without Docker, e2e/images.sh builds this same file with buildah on a Debian base (see docs/e2e.md).
#
# Build args:
#   PYTHON_IMAGE  a base with python3.11 on PATH (default python:3.11-slim-bookworm)
#   UV_IMAGE      where the uv binary comes from (/uv in the image), pinned to the uv that wrote uv.lock
#   UV_CACHE_DIR  the uv cache the installs read and fill: a BuildKit cache mount by default; e2e/images.sh
#                 bind-mounts the host's uv cache here, so a cold image build downloads nothing twice.
# Layers: the dependencies (torch, ~5 GB) are installed from the requirements exported from uv.lock, before any
# source is copied, so a change to the Python sources rebuilds only the small layers after them.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

# The pinned requirements, exported from uv.lock: the dependency layer below is keyed on this file's
# content only, so an edit of pyproject.toml that changes no dependency (a new sub-package) reuses it.
FROM ${PYTHON_IMAGE} AS lock
COPY pyproject.toml uv.lock /src/
RUN --mount=type=bind,from=uv,source=/uv,target=/usr/local/bin/uv \
    cd /src && uv export --frozen --no-dev --extra worker --no-emit-project --format requirements-txt -o /requirements.txt

# `deps`: the base with the locked dependencies only (torch and the CUDA wheels, ~6 GB). worker-vllm.Dockerfile
# builds FROM this stage (e2e/images.sh tags it pdcluster/worker-deps), so the two images share that layer.
FROM ${PYTHON_IMAGE} AS deps
LABEL org.opencontainers.image.title="pdcluster-worker" \
      org.opencontainers.image.description="pdcluster worker, router and local launcher (torch, CUDA and CPU)"
# Triton JIT-compiles a small C launcher at run time (GPU only), hence gcc and the libc headers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
ARG UV_CACHE_DIR=/root/.cache/uv
# build-time only (ARGs are not kept in the image): the venv at /opt/pdcluster on the base's python3.11,
# files copied out of the cache (it may be another filesystem), bytecode compiled now because the pods run
# with a read-only root filesystem; UV_SYSTEM_CERTS: trust the base's CA store (and any proxy CA in it).
ARG UV_PYTHON=python3.11 UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1 UV_SYSTEM_CERTS=1 UV_NO_PROGRESS=1
WORKDIR /src
COPY --from=lock /requirements.txt ./
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=type=bind,from=uv,source=/uv,target=/usr/local/bin/uv \
    uv venv /opt/pdcluster && uv pip install --python /opt/pdcluster/bin/python --no-deps -r requirements.txt

FROM deps AS worker
ARG UV_CACHE_DIR=/root/.cache/uv
ARG UV_PYTHON=python3.11 UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1 UV_SYSTEM_CERTS=1 UV_NO_PROGRESS=1
COPY pyproject.toml uv.lock ./
COPY README.md ./
COPY src ./src
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=type=bind,from=uv,source=/uv,target=/usr/local/bin/uv \
    uv pip install --python /opt/pdcluster/bin/python --no-deps . \
 && /opt/pdcluster/bin/pdcluster serve --help >/dev/null

# The native CPU kernels (kernels/cpu/*.cpp, AVX-512), compiled here so that pods (read-only root, no
# compiler) load them instead of running the 2-3x slower torch path. The compiler stays in this stage.
# --strict fails the build when this machine could run them but they did not build; a build host without
# AVX-512 says so and the image ships without them (pods then log why they run the torch path).
FROM worker AS kernels
# (Python.h: python:3.11-slim has it; a Debian python3.11, as e2e/images.sh's base, needs libpython3.11-dev)
RUN apt-get update \
 && pkgs="g++ ninja-build" \
 && inc="$(/opt/pdcluster/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
 && { [ -f "$inc/Python.h" ] || pkgs="$pkgs libpython3.11-dev"; } \
 && apt-get install -y --no-install-recommends $pkgs \
 && cd /tmp && PDCLUSTER_CACHE=/kernels /opt/pdcluster/bin/python -m pdcluster.kernels.cpu --strict \
 && mkdir -p /kernels/native-kernels && chmod -R a+rX /kernels

FROM worker
# only what a pod loads: each build folder's marker and module (native.py's _built)
COPY --from=kernels /kernels/native-kernels /opt/pdcluster/native-kernels
# The tiny demo model at /models/demo (random weights, fixed seed): examples/pdcluster-cpu.yaml serves
# file:///models/demo. (Built from /tmp so the working directory holds nothing importable.
# The model is built in a mkdtemp folder (0700, root): chmod, or the pods' uid 65532 cannot read it.)
RUN cd /tmp && /opt/pdcluster/bin/python -c "from pathlib import Path; import shutil; \
from pdcluster.worker.local.launcher import ensure_demo_model; \
shutil.copytree(ensure_demo_model(Path('/tmp/demo-cache')), '/models/demo')" \
 && rm -rf /tmp/demo-cache && chmod -R a+rX /models
# A passwd entry for the unprivileged user: Python's getpass.getuser() (kopf's peer identity, torch's
# cache paths) raises KeyError for a uid without one (found by the first run on a real kubelet).
RUN groupadd --gid 65532 pdcluster \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pdcluster
ENV PATH=/opt/pdcluster/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PDCLUSTER_NATIVE_PREBUILT=/opt/pdcluster/native-kernels \
    TOKENIZERS_PARALLELISM=false HOME=/tmp TRITON_CACHE_DIR=/tmp/triton \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /tmp
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["pdcluster"]
CMD ["serve", "--port", "8000"]
