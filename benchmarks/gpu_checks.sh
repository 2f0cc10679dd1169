#!/usr/bin/env bash
# The first device call of a session (one or two H100s or H200s), from the repo root:
#   bash benchmarks/gpu_checks.sh            (logs in $OUT, else outputs/gpu_checks)
# 1. every GPU test (`pytest -m gpu`: grouped FFN, MXFP8 quantization, fused path at EP=2,
#    shared expert on the Triton FFN, the four models' cached RL rollouts in bf16);
# 2. the router's one-call vs 64-row-tile timing (bench.router);
# 3. the weight gradient's output stores alone vs contiguous writes (bench.write_tiles);
# 4. the MoE layer benchmark (bench.layer) at Kimi's full shape on one GPU, bf16: auto (the fused path on
#    Hopper) and the megakernel vs TorchTitan's own MoE layer (titan);
# 5. with two GPUs, the MoE layer at EP=2, bf16, balanced, the four shapes: titan, auto, triton, the megakernel
#    and mok_tt (titan-mok's router/shared/combine + TorchTitan's grouped experts).
# Each stage runs even if an earlier one failed; the exit status is the first failure's.
# Needs the wheels in .whl/ (README, "On a GPU"): pass them with the device tool's carry.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
LOGS=${OUT:-outputs/gpu_checks}
mkdir -p "$LOGS"
status=0
run() {  # run NAME COMMAND...: output to $LOGS/NAME.log, a one-line summary here
    local name=$1; shift
    local start=$SECONDS
    "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s; $(tail -n 1 "$LOGS/$name.log")"
    [ $status -eq 0 ] && status=$rc
}
# The suite compiles well over a hundred kernel configs: one process takes ~25 min, more than a device call
# may run; pytest-xdist (on the GPU image) spreads the tests over GPU_TEST_WORKERS processes sharing the GPUs.
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n "${GPU_TEST_WORKERS:-8}")
run gpu_tests python3 -m pytest -q -m "gpu and not two_gpus" "${workers[@]}" --durations=15 tests
# alone, so that no worker's test shares its GPUs (they skip on one GPU)
run gpu_tests_two python3 -m pytest -q -m two_gpus tests
run router python3 -m benchmarks.tools.router --iters 50
run write_tiles python3 -m benchmarks.tools.write_tiles
run layer_kimi python3 -m titan_mok.bench.layer --shape kimi_k2_7_code --impl titan,auto,megakernel --precision bf16 \
    --json "$LOGS/layer_kimi.jsonl"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    run layer_ep2 torchrun --standalone --nproc_per_node 2 -m titan_mok.bench.layer --precision bf16 \
        --impl titan,auto,triton,megakernel,mok_tt --json "$LOGS/layer_ep2.jsonl"
else
    echo "layer_ep2: skipped (one GPU)"
fi
exit $status
