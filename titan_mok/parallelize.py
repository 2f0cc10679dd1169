"""The parallelize function of titan-mok's TrainSpecs."""

import torch

from torchtitan.models.deepseek_v3.infra.parallelize import parallelize_deepseekv3

from titan_mok import cpu_compat


def parallelize_moe_model(model: torch.nn.Module, parallel_dims, job_config) -> torch.nn.Module:
    # TorchTitan's checklist (TP → EP → AC → compile → FSDP) for MLA + MoE decoders.
    model = parallelize_deepseekv3(model, parallel_dims, job_config)
    if not torch.cuda.is_available():
        cpu_compat.use_sum_reductions(model)
    return model
