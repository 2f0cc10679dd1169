"""Qwen3.5-397B-A17B (text): Gated DeltaNet + gated full attention, 512-expert MoE.

Flavors: ``debug`` trains on CPU in seconds; ``h200`` keeps the full hidden
size, attention/DeltaNet shapes, expert FFN size and top-k, with 4 layers (one
[DeltaNet ×3, full attention] period) and 64 experts, no MTP module: ~5.8 B
parameters, ~93 GB of fp32 weights + grads + Adam state, i.e. ~47 GB per GPU
under FSDP on 2×H200, leaving room for activations; ``full`` is the published
architecture (60 layers, 512 experts, 1 MTP module).

``one_gpu`` trains on one 80 GB GPU (train_configs/qwen3_5_397b_a17b/one_gpu.toml: one
process, AMP, full activation checkpointing, seq 4096 × batch 1). The MoE layer as published
(H 4096, expert FFN 1024, top-10 of softmax scores, sigmoid-gated shared expert 1024, aux loss
1e-3), the published DeltaNet and gated attention. Cut: 60 → 4 layers (one [DeltaNet ×3, full
attention] period), 512 → 64 experts, no MTP module, vocab 248320 → 32768
(``titan_mok.models.common.one_gpu`` says why). 4.00 B parameters: 64.0 GB of fp32 weights +
grads + AdamW states (16 B/param), ~16 GB left for activations and the allocator. At 4096
tokens per step, 4096·10/64 = 640 rows per expert.

Training choice (``debug``, ``full``): the MTP module's loss is attached with weight 0.3
(DeepSeek-V3's first-phase value; Qwen publishes none). ``mtp_loss_coef = 0`` freezes it.
"""

from dataclasses import replace

from torchtitan.protocols.train_spec import TrainSpec

from titan_mok.data import VOCAB_SIZE
from titan_mok.models.common import one_gpu
from titan_mok.models.common.train_spec import moe_train_spec

from .args import Qwen35ModelArgs
from .model import Qwen35Model
from .state_dict_adapter import Qwen35StateDictAdapter

_FULL = Qwen35ModelArgs(mtp_loss_coef=0.3)

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
        mtp_loss_coef=0.3,
    ),
    "one_gpu": replace(_FULL, vocab_size=one_gpu.VOCAB_SIZE, n_layers=4, moe_args=replace(_FULL.moe_args, num_experts=64),
                       n_mtp_layers=0, mtp_loss_coef=0.0),
    "h200": replace(_FULL, n_layers=4, moe_args=replace(_FULL.moe_args, num_experts=64), n_mtp_layers=0, mtp_loss_coef=0.0),
    "full": _FULL,
}


def get_train_spec() -> TrainSpec:
    return moe_train_spec(Qwen35Model, qwen3_5_397b_a17b_configs, Qwen35StateDictAdapter)


__all__ = ["Qwen35Model", "Qwen35ModelArgs", "Qwen35StateDictAdapter", "qwen3_5_397b_a17b_configs", "get_train_spec"]
