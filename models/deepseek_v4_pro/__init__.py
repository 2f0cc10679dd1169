"""DeepSeek-V4-Pro: shared-KV MQA with sliding window + CSA/HCA compressed
attention, mHC hyper-connections, 384-expert MoE (first 3 layers hash-routed).

Flavors: ``debug`` trains on CPU in seconds (4 layers covering HCA, CSA and
sliding-only attention and both router kinds, small windows/ratios so the
compressed branches are exercised at seq_len 128); ``h200`` keeps the full
hidden size, attention shapes, ratios, expert FFN size and top-k, with 4 layers
(hash ×3 + learned; HCA, HCA, CSA, HCA as the published schedule starts) and 16
experts, no MTP module: 7.6 B parameters, ~122 GB of fp32 weights + grads +
Adam state, ~61 GB per GPU under FSDP on 2×H200; ``full`` is the published
architecture (61 layers, 384 experts, 1 MTP module).
"""

from dataclasses import replace

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
from torchtitan.protocols.train_spec import TrainSpec

from titan_mok.data import VOCAB_SIZE, build_char_tokenizer, build_task_dataloader
from titan_mok.parallelize import parallelize_moe_model

from .args import DeepSeekV4ModelArgs
from .model import DeepSeekV4Model
from .state_dict_adapter import DeepSeekV4StateDictAdapter

_FULL = DeepSeekV4ModelArgs()

deepseek_v4_pro_configs = {
    "debug": DeepSeekV4ModelArgs(
        vocab_size=VOCAB_SIZE,
        dim=64,
        n_layers=4,
        n_heads=4,
        head_dim=32,
        rope_head_dim=8,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        sliding_window=16,
        compress_ratios=(16, 16, 4, 0),
        csa_ratio=4,
        hca_ratio=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=8,
        rope_factor=4.0,
        original_seq_len=64,
        moe_args=replace(_FULL.moe_args, num_experts=8, top_k=2, expert_dim=32, shared_expert_dim=32),
    ),
    "h200": replace(_FULL, n_layers=4, compress_ratios=(128, 128, 4, 128), moe_args=replace(_FULL.moe_args, num_experts=16), n_mtp_layers=0),
    "full": _FULL,
}


def get_train_spec() -> TrainSpec:
    return TrainSpec(
        model_cls=DeepSeekV4Model,
        model_args=deepseek_v4_pro_configs,
        parallelize_fn=parallelize_moe_model,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers_with_moe_load_balancing,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_task_dataloader,
        build_tokenizer_fn=build_char_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        state_dict_adapter=DeepSeekV4StateDictAdapter,
    )


__all__ = ["DeepSeekV4Model", "DeepSeekV4ModelArgs", "DeepSeekV4StateDictAdapter", "deepseek_v4_pro_configs", "get_train_spec"]
