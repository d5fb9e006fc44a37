#!/usr/bin/env bash
# GPU smoke test of hdr's GPU path: what the machine has, then one line PASS, FAIL or SKIP per
# check with its reason, then a summary. Offline (the beds are built here, the corpus is the
# embedded one, the index BM25), at most HDR_SMOKE_BUDGET_S (480) seconds.
#
#   bench/gpu_smoke.sh [--without-vllm] [--allow-no-gpu] [WORK_DIR]   (default: a new temp dir)
#
# The Python it runs: HDR_GPU_PY, else .venv-gpu/bin/python (`make setup-gpu` makes it: CUDA
# torch, vLLM 0.31.0, TRL, DeepSpeed). Before anything else it prints the machine (driver and
# the CUDA it supports, each GPU and its free memory, torch and the CUDA it was built for,
# vLLM, the libraries, the settings). Then, if the machine lacks what the checks need, it
# exits 2 with one line on stderr naming it: `gpu-smoke: missing: no CUDA device: ...`, `...
# no CUDA torch: ...` or `... no vLLM: ...`. With --allow-no-gpu it reports every check SKIP
# with that reason instead, says SKIP (never PASS) in the summary, and exits 0.
#
# Checks (required ones fail the run when they skip; bench/gpu_smoke.py and
# bench/gpu_smoke_torch.py say what each holds to):
#   engine    (vLLM, required) the tests marked `vllm` (the ones `make test` runs on the CPU
#             build): tests/agent_env/test_vllm_engine.py, test_vllm_rollout.py,
#             tests/trainer/test_vllm_engine_loop.py, here on CUDA
#   sync      (vLLM, required) weight sync round trip with sleep mode, vLLM bf16 vs torch fp32
#   train     (vLLM, required) 3 steps of `hdr train`, the 3B config shrunk to the bed, vLLM
#             with sleep mode
#   hf-train  (required) the same 3 steps with hdr's hf backend on CUDA, bf16 autocast
#   scoring   (required) hdr's hf sampler against the trainer's scoring, fp32 and bf16
#   memory    (required) `hdr plan-memory` against torch.cuda.max_memory_allocated per phase of
#             a 2-step run of a 250M-parameter bed (its second step)
#   faiss     (optional: faiss with GPU support) `hdr serve` with dense.gpus=[0] answers what
#             the CPU index answers
#   torchrun  (optional: 2 GPUs) 2 steps of hf-train under torchrun, one GPU a process (NCCL)
# --without-vllm: the machine needs CUDA torch only; the three vLLM checks are not run.
#
# Numerics: TRITON_F32_DEFAULT=ieee is exported, so Triton's fp32 dots (vLLM's Triton
# attention on Hopper) are IEEE fp32, not TF32, and the fp32 agreements hold; the tolerances
# per dtype are in bench/gpu_smoke.py.
#
# A bare machine whose Python has CUDA torch but not hdr's other dependencies: set
# HDR_SMOKE_WHEELS to a folder of wheels (bench/gpu_smoke_wheels.sh makes it, about 30 MB);
# they are installed into WORK_DIR/site and put on PYTHONPATH, nothing else is touched.
# Exit status: 0 when every required check passed (or --allow-no-gpu found no GPU), 1 when a
# check failed or a required one skipped, 2 when the machine lacks what the checks need.
# Writes WORK_DIR/summary.json (each check's status and line) and each check's log.
# shellcheck disable=SC2329  # functions called by the EXIT trap or by `run` through bash -c
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WITH_VLLM=1
ALLOW_NO_GPU=0
WORK=""
for arg in "$@"; do
    case "$arg" in
        --without-vllm) WITH_VLLM=0 ;;
        --allow-no-gpu) ALLOW_NO_GPU=1 ;;
        -h | --help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "gpu-smoke: unknown option $arg (--without-vllm, --allow-no-gpu)" >&2; exit 2 ;;
        *) WORK="$arg" ;;
    esac
done
WORK="${WORK:-$(mktemp -d -t hdr-gpu-smoke.XXXXXX)}"
mkdir -p "$WORK"
cd "$ROOT" || exit 1
PY="${HDR_GPU_PY:-$ROOT/.venv-gpu/bin/python}"
BUDGET_S="${HDR_SMOKE_BUDGET_S:-480}"

# offline: no hub, no usage reports; fp32 Triton dots in IEEE fp32 (not TF32)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false TRITON_F32_DEFAULT=ieee
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
STARTED=$SECONDS
declare -a SUMMARY=() RESULTS=()
FAILED=0
RAN=0
SERVER_PID=""
CHECKS=(engine sync train hf-train scoring memory faiss torchrun)
VLLM_CHECKS=" engine sync train "
OPTIONAL=" faiss torchrun "

