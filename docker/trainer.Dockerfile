# The hdr CPU trainer: slim Python base with the CPU torch wheel; runs configs/tiny-cpu.yaml
# on the embedded defaults (the tiny policy is built in the container). Non-root user.
#
#   docker build -f docker/trainer.Dockerfile -t hdr-trainer:cpu .
#
# The GPU trainer (vLLM on a CUDA base) is docker/trainer-gpu.Dockerfile. Both run
# docker/trainer-entrypoint.sh, write runs to /runs and take their settings from environment
# variables (see that script and docs/stack.md).
#
# Build arguments: BASE_IMAGE, TORCH_VERSION, TORCH_INDEX_URL, WHEELHOUSE, as in
# docker/retrieval.Dockerfile. The `src` and `venv` stages are word for word those there (a
# test checks it), so the second image's build reuses the first's venv from the cache.

ARG BASE_IMAGE=python:3.11-slim

# -------------------------------------------- src (the project's sources, not an image)
FROM scratch AS src
COPY pyproject.toml README.md /src/
COPY core /src/core
COPY hdr /src/hdr
COPY headroom_drift /src/headroom_drift
COPY models /src/models
COPY retrieval_server /src/retrieval_server
COPY agent_env /src/agent_env
COPY trainer /src/trainer
COPY evaluation /src/evaluation
COPY experiment /src/experiment

# ------------------------------------------------------- venv (build stage, not shipped)
FROM ${BASE_IMAGE} AS venv
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WHEELHOUSE=docker/wheelhouse
COPY ${WHEELHOUSE}/ /tmp/wheelhouse/
COPY pyproject.toml README.md /tmp/deps/
# 1. torch first, the CPU build: the project's torch range is then already satisfied and pip
#    never pulls a multi-gigabyte CUDA build. From the wheelhouse when it holds the wheel (its
#    dependencies still come from the package index), else from the CPU wheel index.
# 2. The dependencies alone: pyproject.toml without the packages installs an empty `hdr`
#    with every dependency, so a change to the code rebuilds only the cheap last step.
RUN python -m venv /opt/venv \
    && set -- /tmp/wheelhouse/torch-"${TORCH_VERSION}"*.whl \
    && if [ -f "$1" ]; then \
        /opt/venv/bin/pip install "$1"; \
    else \
        /opt/venv/bin/pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
    fi \
    && /opt/venv/bin/pip install /tmp/deps \
    && rm -rf /tmp/wheelhouse /tmp/deps /root/.cache
# 3. The project itself.
COPY --from=src /src /tmp/src
RUN /opt/venv/bin/pip install --no-deps --force-reinstall /tmp/src \
    && rm -rf /tmp/src /root/.cache

# ------------------------------------------------------- app (the files of /app, not an image)
FROM scratch AS app
COPY configs /app/configs
COPY docker/trainer-entrypoint.sh docker/entrypoint-signals.sh /app/docker/

# ------------------------------------------------------------------------ cpu (final)
# Metadata first and the venv last: on a copy-on-write-less storage driver (vfs) every
# instruction after a large layer copies it again.
FROM ${BASE_IMAGE} AS cpu
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin hdr \
    && mkdir -p /runs \
    && chown hdr:hdr /runs
USER hdr
# Everything the CPU run needs ships in Python packages: nothing is fetched at run time.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HDR_CONFIG=/app/configs/tiny-cpu.yaml \
    HDR_RUNS_DIR=/runs \
    HDR_MODEL=tiny \
    HF_HUB_OFFLINE=1
VOLUME ["/runs"]
# Relative paths a run may write land on the volume, not in the root-owned /app.
WORKDIR /runs
ENTRYPOINT ["/app/docker/trainer-entrypoint.sh"]
COPY --from=app /app /app
COPY --from=venv /opt/venv /opt/venv
