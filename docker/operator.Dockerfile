# syntax=docker/dockerfile:1
# The pdcluster operator image: the `pdcluster` CLI with the base dependencies only (kopf, kubernetes,
# pydantic, ...). No torch: the worker extra is never installed, and the build fails if torch slipped in.
#   docker build -f docker/operator.Dockerfile -t pdcluster/operator:0.1.0 .
# Without Docker, e2e/images.sh builds this same file with buildah on a Debian base (see docs/e2e.md).
# Build args as in docker/worker.Dockerfile (PYTHON_IMAGE, UV_IMAGE, UV_CACHE_DIR).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9

FROM ${UV_IMAGE} AS uv

# The pinned requirements, exported from uv.lock: the dependency layer below is keyed on this file's
# content only, so an edit of pyproject.toml that changes no dependency (a new sub-package) reuses it.
FROM ${PYTHON_IMAGE} AS lock
COPY pyproject.toml uv.lock /src/
RUN --mount=type=bind,from=uv,source=/uv,target=/usr/local/bin/uv \
    cd /src && uv export --frozen --no-dev --no-emit-project --format requirements-txt -o /requirements.txt

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pdcluster-operator" \
      org.opencontainers.image.description="Kubernetes operator for prefill/decode-disaggregated LLM inference"
ARG UV_CACHE_DIR=/root/.cache/uv
ARG UV_PYTHON=python3.11 UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1 UV_SYSTEM_CERTS=1 UV_NO_PROGRESS=1
WORKDIR /src
# dependencies first (exported from uv.lock), sources after: a source change rebuilds only the last layers
COPY --from=lock /requirements.txt ./
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=type=bind,from=uv,source=/uv,target=/usr/local/bin/uv \
    uv venv /opt/pdcluster && uv pip install --python /opt/pdcluster/bin/python --no-deps -r requirements.txt
COPY pyproject.toml uv.lock ./
COPY README.md ./
COPY src ./src
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=type=bind,from=uv,source=/uv,target=/usr/local/bin/uv \
    uv pip install --python /opt/pdcluster/bin/python --no-deps . \
 && cd /tmp && /opt/pdcluster/bin/python -c "import pdcluster.operator.cli" \
 && ! /opt/pdcluster/bin/python -c "import torch" 2>/dev/null \
 && /opt/pdcluster/bin/pdcluster operator --help >/dev/null
# A passwd entry for the unprivileged user: Python's getpass.getuser() (kopf's peer identity, torch's
# cache paths) raises KeyError for a uid without one (found by the first run on a real kubelet).
RUN groupadd --gid 65532 pdcluster \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pdcluster
ENV PATH=/opt/pdcluster/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
WORKDIR /tmp
# an unprivileged user; the chart runs the pod as 65532 with a read-only root filesystem
USER 65532:65532
ENTRYPOINT ["pdcluster"]
CMD ["operator"]
