#!/usr/bin/env bash
# Entrypoint of the hdr retrieval container. It runs unchanged on a host as well:
#
#   HDR_PORT=8001 docker/retrieval-entrypoint.sh
#
# 1. If HDR_INDEX_DIR holds no index (no manifest file), build one: the corpus is
#    HDR_CORPUS, written first by `hdr index prepare-wiki` (the embedded Wikipedia
#    vital-article summaries) when that file does not exist either.
#    Concurrent replicas on one volume take a lock, so only one of them builds.
# 2. exec `hdr serve` on the index (the server process replaces this shell, so it
#    receives the container's SIGTERM directly).
# A SIGTERM or SIGINT during step 1 stops the running command at once and exits 143; the next
# start prepares and builds again (docker/entrypoint-signals.sh).
#
# Settings (environment variable: default):
#   HDR_DATA_DIR      data                       root of the defaults below (/data in the image)
#   HDR_INDEX_DIR     $HDR_DATA_DIR/index        index directory served (built here when empty)
#   HDR_CORPUS        $HDR_DATA_DIR/wiki-vital.jsonl
#                                                corpus JSONL to index; prepared when missing
#   HDR_CORPUS_LIMIT  (empty: whole corpus)      keep only the first N articles when preparing
#   HDR_ENCODER       (empty: hdr's default)     encoder name or local path for the build
#   HDR_INDEX_TYPE    flat                       FAISS index type: flat | hnsw
#   HDR_BM25          1                          also build a BM25 index (0: dense only)
#   HDR_BUILD_INDEX   1                          0: never build; no index is one line, exit 2
#                                                (a large index made beforehand, e.g. wiki-18)
#   HDR_HOST          127.0.0.1                  bind address (0.0.0.0 in the image)
#   HDR_PORT          8000                       port
#   HDR_RETRIEVER     dense                      dense | bm25
#   HDR_API_TOKEN     (empty: no auth)           bearer token; read by `hdr serve` itself
#   HDR_CACHE_BACKEND memory                     memory | redis: one cache shared by the replicas
#   HDR_REDIS_URL     redis://redis:6379/0       the Redis of HDR_CACHE_BACKEND=redis
# Extra arguments to this script are passed on to `hdr serve`.
set -euo pipefail

HDR_DATA_DIR="${HDR_DATA_DIR:-data}"
HDR_INDEX_DIR="${HDR_INDEX_DIR:-$HDR_DATA_DIR/index}"
HDR_CORPUS="${HDR_CORPUS:-$HDR_DATA_DIR/wiki-vital.jsonl}"
HDR_CORPUS_LIMIT="${HDR_CORPUS_LIMIT:-}"
HDR_ENCODER="${HDR_ENCODER:-}"
HDR_INDEX_TYPE="${HDR_INDEX_TYPE:-flat}"
HDR_BM25="${HDR_BM25:-1}"
HDR_BUILD_INDEX="${HDR_BUILD_INDEX:-1}"
HDR_HOST="${HDR_HOST:-127.0.0.1}"
HDR_PORT="${HDR_PORT:-8000}"
HDR_RETRIEVER="${HDR_RETRIEVER:-dense}"
HDR_CACHE_BACKEND="${HDR_CACHE_BACKEND:-memory}"
HDR_REDIS_URL="${HDR_REDIS_URL:-redis://redis:6379/0}"
HDR_BIN="${HDR_BIN:-hdr}"

MANIFEST="$HDR_INDEX_DIR/manifest.json"

log() { echo "retrieval-entrypoint: $*" >&2; }

# shellcheck source=docker/entrypoint-signals.sh
source "$(dirname "${BASH_SOURCE[0]}")/entrypoint-signals.sh"

build_index() {
    if [[ ! -f "$HDR_CORPUS" ]]; then
        log "no corpus at $HDR_CORPUS: preparing the embedded wiki corpus"
        mkdir -p "$(dirname "$HDR_CORPUS")"
        local prepare=("$HDR_BIN" index prepare-wiki --out "$HDR_CORPUS.partial")
        if [[ -n "$HDR_CORPUS_LIMIT" ]]; then
            prepare+=(--limit "$HDR_CORPUS_LIMIT")
        fi
        rm -f "$HDR_CORPUS.partial" # this script's own, left by a stopped start
        run_step "${prepare[@]}"
        mv "$HDR_CORPUS.partial" "$HDR_CORPUS"
    fi
    log "no index at $HDR_INDEX_DIR: building it from $HDR_CORPUS"
    local build=("$HDR_BIN" index build --corpus "$HDR_CORPUS" --out "$HDR_INDEX_DIR"
        --index-type "$HDR_INDEX_TYPE")
    if [[ -n "$HDR_ENCODER" ]]; then
        build+=(--encoder "$HDR_ENCODER")
    fi
    if [[ "$HDR_BM25" == 0 ]]; then
        build+=(--no-bm25)
    fi
    run_step "${build[@]}"
}

if [[ ! -f "$MANIFEST" && "$HDR_BUILD_INDEX" == 0 ]]; then
    log "no index at $HDR_INDEX_DIR (no $MANIFEST) and HDR_BUILD_INDEX=0: make it first with" \
        "\`hdr index import\` (docs/stack.md, Serving a real wiki-18 index)"
    exit 2
fi
if [[ ! -f "$MANIFEST" ]]; then
    mkdir -p "$HDR_DATA_DIR" "$(dirname "$HDR_INDEX_DIR")"
    if command -v flock >/dev/null 2>&1; then
        # One builder per volume; the others wait here, then find the manifest.
        exec 9>"$HDR_INDEX_DIR.lock"
        log "taking the index build lock $HDR_INDEX_DIR.lock"
        run_step flock 9
    fi
    if [[ ! -f "$MANIFEST" ]]; then
        build_index # not on the right of `||`, where bash would ignore a failing step's status
    fi
    [[ -f "$MANIFEST" ]] || { log "index build finished without $MANIFEST"; exit 1; }
    exec 9>&- # release the lock; the server must not inherit it
fi

exit_if_stopped
cache=() # memory: hdr serve's own default, so a --config file among the arguments decides
case "$HDR_CACHE_BACKEND" in
memory) ;;
redis) cache=(cache.backend=redis "cache.redis_url=$HDR_REDIS_URL") ;;
*)
    log "HDR_CACHE_BACKEND must be memory or redis, not '$HDR_CACHE_BACKEND'"
    exit 2
    ;;
esac
log "serving $HDR_INDEX_DIR ($HDR_RETRIEVER, cache $HDR_CACHE_BACKEND) on $HDR_HOST:$HDR_PORT"
exec "$HDR_BIN" serve --index "$HDR_INDEX_DIR" --host "$HDR_HOST" --port "$HDR_PORT" \
    --retriever "$HDR_RETRIEVER" "${cache[@]}" "$@"
