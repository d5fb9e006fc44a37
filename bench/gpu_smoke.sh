#!/usr/bin/env bash
# GPU smoke test of hdr's GPU path: one line PASS, FAIL or SKIP per check, then a summary.
# No network (everything offline: the tiny Qwen2 bed is built here, the corpus is the embedded
# one), at most 8 minutes on one GPU (each check gets what is left of that budget).
#
#   bench/gpu_smoke.sh [WORK_DIR]         (default: a new temporary directory, kept)
#
# Checks, each skipped cleanly when what it needs is missing:
#   engine    the tests marked `vllm` (the ones `make test` runs on the CPU build, one
#             contract): tests/agent_env/test_vllm_engine.py, test_vllm_rollout.py and
#             tests/trainer/test_vllm_engine_loop.py, here on CUDA (fp32 engine and trainer):
#             finish reasons, seeds, the context limit, log-probs against teacher forcing,
#             the weight sync and its check, multi-turn rollouts against hf's, `hdr train`
#             with replay (the torchrun test is `slow` there and 2-GPU here: see torchrun)
#                                                                     (needs CUDA and vLLM)
#   sync      the weight sync round trip on the random bed: vLLM's log-probs (bf16) match
#             torch's teacher forcing (fp32) before, and after the engine slept, torch's weights
#             were perturbed and synced; and no longer match the old weights (CUDA and vLLM)
#   train     3 GRPO + Headroom-Drift steps of configs/search-r1-qwen2.5-3b.yaml shrunk to the
#             bed, bf16 autocast, vLLM generation with sleep mode, against `hdr serve` on a
#             300-passage index of the embedded corpus                (CUDA and vLLM)
#   faiss     `hdr serve` with the dense index on GPU 0 (dense.gpus=[0]) answers what the
#             CPU index answers                                       (faiss with GPU support)
#   torchrun  2 steps of the same under torchrun with 2 processes, one GPU each
#                                                                     (2 GPUs, CUDA and vLLM)
# Exit status: 0 when no check failed (skips included), 1 otherwise.
# shellcheck disable=SC2329  # functions called by the EXIT trap or by `run` through bash -c
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
BUDGET_S="${HDR_SMOKE_BUDGET_S:-480}"
WORK="${1:-$(mktemp -d -t hdr-gpu-smoke.XXXXXX)}"
mkdir -p "$WORK"
cd "$ROOT" || exit 1

# offline: no hub, no usage reports
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false
STARTED=$SECONDS
declare -a SUMMARY=()
FAILED=0
SERVER_PID=""

left() { echo $((BUDGET_S - (SECONDS - STARTED))); }

cleanup() {
    if [[ -n "$SERVER_PID" ]]; then
        kill "$SERVER_PID" 2>/dev/null
        wait "$SERVER_PID" 2>/dev/null
    fi
}
trap cleanup EXIT

# record NAME STATUS MESSAGE: print and remember one result line
record() {
    local line
    line="$(printf '%-9s %-4s %s' "$1" "$2" "$3")"
    echo "$line"
    SUMMARY+=("$line")
    [[ "$2" == FAIL ]] && FAILED=1
    return 0
}

# run NAME COMMAND...: the command's own PASS/FAIL/SKIP line (exit 0/1/77), its log kept in
# $WORK/NAME.log, within what is left of the budget. COMMAND may be a function of this script
# (exported below): it runs in `bash -c` under `timeout`, which signals its whole process group.
run() {
    local name="$1" budget status
    shift
    budget="$(left)"
    if ((budget < 20)); then
        record "$name" FAIL "no time left of the ${BUDGET_S} s budget"
        return
    fi
    local begin=$SECONDS
    timeout --signal=TERM --kill-after=20 "$budget" bash -c '"$@"' _ "$@" >"$WORK/$name.log" 2>&1
    status=$?
    local took=$((SECONDS - begin)) last
    last="$(grep -E '^(PASS|FAIL|SKIP): ' "$WORK/$name.log" | tail -n 1)"
    case "$status" in
        0) record "$name" PASS "${last#PASS: } (${took} s)" ;;
        77) record "$name" SKIP "${last#SKIP: }" ;;
        124 | 137) record "$name" FAIL "timed out after ${took} s (log: $WORK/$name.log)" ;;
        *) record "$name" FAIL "${last#FAIL: } exit $status (${took} s; log: $WORK/$name.log)" ;;
    esac
}

