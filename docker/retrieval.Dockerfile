# The hdr retrieval server: CPU only, slim Python base, runs as a non-root user.
#
#   docker build -f docker/retrieval.Dockerfile -t hdr-retrieval .
#   docker run --rm --init -p 127.0.0.1:8000:8000 -v hdr-data:/data hdr-retrieval
#
# On first start with an empty /data the entrypoint prepares the embedded corpus
# (Wikipedia vital-article summaries) and builds its index; later starts serve it
# at once. Settings are environment variables: see docker/retrieval-entrypoint.sh
# and docs/stack.md. `--init` (compose: `init: true`) lets `docker stop` reach the server while
# it is still loading (docs/stack.md).
#
# Build arguments (defaults are the normal path of a machine with registry access):
#   BASE_IMAGE       python:3.11-slim    any Debian-like image with python3 (3.10+), pip, venv
#   TORCH_VERSION    2.13.0
#   TORCH_INDEX_URL  https://download.pytorch.org/whl/cpu   where the CPU torch wheel comes from,
#                    unless the wheelhouse holds one
#   WHEELHOUSE       docker/wheelhouse   a folder of the build context; a torch-*.whl in it is
#                    installed instead of fetching torch (for machines without that index)
#
# Written for the classic builder as well as BuildKit (no `# syntax` line, which BuildKit
# would fetch from a registry; no `COPY --chmod`): Debian's docker-compose builds with the
# classic one. The `src` and `venv` stages are word for word those of docker/trainer.Dockerfile
# (a test checks it), so the second image's build reuses the first's venv from the cache.

ARG BASE_IMAGE=python:3.11-slim

# -------------------------------------------- src (the project's sources, not an image)
FROM scratch AS src
COPY pyproject.toml README.md /src/
COPY core /src/core
COPY hdr /src/hdr
COPY models /src/models
COPY retrieval_server /src/retrieval_server
COPY agent_env /src/agent_env
COPY trainer /src/trainer
COPY evaluation /src/evaluation

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

# ------------------------------------------------------------------ retrieval (final)
# Metadata first and the venv last: on a copy-on-write-less storage driver (vfs) every
# instruction after a large layer copies it again.
FROM ${BASE_IMAGE} AS retrieval
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin hdr \
    && mkdir -p /data \
    && chown hdr:hdr /data
USER hdr
# Container defaults; every one can be overridden with `-e` or in docker-compose.yml.
# The embedded encoder ships inside a Python package, so nothing is fetched at run time.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HDR_DATA_DIR=/data \
    HDR_HOST=0.0.0.0 \
    HDR_PORT=8000 \
    HF_HUB_OFFLINE=1
VOLUME ["/data"]
WORKDIR /data
EXPOSE 8000
# Healthy once /health answers 200. The start period covers the first-start index
# build of the embedded corpus on a small CPU.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('HDR_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["retrieval-entrypoint.sh"]
COPY docker/retrieval-entrypoint.sh docker/entrypoint-signals.sh /usr/local/bin/
COPY --from=venv /opt/venv /opt/venv
