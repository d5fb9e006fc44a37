# syntax=docker/dockerfile:1
# The hdr retrieval server: CPU only, slim Python base, runs as a non-root user.
#
#   docker build -f docker/retrieval.Dockerfile -t hdr-retrieval .
#   docker run --rm -p 127.0.0.1:8000:8000 -v hdr-data:/data hdr-retrieval
#
# On first start with an empty /data the entrypoint prepares the embedded corpus
# (Wikipedia vital-article summaries) and builds its index; later starts serve it
# at once. Settings are environment variables: see docker/retrieval-entrypoint.sh
# and docs/stack.md.

ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the CPU wheel index: the project's torch range is then already
# satisfied and pip never pulls a multi-gigabyte CUDA build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY hdr ./hdr
COPY retrieval_server ./retrieval_server
COPY agent_env ./agent_env
COPY trainer ./trainer
COPY evaluation ./evaluation
RUN pip install .

COPY --chmod=755 docker/retrieval-entrypoint.sh /usr/local/bin/retrieval-entrypoint.sh

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin hdr \
    && mkdir -p /data \
    && chown hdr:hdr /data
USER hdr

# Container defaults; every one can be overridden with `-e` or in docker-compose.yml.
# The embedded encoder ships inside a Python package, so nothing is fetched at run time.
ENV HDR_DATA_DIR=/data \
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
