# The hdr GPU trainer: the project with its `gpu` extra (vllm 0.31.0, torch 2.13.0 built for
# CUDA 13, transformers 5.17.0, trl 1.16.0, deepspeed 0.19.8: one set that goes together), on
# the same Debian-like Python base as the CPU images. The CUDA runtime libraries come with
# torch's wheels; the host brings the NVIDIA driver (one for CUDA 13) and the NVIDIA Container
# Toolkit. It runs docker/trainer-entrypoint.sh like the CPU trainer, with
# docker/trainer-gpu-launch.sh as its `hdr` (`hdr train` under torchrun, one process per GPU).
#
#   docker build -f docker/trainer-gpu.Dockerfile -t hdr-trainer:gpu .
#
# Nothing is fetched at run time (HF_HUB_OFFLINE=1): the policy is a model directory mounted at
# /models/policy (HDR_MODEL), the Search-R1 data at /runs/data/searchr1 (where the config's
# relative `data/searchr1/*.parquet` point from the work directory /runs); a missing one is
# refused by `hdr train` in one line. docs/stack.md, "The GPU profile".
#
# No GPU is needed to build it (nor to run `hdr train --help` or `hdr plan-memory` in it):
# `make test-slow` builds it from the stand-in base (tests/stack/test_gpu_image.py).
#
# Build arguments (defaults are the normal path of a machine with registry access):
#   BASE_IMAGE       python:3.11-slim    any Debian-like image with python3 (3.10-3.13), pip,
#                                        venv; docker/standin-base.sh makes one without a registry
#   TORCH_VERSION    2.13.0              the torch the `gpu` extra pins
#   TORCH_INDEX_URL  https://pypi.org/simple   where the CUDA build of torch comes from: PyPI's
#                    Linux x86-64 torch 2.13.0 wheels are the CUDA 13.0 build (or
#                    https://download.pytorch.org/whl/cu130); the build checks that the torch it
#                    installed was built for CUDA 13 and stops otherwise (a pip whose own
#                    settings resolve torch to a CPU wheel, as on hdr's test machine, would)
#   WHEELHOUSE       docker/wheelhouse   a folder of the build context whose wheels pip may use
#                    (`--find-links`); a CUDA `torch-<TORCH_VERSION>-*.whl` or `+cu*.whl` in it is
#                    installed instead of fetching torch. A wheelhouse holding the whole set
#                    (`pip download` of it) with WHEELHOUSE_ONLY=1 builds with no package index.
#   WHEELHOUSE_ONLY  (empty)             1: pip reads only the wheelhouse (`--no-index`)
#
# One stage, the venv last: on a storage driver without copy-on-write (vfs) every layer is a
# full copy of the ones below it, so everything small comes first and the 11 GB install is the
# last layer (what follows it is metadata). Written for the classic builder as well as BuildKit
# (no `# syntax` line, no `--mount`, no `COPY --chmod`).

ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS gpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG WHEELHOUSE=docker/wheelhouse
ARG WHEELHOUSE_ONLY=
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Triton (under vLLM and torch.compile) compiles small C launchers at run time, so this image
# keeps a C compiler and the Python headers on purpose: the one build tool it ships. The
# mount points of the model and the data exist so that an empty mount is refused by hdr, not
# by Docker.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && if ! python3 -c 'import os, sysconfig; os.stat(sysconfig.get_paths()["include"] + "/Python.h")' 2>/dev/null; then \
        apt-get install -y --no-install-recommends python3-dev; \
    fi \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin hdr \
    && mkdir -p /runs/data/searchr1 /models/policy \
    && chown -R hdr:hdr /runs
COPY configs /app/configs
COPY docker/trainer-entrypoint.sh docker/entrypoint-signals.sh /app/docker/
COPY docker/trainer-gpu-launch.sh /app/docker/
COPY pyproject.toml README.md /tmp/src/
COPY core /tmp/src/core
COPY hdr /tmp/src/hdr
COPY headroom_drift /tmp/src/headroom_drift
COPY models /tmp/src/models
COPY retrieval_server /tmp/src/retrieval_server
COPY agent_env /tmp/src/agent_env
COPY trainer /tmp/src/trainer
COPY evaluation /tmp/src/evaluation
COPY experiment /tmp/src/experiment
COPY ${WHEELHOUSE}/ /tmp/wheelhouse/
# 1. torch, the CUDA build, asked for by name (the wheelhouse's, else TORCH_INDEX_URL's), and
#    checked: a CPU build here would make every later step look fine and the image useless.
# 2. the project with the `gpu` extra (torch already satisfies its pin); DeepSpeed builds no
#    CUDA ops (it JIT-builds what it needs on the GPU machine).
# 3. what the image is for imports: vLLM, TRL, DeepSpeed, and hdr's GPU path.
RUN python3 -m venv /opt/venv \
    && export PIP_FIND_LINKS=/tmp/wheelhouse DS_BUILD_OPS=0 \
    && if [ -n "${WHEELHOUSE_ONLY}" ]; then export PIP_NO_INDEX=1; fi \
    && wheel="$(ls /tmp/wheelhouse/torch-"${TORCH_VERSION}"-*.whl /tmp/wheelhouse/torch-"${TORCH_VERSION}"+cu*.whl 2>/dev/null | head -n 1)" \
    && if [ -n "$wheel" ]; then \
        /opt/venv/bin/pip install "$wheel"; \
    else \
        /opt/venv/bin/pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
    fi \
    && /opt/venv/bin/python -c 'import sys, torch; cuda = torch.version.cuda or ""; print("torch", torch.__version__, "CUDA", cuda or "none"); sys.exit(0 if cuda.startswith("13") else "torch " + torch.__version__ + " is not the CUDA 13 build: set TORCH_INDEX_URL or put the CUDA wheel in the wheelhouse")' \
    && /opt/venv/bin/pip install "/tmp/src[gpu]" \
    && HF_HUB_OFFLINE=1 /opt/venv/bin/python -c 'import torch, vllm, trl, deepspeed, transformers, trainer.integrations.trl, agent_env.generation.vllm; print("vllm", vllm.__version__, "trl", trl.__version__, "deepspeed", deepspeed.__version__, "transformers", transformers.__version__); assert torch.version.cuda.startswith("13")' \
    && rm -rf /tmp/src /tmp/wheelhouse /root/.cache
USER hdr
# Offline at run time: the model and the data are mounted local paths (see the top).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    HF_HOME=/runs/.cache/huggingface \
    HDR_CONFIG=/app/configs/search-r1-qwen2.5-3b.yaml \
    HDR_RUNS_DIR=/runs \
    HDR_MODEL=/models/policy \
    HDR_BIN=/app/docker/trainer-gpu-launch.sh
VOLUME ["/runs"]
# Relative paths a run may write land on the volume, not in the root-owned /app.
WORKDIR /runs
ENTRYPOINT ["/app/docker/trainer-entrypoint.sh"]
