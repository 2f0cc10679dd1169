"""Qwen3.5-397B-A17B (text): Gated DeltaNet + gated full attention, 512-expert MoE.

Flavors: ``debug`` trains on CPU in seconds; ``h200`` keeps the full hidden
size, attention/DeltaNet shapes, expert FFN size and top-k, with 4 layers (one
[DeltaNet ×3, full attention] period) and 64 experts, no MTP module: ~5.8 B
parameters, ~93 GB of fp32 weights + grads + Adam state, i.e. ~47 GB per GPU
under FSDP on 2×H200, leaving room for activations; ``full`` is the published
architecture (60 layers, 512 experts, 1 MTP module).
"""

from dataclasses import replace

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
from torchtitan.protocols.train_spec import TrainSpec

from titan_mok.data import VOCAB_SIZE, build_char_tokenizer, build_task_dataloader
from titan_mok.parallelize import parallelize_moe_model

from .args import Qwen35ModelArgs
from .model import Qwen35Model
from .state_dict_adapter import Qwen35StateDictAdapter

_FULL = Qwen35ModelArgs()

qwen3_5_397b_a17b_configs = {
    "debug": Qwen35ModelArgs(
        vocab_size=VOCAB_SIZE,
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        deltanet_chunk_size=16,
        moe_args=replace(_FULL.moe_args, num_experts=8, top_k=2, expert_dim=32, shared_expert_dim=32),
        n_mtp_layers=1,
    ),
    "h200": replace(_FULL, n_layers=4, moe_args=replace(_FULL.moe_args, num_experts=64), n_mtp_layers=0),
    "full": _FULL,
}


def get_train_spec() -> TrainSpec:
    return TrainSpec(
        model_cls=Qwen35Model,
        model_args=qwen3_5_397b_a17b_configs,
        parallelize_fn=parallelize_moe_model,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers_with_moe_load_balancing,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_task_dataloader,
        build_tokenizer_fn=build_char_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        state_dict_adapter=Qwen35StateDictAdapter,
    )


__all__ = ["Qwen35Model", "Qwen35ModelArgs", "Qwen35StateDictAdapter", "qwen3_5_397b_a17b_configs", "get_train_spec"]
