"""The parallelize function of titan-mok's TrainSpecs: EP → AC → compile → FSDP.

Every model's blocks sit in `model.layers` with `moe_enabled` and `moe`
(`titan_mok.moe.MoE`), beside `tok_embeddings`, `norm` and `output`, so one
checklist serves all four models. TorchTitan's own `apply_ac` and `apply_fsdp` do
the work; the expert-parallel step and the compile step (which leaves the MoE layer
eager) are ours.
"""

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor.parallel import parallelize_module

from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.expert_parallel import ExpertParallel
from torchtitan.models.llama4.infra.parallelize import apply_fsdp

from titan_mok import cpu_compat
from titan_mok.moe.expert_parallel import MokExpertParallel
from titan_mok.moe.experts import RoutedExperts
from titan_mok.moe.mxfp8_fsdp import gather_as_mxfp8, gather_layouts

# Ops whose outputs selective AC keeps (op mode): matmuls and the collectives.
_OP_SAC_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops.aten.max.default,
}


def apply_ep(model: torch.nn.Module, ep_mesh) -> None:
    """Experts become DTensors Shard(0) on the ep mesh: titan-mok's style for a layer
    built with backend "mok", TorchTitan's all-to-all ExpertParallel for "torchtitan"
    (the layer's own MoEArgs decide, so style and experts module always match)."""
    for block in model.layers.values():
        if block.moe_enabled:
            if block.moe.args.backend == "mok":
                parallelize_module(block.moe.experts, ep_mesh, MokExpertParallel())
            else:
                parallelize_module(block.moe.experts, ep_mesh, ExpertParallel())
                # The layer's data checks (NaN logits, token ids) then raise on every ep rank.
                block.moe.experts.ep_mesh = ep_mesh


def apply_compile(model: torch.nn.Module, compile_config) -> None:
    """``torch.compile`` (fullgraph) on every child of every block except its MoE layer,
    which runs eager: its dispatch reads split sizes and its input checks read flags on
    the host. (TorchTitan's ``apply_compile`` treats only its own MoE class so and would
    compile ours whole.)"""
    for block in model.layers.values():
        inner = block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
        for name, child in inner.named_children():
            if name != "moe":
                # static shapes: a model's layers share code but not shapes (DeepSeek-V4's
                # compress ratios), and inductor failed on the dynamic graph it then traced
                compiled = torch.compile(child, backend=compile_config.backend, fullgraph=True, dynamic=False)
                setattr(inner, name, compiled)


def gather_mxfp8_experts(model: torch.nn.Module, parallel_dims, job_config) -> None:
    """Before FSDP: the mxfp8 routed experts' weights are all-gathered as MXFP8 (titan_mok.moe.mxfp8_fsdp),
    each gather carrying the layouts its pass reads. A block's experts: FSDP reshards the block after
    forward unless ``fsdp_reshard_after_forward = "never"`` (no pipeline parallelism here), a checkpointed
    block recomputes its forward in the backward, and they are sharded over the expert-FSDP ranks (EP) or
    the FSDP ranks. Experts outside the blocks (an MTP module's): in FSDP's root group, which FSDP never
    reshards after forward, not expert-parallel, sharded over the FSDP ranks."""
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts) and m.precision == "mxfp8"]
    if not experts:
        return
    if job_config.training.enable_cpu_offload:
        raise ValueError("[training] enable_cpu_offload = true with [mok] precision = 'mxfp8': FSDP's offload "
                         "copies would drop the MXFP8 all-gather of the expert weights; turn one of them off")
    blocks = {id(block.moe.experts): block for block in model.layers.values() if block.moe_enabled}
    reshards = job_config.parallelism.fsdp_reshard_after_forward != "never"
    for module in experts:
        block = blocks.get(id(module))
        if block is None:
            layouts, mesh = gather_layouts(False, False), parallel_dims.get_mesh("fsdp")
        else:
            layouts = gather_layouts(reshards, recomputes_forward=isinstance(block, CheckpointWrapper))
            mesh = parallel_dims.get_mesh("efsdp" if parallel_dims.ep_enabled else "fsdp")
        gather_as_mxfp8(module, mesh.size(), layouts)


def parallelize_moe_model(model: torch.nn.Module, parallel_dims, job_config) -> torch.nn.Module:
    # (tensor/context/pipeline parallel degrees > 1 are rejected by titan_mok.config_check)
    if parallel_dims.ep_enabled:
        apply_ep(model, parallel_dims.get_mesh("ep"))

    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config.activation_checkpoint, model_compile_enabled=compile_model,
                 op_sac_save_list=_OP_SAC_SAVE_LIST, base_folder=job_config.job.dump_folder)
    if compile_model:
        apply_compile(model, job_config.compile)

    if parallel_dims.fsdp_enabled or parallel_dims.ep_enabled:
        replicate = ["dp_replicate"] if parallel_dims.dp_replicate_enabled else []
        gather_mxfp8_experts(model, parallel_dims, job_config)
        apply_fsdp(
            model,
            parallel_dims.get_mesh(replicate + ["fsdp"]),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            pp_enabled=False,
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
            ep_degree=parallel_dims.ep,
            edp_mesh=parallel_dims.get_optional_mesh(replicate + ["efsdp"]),
            gradient_divide_factor=parallel_dims.fsdp_gradient_divide_factor,
        )
        if not torch.cuda.is_available():
            cpu_compat.use_sum_reductions(model)
        for module in model.modules():
            if isinstance(module, RoutedExperts):
                module.weights_gathered = True  # FSDP gathers them before every forward (mxfp8: as MXFP8)
    return model
