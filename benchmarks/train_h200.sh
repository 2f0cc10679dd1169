#!/usr/bin/env bash
# The training entry on the 2×H200 machine (NCCL), from the repo root:
#   bash benchmarks/train_h200.sh [CONFIG [OVERRIDES...]]
# The machine has torch 2.11 and Triton 3.6 but no network: TorchTitan and its
# pure-Python dependencies travel as wheels in .whl/ (README, "On a GPU").
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ! python3 -c "import torchtitan" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
python3 -c "import titan_mok.models" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
CONFIG=${1:-train_configs/kimi_k2_7_code/h200.toml}
shift || true
torchrun --standalone --nproc_per_node "${NPROC:-2}" -m titan_mok.train --config "$CONFIG" --metrics.disable_color_printing "$@"