left() { echo $((BUDGET_S - (SECONDS - STARTED))); }

cleanup() {
    if [[ -n "$SERVER_PID" ]]; then
        kill "$SERVER_PID" 2>/dev/null
        wait "$SERVER_PID" 2>/dev/null
    fi
}
trap cleanup EXIT

# record NAME STATUS MESSAGE: print and remember one result line; a required check that
# skips fails the run
record() {
    local name="$1" status="$2" message="$3"
    if [[ "$status" == SKIP && "$OPTIONAL" != *" $name "* && $ALLOW_NO_GPU == 0 ]]; then
        message="$message (a required check: the run fails)"
        FAILED=1
    fi
    [[ "$status" == FAIL ]] && FAILED=1
    [[ "$status" != SKIP ]] && RAN=1
    local line
    line="$(printf '%-9s %-4s %s' "$name" "$status" "$message")"
    echo "$line"
    SUMMARY+=("$line")
    RESULTS+=("$name" "$status" "$message")
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

write_summary() {
    local verdict="$1"
    "$PY" - "$WORK/summary.json" "$verdict" "${RESULTS[@]}" <<'EOF' 2>/dev/null ||
import json, sys
path, verdict, *flat = sys.argv[1:]
checks = [dict(name=n, status=s, line=m) for n, s, m in zip(flat[::3], flat[1::3], flat[2::3])]
json.dump({"verdict": verdict, "checks": checks}, open(path, "w"), indent=1)
EOF
        echo "{\"verdict\": \"$verdict\"}" >"$WORK/summary.json"
}

finish() {
    local verdict=PASS
    ((RAN == 0)) && verdict=SKIP
    ((FAILED)) && verdict=FAIL
    echo
    echo "hdr GPU smoke summary ($((SECONDS - STARTED)) s of ${BUDGET_S} s; logs in $WORK):"
    printf '  %s\n' "${SUMMARY[@]}"
    case "$verdict" in
        PASS) echo "hdr GPU smoke: PASS" ;;
        SKIP) echo "hdr GPU smoke: SKIP: nothing was checked ($1)" ;;
        FAIL) echo "hdr GPU smoke: FAIL" ;;
    esac
    write_summary "$verdict"
    [[ "$verdict" == FAIL ]] && exit 1
    exit 0
}

# not_checked REASON: the machine cannot run the checks. One line and exit 2, or with
# --allow-no-gpu every check SKIP with the reason and a SKIP verdict.
not_checked() {
    if ((ALLOW_NO_GPU == 0)); then
        echo "gpu-smoke: missing: $1" >&2
        exit 2
    fi
    for name in "${CHECKS[@]}"; do record "$name" SKIP "$1"; done
    finish "$1"
}

echo "hdr GPU smoke: python $PY; work dir $WORK"
if ! "$PY" -c '' 2>/dev/null; then
    not_checked "no Python for the GPU checks at $PY: run \`make setup-gpu\` (.venv-gpu) or set HDR_GPU_PY"
