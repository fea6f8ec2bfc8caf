# syntax=docker/dockerfile:1
# The pdcluster worker image, CUDA variant. torch's Linux wheels from PyPI carry the CUDA runtime
# libraries (nvidia-* wheels), so the base only needs Python; the NVIDIA container toolkit injects the
# driver. Triton JIT-compiles a small C launcher at run time, hence gcc and the Python headers.
#   docker build -f docker/worker.Dockerfile -t pdcluster/worker:0.1.0 .
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
 && /opt/pdcluster/bin/pip install ".[worker]" \
 && /opt/pdcluster/bin/pdcluster serve --help >/dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pdcluster-worker"
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/pdcluster /opt/pdcluster
ENV PATH=/opt/pdcluster/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    TOKENIZERS_PARALLELISM=false HOME=/tmp TRITON_CACHE_DIR=/tmp/triton \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["pdcluster"]
CMD ["serve", "--device", "cuda", "--port", "8000"]
