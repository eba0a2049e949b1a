#!/usr/bin/env bash
# Relay's GPU check: one script, under 8 minutes on an H200, ending with a short table.
#
#   bash scripts/gpu_check.sh            # from the repository root (or anywhere)
#
# Steps (each under `timeout`, all under one overall budget, GPU_CHECK_BUDGET seconds,
# default 450; a failed or timed-out step is reported and the next one still runs):
#   1 env           versions, GPU, which attention backends are there (triton; flashinfer if installed)
#   2 build         a Qwen3-0.6B-shaped model with random weights (hidden 1024, 28 layers, 16/8
#                   heads, head_dim 128, intermediate 3072, vocab 151936, tied embeddings),
#                   saved with save_pretrained + a tokenizer (the default model's, else a tiny one)
#   3 correctness   each backend vs the torch backend on CUDA, bf16: greedy tokens of 8 prompts
#                   (32 decode steps, CUDA graphs on) and teacher-forced logits (max abs diff,
#                   argmax agreement), beside the bf16 noise floor (torch bf16 vs torch fp32)
#   4 decode        ms per decode step with CUDA graphs on and off at batch 1, 16, 64 (context 256)
#                   beside the roofline (weights + KV bytes at 4.3 TB/s, FLOPs at 790 TFLOP/s)
#   5 throughput    `python -m scripts.bench offline` on the same config (dummy weights), Relay only
#   6 table         printed last; also written to $OUT/gpu_check.md when $OUT is set
# Step limits: GPU_CHECK_CORRECTNESS_S (210) and GPU_CHECK_DECODE_S (120) lengthen the two steps that
# build flashinfer's kernels on first use (its JIT); PYTHON names the interpreter (python3).
# Work files: $GPU_CHECK_DIR (default ${TMPDIR:-/tmp}/relay_gpu_check); the model is reused.
# Plumbing dry run on a CPU machine (tiny model, torch backend twice, no GPU numbers):
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_TINY=1 GPU_CHECK_BACKENDS=torch GPU_CHECK_DECODE_BS=1,2 \
#   GPU_CHECK_NUM_SEQS=4 GPU_CHECK_DIR=/tmp/gc bash scripts/gpu_check.sh
# Exit status: 0 when every step ran to completion, 1 otherwise (the table says which).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
# Shorter flashinfer JIT compile (fa2 prefill kernels rather than Hopper's fa3); override to taste.
export RELAY_FLASHINFER_PREFILL_BACKEND="${RELAY_FLASHINFER_PREFILL_BACKEND:-fa2}"

WORK="${GPU_CHECK_DIR:-${TMPDIR:-/tmp}/relay_gpu_check}"
MODEL="$WORK/qwen3-0.6b-random"
RESULTS="$WORK/results.jsonl"
BENCH_JSON="$WORK/bench_offline.jsonl"
mkdir -p "$WORK"
: > "$RESULTS"
: > "$BENCH_JSON"

BUDGET="${GPU_CHECK_BUDGET:-450}"
DEADLINE=$((SECONDS + BUDGET))
FAILED=0

# step NAME LIMIT_SECONDS COMMAND...: run under timeout (capped by what is left of the budget),
# record {"section": "step", ...} in the results, never stop the script.
step() {
    local name="$1" limit="$2"
    shift 2
    local left=$((DEADLINE - SECONDS))
    if ((left < 15)); then
        echo "=== [$name] skipped: the ${BUDGET}s budget is spent"
        printf '{"section": "step", "name": "%s", "rc": 125, "seconds": 0}\n' "$name" >> "$RESULTS"
        FAILED=1
        return 0
    fi
    ((limit > left)) && limit=$left
    echo
    echo "=== [$name] $(date +%T) (timeout ${limit}s)"
    local t0=$SECONDS rc=0
    timeout -k 10 "$limit" "$@" || rc=$?
    local took=$((SECONDS - t0))
    printf '{"section": "step", "name": "%s", "rc": %d, "seconds": %d}\n' "$name" "$rc" "$took" >> "$RESULTS"
    if ((rc != 0)); then
        FAILED=1
        if ((rc == 124 || rc == 137)); then
            echo "!!! [$name] timed out after ${took}s"
        else
            echo "!!! [$name] failed (exit $rc) after ${took}s"
        fi
    else
        echo "--- [$name] done in ${took}s"
    fi
    return 0
}

PYTHON="${PYTHON:-python3}"  # GPU images often have python3 and no plain python
PY=("$PYTHON" scripts/gpu_check.py --results "$RESULTS")

step "1/6 env" 60 "${PY[@]}" env
step "2/6 build-model" 120 "${PY[@]}" build --out "$MODEL"
BACKENDS="${GPU_CHECK_BACKENDS:-triton,flashinfer}"  # those not installed are left out
step "3/6 correctness" "${GPU_CHECK_CORRECTNESS_S:-210}" "${PY[@]}" correctness --model "$MODEL" --backends "$BACKENDS"
step "4/6 decode-speed" "${GPU_CHECK_DECODE_S:-120}" "${PY[@]}" decode-speed --model "$MODEL" --backends "$BACKENDS" \
    --batch-sizes "${GPU_CHECK_DECODE_BS:-1,16,64}" --context 256
step "5/6 throughput" 150 "$PYTHON" -m scripts.bench offline --no-hf --model-path "$MODEL" --load-format dummy \
    --device "${GPU_CHECK_DEVICE:-cuda}" --dtype bfloat16 --num-seqs "${GPU_CHECK_NUM_SEQS:-256}" \
    --chunked-prefill-size 8192 --output-json "$BENCH_JSON"

echo
echo "=== [6/6 table] $(date +%T)"
MD_ARGS=()
if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    MD_ARGS=(--md "$OUT/gpu_check.md")
    cp "$RESULTS" "$OUT/gpu_check_results.jsonl" || true
fi
timeout -k 5 60 "${PY[@]}" table --model "$MODEL" --bench-json "$BENCH_JSON" "${MD_ARGS[@]}" || FAILED=1
exit "$FAILED"
