# syntax=docker/dockerfile:1
# The pdcluster operator image: the `pdcluster` CLI with the base dependencies only (kopf, kubernetes,
# pydantic, ...). No torch: `pip install .` never pulls the worker extra.
#   docker build -f docker/operator.Dockerfile -t pdcluster/operator:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
COPY operator ./operator
COPY worker ./worker
COPY kernels ./kernels
RUN python -m venv /opt/pdcluster \
 && /opt/pdcluster/bin/pip install . \
 && ! /opt/pdcluster/bin/python -c "import torch" 2>/dev/null \
 && /opt/pdcluster/bin/pdcluster operator --help >/dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pdcluster-operator" \
      org.opencontainers.image.description="Kubernetes operator for prefill/decode-disaggregated LLM inference"
COPY --from=build /opt/pdcluster /opt/pdcluster
ENV PATH=/opt/pdcluster/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# an unprivileged user; the chart runs the pod as 65532 with a read-only root filesystem
USER 65532:65532
ENTRYPOINT ["pdcluster"]
CMD ["operator"]
