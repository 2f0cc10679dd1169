"""Kimi K2.7 Code (text): a DeepSeek-V3-style MLA + MoE decoder.

Shapes: shared/reference/model_shapes.json. Flavors: `debug` trains on CPU in
seconds, `h200` keeps the full hidden size, expert FFN size and top-k with
fewer layers and experts, `full` is the published architecture.
"""

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.model.state_dict_adapter import DeepSeekV3StateDictAdapter
from torchtitan.models.moe import MoEArgs
from torchtitan.protocols.train_spec import TrainSpec

from titan_mok.data import VOCAB_SIZE, build_char_tokenizer, build_task_dataloader
from titan_mok.parallelize import parallelize_moe_model


def _kimi_moe(num_experts: int, top_k: int) -> MoEArgs:
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=1,
        top_k=top_k,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.827,
        score_before_experts=False,
        load_balance_coeff=1e-3,
    )


_YARN = dict(rope_theta=50000.0, rope_factor=64, original_seq_len=4096, beta_fast=32, beta_slow=1, mscale=1.0)

kimi_k2_7_code_configs = {
    "debug": DeepSeekV3ModelArgs(
        vocab_size=VOCAB_SIZE,
        dim=128,
        inter_dim=384,
        moe_inter_dim=64,
        n_layers=3,
        n_dense_layers=1,
        n_heads=4,
        norm_eps=1e-5,
        moe_args=_kimi_moe(num_experts=8, top_k=2),
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        **_YARN,
    ),
    # Full width per layer (H, I, top-k, MLA dims); 4 layers (1 dense) and 64
    # experts so that weights + Adam state fit 2×H200 with room for activations.
    "h200": DeepSeekV3ModelArgs(
        vocab_size=163840,
        dim=7168,
        inter_dim=18432,
        moe_inter_dim=2048,
        n_layers=4,
        n_dense_layers=1,
        n_heads=64,
        norm_eps=1e-5,
        moe_args=_kimi_moe(num_experts=64, top_k=8),
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        **_YARN,
    ),
    "full": DeepSeekV3ModelArgs(
        vocab_size=163840,
        dim=7168,
        inter_dim=18432,
        moe_inter_dim=2048,
        n_layers=61,
        n_dense_layers=1,
        n_heads=64,
        norm_eps=1e-5,
        moe_args=_kimi_moe(num_experts=384, top_k=8),
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        **_YARN,
    ),
}


def get_train_spec() -> TrainSpec:
    return TrainSpec(
        model_cls=DeepSeekV3Model,
        model_args=kimi_k2_7_code_configs,
        parallelize_fn=parallelize_moe_model,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers_with_moe_load_balancing,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_task_dataloader,
        build_tokenizer_fn=build_char_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        state_dict_adapter=DeepSeekV3StateDictAdapter,
    )
