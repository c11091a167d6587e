# syntax=docker/dockerfile:1.7
# One source tree, two images:
#   docker build --target operator -t headroom-operator .   # kopf operator + pure planner, no torch
#   docker build --target engine   -t headroom-engine   .   # CUDA runtime, torch, triton, fla-core
# Both run as a non-root user and work with a read-only root filesystem: HOME and every cache point
# at /tmp, which Kubernetes mounts as an emptyDir (docker run: --read-only --tmpfs /tmp).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

# ---------------------------------------------------------------------------------------------
# wheel: build headroom's own wheel once; both images install it (no source tree in the images).
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli ./cli
COPY engine ./engine
COPY kernels ./kernels
COPY operator ./operator
COPY client ./client
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------
# operator-venv: headroom with its base dependencies only (kopf, kubernetes, pydantic, ...).
FROM ${PYTHON_IMAGE} AS operator-venv
COPY --from=wheel /wheels /wheels
RUN python -m venv /opt/headroom \
    && /opt/headroom/bin/pip install --no-cache-dir /wheels/headroom-*.whl \
    && /opt/headroom/bin/python -c "import importlib.util as u, sys; sys.exit('the operator image must not contain the compute stack' if any(u.find_spec(m) for m in ('torch', 'triton')) else 0)" \
    && /opt/headroom/bin/headroom operator --help > /dev/null

# ---------------------------------------------------------------------------------------------
# operator: small image; `headroom operator` is the entry point the Helm chart runs.
FROM ${PYTHON_IMAGE} AS operator
LABEL org.opencontainers.image.title="headroom-operator" \
      org.opencontainers.image.description="kopf operator for InferenceServer resources, with the pure memory planner"
COPY --from=operator-venv /opt/headroom /opt/headroom
RUN groupadd --system --gid 10001 headroom \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin headroom
ENV PATH=/opt/headroom/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 9443
# kopf's liveness endpoint (the chart passes --liveness=http://0.0.0.0:8080/healthz).
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["headroom"]
CMD ["operator", "--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz"]

# ---------------------------------------------------------------------------------------------
# engine-base: CUDA runtime plus a Python interpreter. Triton compiles a small C launcher at run time,
# so gcc and the Python headers stay in the image.
FROM ${CUDA_IMAGE} AS engine-base
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# ---------------------------------------------------------------------------------------------
# engine-venv: torch (CUDA build) first, then headroom with its engine and gpu extras (triton, fla-core).
FROM engine-base AS engine-venv
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
COPY --from=wheel /wheels /wheels
RUN python3 -m venv /opt/headroom \
    && /opt/headroom/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && WHEEL="$(ls /wheels/headroom-*.whl)" \
    && /opt/headroom/bin/pip install --no-cache-dir "${WHEEL}[engine,gpu]" \
    && /opt/headroom/bin/python -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__)"

# ---------------------------------------------------------------------------------------------
# engine: `headroom serve` (the operator's Deployments run this image with the planned flags).
FROM engine-base AS engine
LABEL org.opencontainers.image.title="headroom-engine" \
      org.opencontainers.image.description="headroom inference engine (CUDA, torch, triton, fla-core)"
COPY --from=engine-venv /opt/headroom /opt/headroom
RUN groupadd --system --gid 10001 headroom \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin headroom
# Every writable path is under /tmp: Triton's kernel cache, torch's inductor cache, Hugging Face downloads.
ENV PATH=/opt/headroom/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/huggingface \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
# /health is liveness (readiness, /ready, turns true only after warm-up; Kubernetes probes both).
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["headroom"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
