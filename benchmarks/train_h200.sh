#!/usr/bin/env bash
# The training entry on the 2×H200 machine (NCCL), from the repo root:
#   bash benchmarks/train_h200.sh [CONFIG [OVERRIDES...]]
# The machine has torch 2.11 and Triton 3.6 but no network: TorchTitan and its
# pure-Python dependencies travel as wheels in .whl/ (README, "On a GPU").
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
CONFIG=${1:-train_configs/kimi_k2_7_code/h200.toml}
shift || true
torchrun --standalone --nproc_per_node "${NPROC:-2}" -m titan_mok.train --config "$CONFIG" --metrics.disable_color_printing "$@"
