"""TorchTitan 0.2.2's own ``deepseek_v3`` at titan-mok's Kimi K2.7 Code dimensions: the
end-to-end baseline (``python -m titan_mok.bench.e2e``).

Registered by ``titan_mok.registry`` as ``deepseek_v3_titan_mok_dims`` with one flavor per Kimi
flavor (``debug``, ``one_gpu``, ``h200``, ``full``), so that

    torchrun --nproc_per_node 1 -m titan_mok.train --config train_configs/kimi_k2_7_code/one_gpu.toml \\
        --model.name deepseek_v3_titan_mok_dims

trains TorchTitan's model where the same TOML trains ours. The spec is TorchTitan's
(``get_train_spec("deepseek_v3")``: its ``DeepSeekV3Model`` with its MLA, its ``MoE``
(TokenChoiceTopKRouter, GroupedExperts on ``torch._grouped_mm``, shared experts), its
``parallelize_deepseekv3`` with its ``ExpertParallel``, its optimizer with the load-balancing
hook, LR schedule and loss); three builders are swapped with ``dataclasses.replace``: the data
and tokenizer (TorchTitan's HF tokenizer and text datasets cannot read the embedded ``tasks``
corpus, so both runs read the same tokens) and the metrics processor (so both write
``metrics.jsonl`` the same way). Nothing of TorchTitan's is patched; on CPU (gloo) its
parallelize function is followed by the gloo adaptation titan-mok's own applies
(``cpu_compat.use_sum_reductions``), and ``titan_mok.train`` applies ``cpu_compat``.

Kimi is DeepSeek-V3-shaped, so every dimension maps one to one (the parameter count and the
FLOPs per token TorchTitan's MFU uses equal ours: tests/models/test_one_gpu_flavors.py). Numerics differ
where TorchTitan's code does: YaRN frequencies and the mscale² softmax factor only past
``original_seq_len`` (4096), the latent RMSNorms' eps, the weight init. GLM-5.2 (MLA + DSA
indexer + MTP), Qwen3.5 (Gated DeltaNet) and DeepSeek-V4-Pro (compressed MQA, hyper-connections)
have attention TorchTitan's deepseek_v3 cannot express: no baseline maps them.
"""

import dataclasses
import functools

import torch
from torchtitan.models.moe import MoEArgs as TorchTitanMoEArgs
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec

BASELINE_MODEL = "deepseek_v3_titan_mok_dims"
"""The registered name of TorchTitan's deepseek_v3 spec at titan-mok's dimensions."""

MAPPED_MODEL = "kimi_k2_7_code"
"""The titan-mok model whose flavors the baseline's flavors mirror."""

NO_BASELINE = {
    "glm_5_2": "its attention is MLA with DeepSeek Sparse Attention (a lightning indexer picks 2048 keys per query, "
               "IndexShare), which TorchTitan's deepseek_v3 cannot express",
    "qwen3_5_397b_a17b": "three of every four layers mix tokens with Gated DeltaNet (linear attention), the fourth "
                         "with gated GQA; TorchTitan's deepseek_v3 has MLA only",
    "deepseek_v4_pro": "its attention is shared-KV MQA over a sliding window plus compressed (CSA/HCA) keys, between "
                       "mHC hyper-connections; TorchTitan's deepseek_v3 has MLA only",
}
"""titan-mok models without a same-dimensions TorchTitan model, and why."""


