#!/usr/bin/env bash
# The `hdr` of the GPU trainer image (its HDR_BIN): `hdr train` runs as one process per GPU
# under torchrun, any other command as plain `hdr`. docker/trainer-entrypoint.sh execs it, so
# torchrun (or hdr) is the container's main process: `docker stop`'s SIGTERM reaches it, and
# torchrun passes it on to every rank, which finish their step and checkpoint it together.
#
# Settings (environment variable: default):
#   HDR_NPROC             1      processes for `hdr train`: a number, or `all` (every GPU the
#                                container sees); compose sets it to HDR_GPU_COUNT
#   HDR_SHUTDOWN_TIMEOUT  1740   seconds torchrun waits for the ranks after passing a SIGTERM
#                                on, before it SIGKILLs them (torchrun's own default is 30 s,
#                                less than a step); keep it under compose's stop_grace_period
set -euo pipefail

HDR_NPROC="${HDR_NPROC:-1}"
HDR_SHUTDOWN_TIMEOUT="${HDR_SHUTDOWN_TIMEOUT:-1740}"

if [[ "${1:-}" != train ]]; then
    exec hdr "$@"
fi
nproc="$HDR_NPROC"
if [[ "$nproc" == all ]]; then
    nproc="$(python3 -c 'import torch; print(torch.cuda.device_count())')"
fi
if ! [[ "$nproc" =~ ^[1-9][0-9]*$ ]]; then
    echo "trainer-gpu-launch: HDR_NPROC must be a number of processes or 'all'," \
        "not '$HDR_NPROC' (found $nproc GPUs)" >&2
    exit 2
fi
if ((nproc == 1)); then
    exec hdr "$@"
fi
exec torchrun --standalone --nproc-per-node "$nproc" \
    --shutdown-timeout "$HDR_SHUTDOWN_TIMEOUT" --no-python hdr "$@"
