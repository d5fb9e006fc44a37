#!/usr/bin/env bash
# The `hdr` of the GPU trainer image (its HDR_BIN): `hdr train` runs as one process per GPU
# under torchrun, any other command as plain `hdr`. docker/trainer-entrypoint.sh execs it, so
# torchrun (or hdr) is the container's main process: `docker stop`'s SIGTERM reaches it, and
# torchrun passes it on to every rank, which finish their step and checkpoint it together.
#
# Settings (environment variable: default):
#   HDR_NPROC             1      processes for `hdr train`: a number, or `all` (every GPU the
#                                container sees); compose sets it to HDR_GPU_COUNT
#   HDR_GPU_DEVICES       (all)  the GPUs every command may use, as CUDA_VISIBLE_DEVICES lists
#                                them (indices or UUIDs, comma-separated); compose reserves
#                                every GPU of the host, so this is how a run is kept to some
#   HDR_SHUTDOWN_TIMEOUT  1740   seconds torchrun waits for the ranks after passing a SIGTERM
#                                on, before it SIGKILLs them (torchrun's own default is 30 s,
#                                less than a step); keep it under compose's stop_grace_period
set -euo pipefail

HDR_NPROC="${HDR_NPROC:-1}"
HDR_SHUTDOWN_TIMEOUT="${HDR_SHUTDOWN_TIMEOUT:-1740}"
HDR_GPU_DEVICES="${HDR_GPU_DEVICES:-}"

if [[ -n "$HDR_GPU_DEVICES" ]]; then
    if ! [[ "$HDR_GPU_DEVICES" =~ ^[A-Za-z0-9-]+(,[A-Za-z0-9-]+)*$ ]]; then
        echo "trainer-gpu-launch: HDR_GPU_DEVICES must be GPU indices or UUIDs separated by" \
            "commas (0,1,2,3), not '$HDR_GPU_DEVICES'" >&2
        exit 2
    fi
    export CUDA_VISIBLE_DEVICES="$HDR_GPU_DEVICES"
fi

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
if [[ -n "$HDR_GPU_DEVICES" ]]; then
    IFS=, read -ra listed <<<"$HDR_GPU_DEVICES"
    if ((nproc > ${#listed[@]})); then
        echo "trainer-gpu-launch: HDR_NPROC is $nproc but HDR_GPU_DEVICES lists" \
            "${#listed[@]} GPUs ($HDR_GPU_DEVICES): one process per GPU" >&2
        exit 2
    fi
fi
if ((nproc == 1)); then
    exec hdr "$@"
fi
exec torchrun --standalone --nproc-per-node "$nproc" \
    --shutdown-timeout "$HDR_SHUTDOWN_TIMEOUT" --no-python hdr "$@"
