#!/usr/bin/env bash
# End-to-end training speed of the four one_gpu flavors on one GPU (NCCL, one process, EP=1),
# from the repo root:
#   bash benchmarks/e2e_one_gpu.sh [OVERRIDES...]        # e.g. --mok.precision mxfp8
# Kimi K2.7 Code: titan-mok (mok backend) beside TorchTitan 0.2.2's own deepseek_v3 at the same
# dimensions (python -m titan_mok.bench.e2e); GLM-5.2, Qwen3.5-397B-A17B, DeepSeek-V4-Pro:
# titan-mok alone (TorchTitan has no model with their attention). STEPS (default 20) steps a run,
# medians over the steps after WARMUP (default 8); five runs of about 1.5 minutes each (an
# estimate: start-up, Triton's first compiles, 20 steps), RUN_TIMEOUT (default 300) seconds at most each.
# Wheels as in benchmarks/train_h200.sh. In $OUT (default outputs/e2e_one_gpu): reports.txt (the
# tables), e2e_<model>.json (the reports), e2e_one_gpu.log (everything printed), e2e_runs.tar.gz
# (each run's train.log and metrics.jsonl).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
OUT=${OUT:-outputs/e2e_one_gpu}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-8}
RUNS=$(mktemp -d)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/e2e_one_gpu.log"
status=0
for model in kimi_k2_7_code glm_5_2 qwen3_5_397b_a17b deepseek_v4_pro; do
    python3 -m titan_mok.bench.e2e --model "$model" --flavor one_gpu --steps "$STEPS" --warmup "$WARMUP" \
        --out "$RUNS/$model" --timeout "${RUN_TIMEOUT:-300}" "$@" 2>&1 \
        | tee -a "$OUT/e2e_one_gpu.log" || status=1
    cat "$RUNS/$model/report.txt" >> "$OUT/reports.txt" 2>/dev/null && echo >> "$OUT/reports.txt"
    cp "$RUNS/$model/report.json" "$OUT/e2e_$model.json" 2>/dev/null
done
tar czf "$OUT/e2e_runs.tar.gz" -C "$RUNS" --exclude '*.pt' .
exit $status
