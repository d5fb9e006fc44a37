#!/usr/bin/env bash
# Entrypoint of the hdr trainer container; it runs unchanged on a host as well.
# It does not wait for the retrieval server itself: docker compose starts the trainer
# only once `retrieval` is healthy (depends_on: condition: service_healthy).
#
# What it does depends on what the run directory $HDR_RUNS_DIR/$HDR_RUN_NAME holds, so that a
# second `docker compose up` (after Ctrl-C, or after the run ended) does the expected thing:
#   - a finished run (`final/`): says so in one line, with where the model is and how to
#     start over, and exits 0;
#   - a checkpoint (`checkpoints/step-NNNNNN/`): exec `hdr train --resume RUN_DIR`, with the
#     retrieval URLs and this script's arguments as overrides on top of the run's own config;
#   - anything else (nothing, or a run stopped before its first checkpoint, which `hdr train`
#     starts over): a fresh run:
#     1. HDR_MODEL=tiny (the CPU default): build hdr's tiny policy with `hdr init-model` and give
#        it the supervised warm start of the config's `sft` section with `hdr sft`, under
#        $HDR_RUNS_DIR/tiny-policy (on the runs volume; each part is built once and reused).
#        HDR_MODEL=<path or hub name>: train that model. HDR_MODEL empty: the config's
#        own model.path.
#     2. exec `hdr train --config $HDR_CONFIG retrieval.urls=[...] out_dir=... [model.path=...]`,
#        followed by this script's own arguments (more dotted overrides).
# A SIGTERM or SIGINT (`docker stop`, Ctrl-C) reaches whichever command runs: `hdr train` then
# stops after its current step with a checkpoint, which the next start resumes.
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

RUN_DIR="$HDR_RUNS_DIR/$HDR_RUN_NAME"

log() { echo "trainer-entrypoint: $*" >&2; }

# shellcheck source=docker/entrypoint-signals.sh
source "$(dirname "${BASH_SOURCE[0]}")/entrypoint-signals.sh"

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

# A checkpoint as `hdr train` leaves it: checkpoints/step-NNNNNN, renamed into place once whole.
has_checkpoint() {
    compgen -G "$RUN_DIR/checkpoints/step-[0-9][0-9][0-9][0-9][0-9][0-9]*" >/dev/null
}

# Sets TINY_POLICY to the tiny policy's directory, building what is missing of it: `hdr
# init-model`, then `hdr sft` (scripted trajectories through the retrieval server, read from
# the same config and overrides as `hdr train`). A part that exists is reused, never rebuilt.
build_tiny_policy() {
    local dir="$HDR_RUNS_DIR/tiny-policy"
    TINY_POLICY="$dir/sft"
    if [[ -e "$dir/init" ]]; then
        log "reusing the untrained tiny policy $dir/init"
    else
        log "building the tiny policy under $dir"
        # Built under a name of this script's own and renamed when whole, so a build stopped
        # half way is redone rather than taken for a model.
        rm -rf "$dir/init.partial"
        run_step "$HDR_BIN" init-model --out "$dir/init.partial"
        mv "$dir/init.partial" "$dir/init"
    fi
    # `hdr sft` renames its output into place when whole, so a directory there is a model.
    if [[ -e "$TINY_POLICY" ]]; then
        log "reusing the tiny policy $TINY_POLICY"
    else
        run_step "$HDR_BIN" sft --config "$HDR_CONFIG" "$URLS" "sft.init_model=$dir/init" \
            "model.path=$TINY_POLICY" "$@"
    fi
}

if [[ -z "${HDR_RETRIEVAL_URLS//[, ]/}" ]]; then
    log "HDR_RETRIEVAL_URLS names no retrieval server"
    exit 2
fi
URLS="$(urls_override)"

if [[ -e "$RUN_DIR/final" ]]; then
    log "run $RUN_DIR is complete: its final model is $RUN_DIR/final. To start over, set" \
        "HDR_RUN_NAME to a new name or remove $RUN_DIR (docker compose down -v removes the" \
        "runs volume, and the index volume with it)"
    exit 0
fi

if has_checkpoint; then
    log "hdr train --resume $RUN_DIR $URLS $*"
    exec "$HDR_BIN" train --resume "$RUN_DIR" "$URLS" "$@"
fi

mkdir -p "$HDR_RUNS_DIR"
overrides=("$URLS" "out_dir=$RUN_DIR")
case "$HDR_MODEL" in
    "") ;;
    tiny)
        build_tiny_policy "$@"
        overrides+=("model.path=$TINY_POLICY")
        ;;
    *) overrides+=("model.path=$HDR_MODEL") ;;
esac

exit_if_stopped
log "hdr train --config $HDR_CONFIG ${overrides[*]} $*"
exec "$HDR_BIN" train --config "$HDR_CONFIG" "${overrides[@]}" "$@"
