# shellcheck shell=bash
# Sourced by docker/retrieval-entrypoint.sh and docker/trainer-entrypoint.sh (each image copies
# it beside its entrypoint). Lets a signal stop an entrypoint at once, whichever step it is in.
#
# An entrypoint's last command is `exec`ed, so that process receives SIGTERM itself. Its earlier
# steps go through `run_step CMD ARGS...`: the step runs in the background and the script waits
# for it, while a trap passes a SIGTERM or SIGINT on to it as SIGTERM. Without this, bash (PID 1
# in the container) would handle the signal only after a foreground step had ended, and
# `docker stop` would wait its grace period for nothing. (SIGTERM, not SIGINT: a background
# child of a non-interactive shell ignores SIGINT.) After a signal the script exits 143 instead
# of going on to its next step. The caller defines `log`.

STOP_REQUESTED=""
STEP_PID=""

on_stop_signal() {
    STOP_REQUESTED=1
    if [[ -n "$STEP_PID" ]]; then
        kill -TERM "$STEP_PID" 2>/dev/null || true
    fi
}
trap on_stop_signal TERM INT

# Ends the script (exit 143, as for SIGTERM) when a signal came; called before each step and
# before the final `exec`.
exit_if_stopped() {
    if [[ -n "$STOP_REQUESTED" ]]; then
        log "stopped by a signal"
        exit 143
    fi
}

run_step() {
    exit_if_stopped
    "$@" &
    STEP_PID=$!
    [[ -z "$STOP_REQUESTED" ]] || on_stop_signal # a signal came just before the line above
    local status
    while true; do
        status=0
        wait "$STEP_PID" || status=$?
        # `wait` also returns when a trapped signal arrives: go on waiting until the step ended.
        kill -0 "$STEP_PID" 2>/dev/null || break
    done
    STEP_PID=""
    exit_if_stopped
    return "$status"
}
