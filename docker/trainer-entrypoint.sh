#!/usr/bin/env bash
# Entrypoint of the hdr trainer container; it runs unchanged on a host as well.
# It does not wait for the retrieval server itself: docker compose starts the trainer
# only once `retrieval` is healthy (depends_on: condition: service_healthy).
#
# 1. HDR_MODEL=tiny (the CPU default): build hdr's tiny policy with `hdr init-model`
#    and give it the supervised warm start of the config's `sft` section with `hdr sft`,
#    once, under $HDR_RUNS_DIR/tiny-policy (on the runs volume, reused on later starts).
#    HDR_MODEL=<path or hub name>: train that model. HDR_MODEL empty: the config's
#    own model.path.
# 2. exec `hdr train --config $HDR_CONFIG retrieval.urls=[...] out_dir=... [model.path=...]`,
#    followed by this script's own arguments (more dotted overrides).
#
# Settings (environment variable: default):
#   HDR_CONFIG          configs/tiny-cpu.yaml     run config (YAML); the image sets its own copy
#   HDR_RETRIEVAL_URLS  http://127.0.0.1:8000     retrieval servers, comma separated
#                                                 (compose: http://retrieval:8000)
#   HDR_RUNS_DIR        runs                      where runs and the tiny policy go (/runs in the image)
#   HDR_RUN_NAME        train                     run directory: $HDR_RUNS_DIR/$HDR_RUN_NAME
#   HDR_MODEL           tiny                      tiny | a model path or name | empty (config's)
#   HDR_API_TOKEN       (empty: no auth)          bearer token for the retrieval servers
set -euo pipefail

HDR_CONFIG="${HDR_CONFIG:-configs/tiny-cpu.yaml}"
HDR_RETRIEVAL_URLS="${HDR_RETRIEVAL_URLS:-http://127.0.0.1:8000}"
HDR_RUNS_DIR="${HDR_RUNS_DIR:-runs}"
HDR_RUN_NAME="${HDR_RUN_NAME:-train}"
HDR_MODEL="${HDR_MODEL-tiny}"
HDR_BIN="${HDR_BIN:-hdr}"

log() { echo "trainer-entrypoint: $*" >&2; }

# "http://a:8000, http://b:8000" -> retrieval.urls=["http://a:8000","http://b:8000"]
# (a YAML flow list, as hdr's dotted overrides parse their values as YAML).
urls_override() {
    local out="" url list
    IFS=', ' read -r -a list <<<"$HDR_RETRIEVAL_URLS"
    for url in "${list[@]}"; do
        [[ -n "$url" ]] && out+="${out:+,}\"$url\""
    done
    echo "retrieval.urls=[$out]"
}

# Sets TINY_POLICY to the tiny policy's directory, building it on the first start:
# `hdr init-model`, then `hdr sft` (scripted trajectories through the retrieval server,
# read from the same config and overrides as `hdr train`).
build_tiny_policy() {
    local dir="$HDR_RUNS_DIR/tiny-policy"
    TINY_POLICY="$dir/sft"
    if [[ -f "$TINY_POLICY/config.json" ]]; then
        log "reusing the tiny policy $TINY_POLICY"
        return
    fi
    log "building the tiny policy under $dir"
    rm -rf "$dir"
    "$HDR_BIN" init-model --out "$dir/init"
    "$HDR_BIN" sft --config "$HDR_CONFIG" "$URLS" "sft.init_model=$dir/init" \
        "model.path=$TINY_POLICY" "$@"
}

if [[ -z "${HDR_RETRIEVAL_URLS//[, ]/}" ]]; then
    log "HDR_RETRIEVAL_URLS names no retrieval server"
    exit 2
fi
mkdir -p "$HDR_RUNS_DIR"
URLS="$(urls_override)"
overrides=("$URLS" "out_dir=$HDR_RUNS_DIR/$HDR_RUN_NAME")
case "$HDR_MODEL" in
    "") ;;
    tiny)
        build_tiny_policy "$@"
        overrides+=("model.path=$TINY_POLICY")
        ;;
    *) overrides+=("model.path=$HDR_MODEL") ;;
esac

log "hdr train --config $HDR_CONFIG ${overrides[*]} $*"
exec "$HDR_BIN" train --config "$HDR_CONFIG" "${overrides[@]}" "$@"
