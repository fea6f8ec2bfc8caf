# syntax=docker/dockerfile:1
# The pdcluster worker image, CPU variant: `pdcluster serve|router|up` with torch for CPU. Used by the kind
# e2e (make e2e-kind) and by the CPU example (examples/pdcluster-cpu.yaml).
#   docker build -f docker/worker-cpu.Dockerfile -t pdcluster/worker:0.1.0-cpu .
# TORCH_INDEX_URL: an extra pip index with CPU-only torch wheels makes the image several GiB smaller than
# PyPI's default Linux wheel (which bundles CUDA); leave empty to use PyPI alone.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
COPY operator ./operator
COPY worker ./worker
COPY kernels ./kernels
RUN python -m venv /opt/pdcluster \
 && if [ -n "$TORCH_INDEX_URL" ]; then /opt/pdcluster/bin/pip install --index-url "$TORCH_INDEX_URL" torch; fi \
 && /opt/pdcluster/bin/pip install ".[worker]" \
 && /opt/pdcluster/bin/pdcluster serve --help >/dev/null

# The tiny built-in demo model at /models/demo: examples/pdcluster-cpu.yaml serves file:///models/demo.
RUN /opt/pdcluster/bin/python -c "from pathlib import Path; import shutil; \
from pdcluster.worker.launcher import ensure_demo_model; \
shutil.copytree(ensure_demo_model(Path('/tmp/demo-cache')), '/models/demo')"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pdcluster-worker-cpu"
COPY --from=build /opt/pdcluster /opt/pdcluster
COPY --from=build /models/demo /models/demo
ENV PATH=/opt/pdcluster/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    TOKENIZERS_PARALLELISM=false HOME=/tmp
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["pdcluster"]
CMD ["serve", "--device", "cpu", "--port", "8000"]