def deepseek_v3_args(args):
    """TorchTitan's ``DeepSeekV3ModelArgs`` at the dimensions of a Kimi-style ``MLADecoderArgs``;
    ValueError naming the field a DeepSeek-V3 model cannot express."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs

    from titan_mok.models.common.args import MLADecoderArgs

    if not isinstance(args, MLADecoderArgs):
        raise ValueError(f"TorchTitan's deepseek_v3 maps MLA decoders only; got {type(args).__name__}")
    extra = sorted({f.name for f in dataclasses.fields(args)} - {f.name for f in dataclasses.fields(MLADecoderArgs)})
    if extra:  # e.g. GLM-5.2's DSA indexer and MTP block
        raise ValueError(f"TorchTitan's deepseek_v3 cannot express {type(args).__name__}'s {', '.join(extra)}")
    moe = args.moe_args
    unsupported = {
        "moe_args.score_func": moe.score_func not in ("sigmoid", "softmax"),
        "moe_args.hash_routing": moe.hash_routing,
        "moe_args.aux_loss_coef": moe.aux_loss_coef != 0,
        "moe_args.swiglu_limit": moe.swiglu_limit is not None,
        "moe_args.shared_expert_gate": moe.shared_expert_gate,
        "moe_args.shared_expert_dim": moe.shared_expert_dim % moe.expert_dim != 0,
        "rope_interleaved": not args.rope_interleaved,
        "yarn": args.yarn is None,
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ValueError(f"TorchTitan's deepseek_v3 cannot express {type(args).__name__}'s {', '.join(bad)}")
    yarn = args.yarn
    return DeepSeekV3ModelArgs(
        vocab_size=args.vocab_size,
        dim=args.dim,
        inter_dim=args.dense_inter_dim,
        moe_inter_dim=moe.expert_dim,
        n_layers=args.n_layers,
        n_dense_layers=args.n_dense_layers,
        n_heads=args.n_heads,
        norm_eps=args.norm_eps,
        moe_args=TorchTitanMoEArgs(
            num_experts=moe.num_experts,
            num_shared_experts=moe.shared_expert_dim // moe.expert_dim,
            score_func=moe.score_func,
            route_norm=moe.route_norm,
            route_scale=moe.route_scale,
            score_before_experts=False,  # DeepSeek-V3 and ours weight the expert outputs
            top_k=moe.top_k,
            num_expert_groups=moe.num_expert_groups,
            num_limited_groups=moe.num_limited_groups,
            load_balance_coeff=moe.load_balance_coeff if moe.use_expert_bias else None,
        ),
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_head_dim,
        qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim,
        attn_type="sdpa",  # ours: F.scaled_dot_product_attention, causal
        attn_mask_type="causal",
        original_seq_len=yarn.original_seq_len,
        rope_theta=args.rope_theta,
        rope_factor=yarn.factor,
        beta_fast=int(yarn.beta_fast),
        beta_slow=int(yarn.beta_slow),
        mscale=yarn.mscale_all_dim,  # TorchTitan's mscale is the softmax-scale coefficient
    )


def baseline_flavors() -> dict:
    """Flavor → TorchTitan DeepSeekV3ModelArgs, one per Kimi K2.7 Code flavor."""
    from titan_mok.models.kimi_k2_7_code import kimi_k2_7_code_configs

    return {flavor: deepseek_v3_args(args) for flavor, args in kimi_k2_7_code_configs.items()}


def baseline_train_spec(build_metrics_processor_fn) -> TrainSpec:
    """TorchTitan's deepseek_v3 TrainSpec with the mapped flavors, titan-mok's data, tokenizer
    and the given metrics processor builder."""
    from titan_mok.data import build_char_tokenizer, build_task_dataloader

    spec = get_train_spec("deepseek_v3")
    return dataclasses.replace(
        spec,
        model_args=baseline_flavors(),
        parallelize_fn=_with_cpu_reductions(spec.parallelize_fn),
        build_dataloader_fn=build_task_dataloader,
        build_tokenizer_fn=build_char_tokenizer,
        build_metrics_processor_fn=build_metrics_processor_fn,
    )


def _with_cpu_reductions(parallelize_fn):
    """TorchTitan's parallelize function; then, without CUDA, FSDP's reductions as SUM + divide
    (gloo has no PREMUL_SUM), as titan-mok's parallelize does."""

    @functools.wraps(parallelize_fn)
    def parallelize(model, parallel_dims, job_config):
        model = parallelize_fn(model, parallel_dims, job_config)
        if not torch.cuda.is_available():
            from titan_mok import cpu_compat

            cpu_compat.use_sum_reductions(model)
        return model

    return parallelize