has_python_module() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }
cuda_devices() { "$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0; }

GPUS="$(cuda_devices)"
HAS_VLLM=0
has_python_module vllm && HAS_VLLM=1
echo "hdr GPU smoke: $GPUS CUDA device(s), vLLM $([[ $HAS_VLLM == 1 ]] && "$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null || echo 'not installed'); work dir $WORK"

BED="$WORK/qwen-bed"
# The bed of the sync and train checks (the engine check's tests build their own); built
# once (a minute on a CPU at most).
build_beds() {
    [[ -e "$BED" ]] || "$PY" -m hdr.cli init-model --arch qwen2 --out "$BED" \
        hidden_size=64 num_layers=2 num_heads=2 num_kv_heads=1 intermediate_size=128 init_std=0.3 \
        >"$WORK/bed.log" 2>&1 || return 1
}

skip_unless_vllm() {
    if ((GPUS < 1)); then record "$1" SKIP "no CUDA GPU"; return 1; fi
    if ((HAS_VLLM == 0)); then record "$1" SKIP "vLLM is not installed (pip install -e '.[gpu]')"; return 1; fi
    return 0
}

# --- engine, sync -----------------------------------------------------------------------
BEDS_OK=0
if ((GPUS >= 1 && HAS_VLLM == 1)); then
    if build_beds; then BEDS_OK=1; else record beds FAIL "building the Qwen2 bed failed (log: $WORK/bed.log)"; fi
fi
# the same tests as on the CPU; their own output, then one line for this summary
vllm_tests() {
    "$PY" -m pytest -q -p no:cacheprovider -m "vllm and not slow" \
        tests/agent_env/test_vllm_engine.py tests/agent_env/test_vllm_rollout.py \
        tests/trainer/test_vllm_engine_loop.py
    local status=$?
    if ((status == 0)); then echo "PASS: the tests marked vllm, on CUDA"; else echo "FAIL: pytest exit $status"; fi
    return "$status"
}
export -f vllm_tests
if skip_unless_vllm engine && ((BEDS_OK)); then run engine vllm_tests; fi
if skip_unless_vllm sync && ((BEDS_OK)); then run sync "$PY" bench/gpu_smoke.py sync "$BED"; fi

# --- a retrieval server on a small embedded index ------------------------------------------
start_server() {
    local port="$1" index="$2"
    shift 2
    "$PY" -m hdr.cli serve --index "$index" --host 127.0.0.1 --port "$port" "$@" \
        >"$WORK/serve-$port.log" 2>&1 &
    local pid=$!
    for _ in $(seq 1 120); do
        if "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; then
            echo "$pid"
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || return 1
        sleep 1
    done
    kill "$pid" 2>/dev/null
    return 1
}

INDEX="$WORK/index"
PORT="${HDR_SMOKE_PORT:-8731}"
URL="http://127.0.0.1:$PORT"
need_server() {
    [[ -n "$SERVER_PID" ]] && return 0
    if [[ ! -e "$INDEX/manifest.json" ]]; then
        "$PY" -m hdr.cli index prepare-wiki --out "$WORK/wiki.jsonl" --limit 300 >"$WORK/index.log" 2>&1 &&
            "$PY" -m hdr.cli index build --corpus "$WORK/wiki.jsonl" --out "$INDEX" >>"$WORK/index.log" 2>&1 ||
            return 1
    fi
    SERVER_PID="$(start_server "$PORT" "$INDEX")" || { SERVER_PID=""; return 1; }
}

# configs/search-r1-qwen2.5-3b.yaml on the bed: its precision, sleep mode and limits shrunk
train_args() {
    echo train --config configs/search-r1-qwen2.5-3b.yaml "model.path=$BED" "out_dir=$1" \
        "retrieval.urls=[$URL]" retrieval.expect_encoder=null retrieval.expect_documents=null \
        data.train=wiki-vital data.eval=wiki-vital "steps=$2" grpo.batch_prompts=4 \
        grpo.group_size=4 grpo.warmup_steps=1 grpo.micro_batch=4 grpo.score_chunk=8 \
        replay.budget=2 replay.capacity=8 replay.tau=1.0 rollout.max_turns=1 \
        rollout.max_tokens_per_turn=32 rollout.max_obs_tokens=128 rollout.max_response_tokens=128 \
        generation.max_model_len=1024 generation.gpu_memory_utilization=0.25 \
        generation.max_num_seqs=64 eval.every=0 eval.at_start=false checkpoint.save_every=0 \
        log.progress=false log.tensorboard=false "distributed.rollout_shards=$3"
}

