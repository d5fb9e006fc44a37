# syntax=docker/dockerfile:1
# The hdr trainer, in two targets:
#
#   cpu  slim Python base with the CPU torch wheel; runs configs/tiny-cpu.yaml on the
#        embedded defaults (tiny policy built in the container). The default target.
#          docker build -f docker/trainer.Dockerfile --target cpu -t hdr-trainer:cpu .
#   gpu  CUDA runtime base with the project's `gpu` extra (vLLM, which brings its own
#        CUDA torch build); runs configs/search-r1-qwen2.5-3b.yaml.
#          docker build -f docker/trainer.Dockerfile --target gpu -t hdr-trainer:gpu .
#
# Both run docker/trainer-entrypoint.sh as a non-root user, write runs to /runs and
# take their settings from environment variables (see that script and docs/stack.md).

ARG PYTHON_VERSION=3.11
ARG CUDA_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04

# The project files both targets install; nothing else of the context is used.
FROM scratch AS src
COPY pyproject.toml README.md /app/
COPY hdr /app/hdr
COPY retrieval_server /app/retrieval_server
COPY agent_env /app/agent_env
COPY trainer /app/trainer
COPY evaluation /app/evaluation
COPY configs /app/configs
COPY docker/trainer-entrypoint.sh /app/docker/trainer-entrypoint.sh

# ---------------------------------------------------------------------------- gpu
FROM ${CUDA_IMAGE} AS gpu
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Triton (under vLLM and torch.compile) compiles small C launchers at run time:
# it needs a C compiler and the Python headers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY --from=src /app /app
# vLLM pins the CUDA torch build it was compiled against; let it choose.
RUN pip install ".[gpu]"
RUN chmod 755 /app/docker/trainer-entrypoint.sh \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin hdr \
    && mkdir -p /runs \
    && chown hdr:hdr /runs
USER hdr
# Models fetched from the hub are cached on the runs volume, so a restart does not refetch.
ENV HDR_CONFIG=/app/configs/search-r1-qwen2.5-3b.yaml \
    HDR_RUNS_DIR=/runs \
    HDR_MODEL= \
    HF_HOME=/runs/.cache/huggingface
VOLUME ["/runs"]
# Relative paths a run may write land on the volume, not in the root-owned /app.
WORKDIR /runs
ENTRYPOINT ["/app/docker/trainer-entrypoint.sh"]

# ---------------------------------------------------------------------------- cpu
FROM python:${PYTHON_VERSION}-slim AS cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, from the CPU wheel index, so the project install never pulls CUDA.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /app
COPY --from=src /app /app
RUN pip install .
RUN chmod 755 /app/docker/trainer-entrypoint.sh \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin hdr \
    && mkdir -p /runs \
    && chown hdr:hdr /runs
USER hdr
# Everything the CPU run needs ships in Python packages: nothing is fetched at run time.
ENV HDR_CONFIG=/app/configs/tiny-cpu.yaml \
    HDR_RUNS_DIR=/runs \
    HDR_MODEL=tiny \
    HF_HUB_OFFLINE=1
VOLUME ["/runs"]
# Relative paths a run may write land on the volume, not in the root-owned /app.
WORKDIR /runs
ENTRYPOINT ["/app/docker/trainer-entrypoint.sh"]