fi
if [[ -n "${HDR_SMOKE_WHEELS:-}" ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" \
        "$HDR_SMOKE_WHEELS"/*.whl || not_checked "the wheels in $HDR_SMOKE_WHEELS did not install"
    export PYTHONPATH="$PYTHONPATH:$WORK/site"
fi
PREFLIGHT=()
((WITH_VLLM)) || PREFLIGHT=(--without-vllm)
"$PY" bench/gpu_smoke_machine.py "${PREFLIGHT[@]}" | tee "$WORK/machine.txt"
MISSING="$(sed -n 's/^missing: //p' "$WORK/machine.txt")"
if [[ -n "$MISSING" ]] || ! grep -qx ready "$WORK/machine.txt"; then
    not_checked "${MISSING:-the machine could not be read (see above)}"
fi
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
echo

BED="$WORK/qwen-bed"
MEDIUM="$WORK/qwen-bed-250m"
# the beds: the tiny Qwen2 bed (checks of behaviour), and a 250M-parameter one for the memory
# check, where the planner's per-parameter lines dominate (a minute on a CPU at most)
build_beds() {
    [[ -e "$BED" ]] || "$PY" -m hdr.cli init-model --arch qwen2 --out "$BED" \
        hidden_size=64 num_layers=2 num_heads=2 num_kv_heads=1 intermediate_size=128 init_std=0.3 \
        >"$WORK/bed.log" 2>&1 || return 1
    [[ -e "$MEDIUM" ]] || "$PY" -m hdr.cli init-model --arch qwen2 --out "$MEDIUM" \
        hidden_size=1024 num_layers=8 num_heads=16 num_kv_heads=2 intermediate_size=2816 \
        >>"$WORK/bed.log" 2>&1 || return 1
}
if ! build_beds; then
    for name in "${CHECKS[@]}"; do record "$name" FAIL "building the beds failed (log: $WORK/bed.log)"; done
    finish "no bed"
fi

# --- a retrieval server on a small BM25 index of the embedded corpus ----------------------
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
# BM25 only: no encoder travels to a bare machine (the faiss check builds its dense index). A
# BM25-only build still records the encoder a dense index would use, read from a model
# directory; the bed's stands in for the packaged MiniLM (83 MB, not carried), and BM25 never
# uses it.
if "$PY" -m hdr.cli index prepare-wiki --out "$WORK/wiki.jsonl" --limit 300 >"$WORK/index.log" 2>&1 &&
    "$PY" -m hdr.cli index build --corpus "$WORK/wiki.jsonl" --out "$INDEX" --no-dense \
        --encoder "$BED" >>"$WORK/index.log" 2>&1; then
    SERVER_PID="$(start_server "$PORT" "$INDEX" --retriever bm25)" || SERVER_PID=""
fi
SERVED=$([[ -n "$SERVER_PID" ]] && echo 1 || echo 0)
no_server="the retrieval server did not start (logs: $WORK/index.log, $WORK/serve-$PORT.log)"

# the same tests as on the CPU; their own output, then one line for this summary
vllm_tests() {
    "$PY" -m pytest -q -p no:cacheprovider -m "vllm and not slow" \
        tests/agent_env/test_vllm_engine.py tests/agent_env/test_vllm_rollout.py \
        tests/trainer/test_vllm_engine_loop.py
    local status=$?
    if ((status == 0)); then echo "PASS: the tests marked vllm, on CUDA"; else echo "FAIL: pytest exit $status"; fi
    return "$status"
}

faiss_check() {
    local dense="$WORK/index-dense" gpu_pid cpu_pid
    "$PY" -m hdr.cli index build --corpus "$WORK/wiki.jsonl" --out "$dense" --no-bm25 ||
        { echo "FAIL: hdr index build (dense) failed"; return 1; }
    cpu_pid="$(start_server $((PORT + 1)) "$dense")" || { echo "FAIL: hdr serve (CPU index) did not start"; return 1; }
    gpu_pid="$(start_server $((PORT + 2)) "$dense" 'dense.gpus=[0]')" || { kill "$cpu_pid"; echo "FAIL: hdr serve with dense.gpus=[0] did not start"; return 1; }
    "$PY" - "http://127.0.0.1:$((PORT + 1))" "http://127.0.0.1:$((PORT + 2))" <<'EOF'
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
    kill "$gpu_pid" "$cpu_pid" 2>/dev/null
    wait "$gpu_pid" "$cpu_pid" 2>/dev/null
    return "$status"
}
export PY WORK PORT
export -f start_server vllm_tests faiss_check

# --- the checks, in the order of the header ----------------------------------------------
for name in "${CHECKS[@]}"; do
    if [[ "$VLLM_CHECKS" == *" $name "* ]] && ((WITH_VLLM == 0)); then
        continue # --without-vllm: not part of this run
    fi
    case "$name" in
        engine) run engine vllm_tests ;;
        sync) run sync "$PY" bench/gpu_smoke.py sync "$BED" ;;
        scoring) run scoring "$PY" bench/gpu_smoke_torch.py scoring "$BED" cuda:0 ;;
        train | hf-train | memory | torchrun)
            if ((SERVED == 0)); then record "$name" FAIL "$no_server"; continue; fi
            case "$name" in
                train) run train "$PY" bench/gpu_smoke_torch.py train "$WORK" "$BED" "$URL" vllm 3 ;;
                hf-train) run hf-train "$PY" bench/gpu_smoke_torch.py train "$WORK" "$BED" "$URL" hf 3 ;;
                memory) run memory "$PY" bench/gpu_smoke_torch.py memory "$WORK" "$MEDIUM" "$URL" ;;
                torchrun)
                    if ((GPUS < 2)); then record torchrun SKIP "fewer than 2 GPUs visible ($GPUS)"; continue; fi
                    run torchrun "$PY" bench/gpu_smoke_torch.py train "$WORK" "$BED" "$URL" hf 2 2 ;;
            esac
            ;;
        faiss)
            if ! "$PY" -c 'import faiss, sys; sys.exit(not (hasattr(faiss, "GpuMultipleClonerOptions") and faiss.get_num_gpus() > 0))' 2>/dev/null; then
                record faiss SKIP "faiss has no GPU support here (pip install faiss-gpu-cu12 in place of faiss-cpu)"
            else
                run faiss faiss_check
            fi
            ;;
    esac
done
finish ""