# train_check OUT STEPS WORLD: exit 0 with a PASS line when metrics.jsonl has STEPS records
# of world size WORLD, the final model was written, and the mean sampler/trainer log-prob gap
# of every step is under 0.1 (bf16 on both sides)
train_check() {
    local out="$1" steps="$2" world="$3"
    "$PY" - "$out" "$steps" "$world" <<'EOF'
import json, math, sys
from pathlib import Path
out, steps, world = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
ok = [r["step"] for r in rows] == list(range(1, steps + 1)) and (out / "final").is_dir()
ok = ok and all(r["world_size"] == world and math.isfinite(r["loss"]) for r in rows)
gap = [round(r["logprob_gap_mean"], 4) for r in rows]  # vLLM bf16 against trainer bf16
ok = ok and max(gap) < 0.1
print(("PASS" if ok else "FAIL") + f": {len(rows)} steps, world {world}, sampler/trainer gap {gap}")
sys.exit(0 if ok else 1)
EOF
}

train_once() {
    local out="$WORK/run-train"
    rm -rf "$out"
    # shellcheck disable=SC2046  # train_args prints one word per argument
    "$PY" -m hdr.cli $(train_args "$out" 3 1) model.device=cuda:0 generation.device=cuda:0 &&
        train_check "$out" 3 1
}

train_two() {
    local out="$WORK/run-torchrun"
    rm -rf "$out"
    # shellcheck disable=SC2046
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m hdr.cli \
        $(train_args "$out" 2 2) model.device=cuda:0 generation.device=cuda:0 &&
        train_check "$out" 2 2
}

export PY WORK BED URL PORT INDEX
export -f start_server train_args train_check train_once train_two

# --- train ---------------------------------------------------------------------------------
if skip_unless_vllm train && ((BEDS_OK)); then
    if need_server; then
        run train train_once
    else
        record train FAIL "the retrieval server did not start (logs: $WORK/index.log, $WORK/serve-$PORT.log)"
    fi
fi

# --- faiss on the GPU ------------------------------------------------------------------------
faiss_check() {
    local gpu_pid
    gpu_pid="$(start_server $((PORT + 1)) "$INDEX" 'dense.gpus=[0]')" || { echo "FAIL: hdr serve with dense.gpus=[0] did not start"; return 1; }
    "$PY" - "$URL" "http://127.0.0.1:$((PORT + 1))" <<'EOF'
import json, sys, urllib.request
def ask(base):
    body = json.dumps({"queries": ["capital of France", "largest planet"], "topk": 3,
                       "return_scores": True, "retriever": "dense"}).encode()
    req = urllib.request.Request(base + "/retrieve", body, {"Content-Type": "application/json"})
    result = json.load(urllib.request.urlopen(req, timeout=30))["result"]
    return [[hit["document"]["id"] for hit in hits] for hits in result]
cpu, gpu = ask(sys.argv[1]), ask(sys.argv[2])
print(("PASS" if cpu == gpu else "FAIL") + f": GPU top-3 {gpu}, CPU top-3 {cpu}")
sys.exit(0 if cpu == gpu else 1)
EOF
    local status=$?
    kill "$gpu_pid" 2>/dev/null
    wait "$gpu_pid" 2>/dev/null
    return "$status"
}

export -f faiss_check
if ((GPUS < 1)); then
    record faiss SKIP "no CUDA GPU"
elif ! "$PY" -c 'import faiss, sys; sys.exit(not (hasattr(faiss, "GpuMultipleClonerOptions") and faiss.get_num_gpus() > 0))' 2>/dev/null; then
    record faiss SKIP "faiss has no GPU support here (pip install faiss-gpu-cu12 in place of faiss-cpu)"
elif need_server; then
    run faiss faiss_check
else
    record faiss FAIL "the retrieval server did not start (logs: $WORK/index.log, $WORK/serve-$PORT.log)"
fi

# --- torchrun with 2 ranks ---------------------------------------------------------------------
if ((GPUS < 2)); then
    record torchrun SKIP "fewer than 2 GPUs visible ($GPUS)"
elif skip_unless_vllm torchrun && ((BEDS_OK)); then
    if need_server; then
        run torchrun train_two
    else
        record torchrun FAIL "the retrieval server did not start"
    fi
fi

echo
echo "hdr GPU smoke summary ($((SECONDS - STARTED)) s of ${BUDGET_S} s; logs in $WORK):"
printf '  %s\n' "${SUMMARY[@]}"
exit "$FAILED"
