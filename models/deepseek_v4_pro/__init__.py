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

``one_gpu`` trains on one 80 GB GPU (train_configs/deepseek_v4_pro/one_gpu.toml: one process,
AMP, full activation checkpointing, seq 4096 × batch 1). The MoE layer as published (H 7168,
expert FFN 3072, top-6, shared expert 3072, sqrt(softplus) + bias, scale 2.5, SwiGLU clamp 10),
the published attention shapes and hyper-connections. Cut: 61 → 2 layers (a hash-routed HCA
layer, then a learned-router CSA layer: each router kind and each compressed attention once),
384 → 16 experts, no MTP module, vocab 129280 → 32768 (``titan_mok.models.common.one_gpu``
says why). 3.36 B parameters: 53.7 GB of fp32 weights + grads + AdamW states (16 B/param),
~26 GB left for activations (mHC keeps 4 copies of the hidden state) and the allocator. At
4096 tokens per step, 4096·6/16 = 1,536 rows per expert (the hash-routed layer's rows follow
its token-id table).

Training choice (``debug``, ``full``): the MTP module's loss is attached with weight 0.3
(DeepSeek-V3's first-phase value). ``mtp_loss_coef = 0`` freezes it.
"""

from dataclasses import replace

from torchtitan.protocols.train_spec import TrainSpec

from titan_mok.data import VOCAB_SIZE
from titan_mok.models.common import one_gpu
from titan_mok.models.common.train_spec import moe_train_spec

from .args import DeepSeekV4ModelArgs
from .model import DeepSeekV4Model
from .state_dict_adapter import DeepSeekV4StateDictAdapter

_FULL = DeepSeekV4ModelArgs(mtp_loss_coef=0.3)

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
        mtp_loss_coef=0.3,
    ),
    "one_gpu": replace(_FULL, vocab_size=one_gpu.VOCAB_SIZE, n_layers=2, n_hash_layers=1, compress_ratios=(128, 4),
                       moe_args=replace(_FULL.moe_args, num_experts=16), n_mtp_layers=0, mtp_loss_coef=0.0),
    "h200": replace(_FULL, n_layers=4, compress_ratios=(128, 128, 4, 128), moe_args=replace(_FULL.moe_args, num_experts=16), n_mtp_layers=0, mtp_loss_coef=0.0),
    "full": _FULL,
}


def get_train_spec() -> TrainSpec:
    return moe_train_spec(DeepSeekV4Model, deepseek_v4_pro_configs, DeepSeekV4StateDictAdapter)


__all__ = ["DeepSeekV4Model", "DeepSeekV4ModelArgs", "DeepSeekV4StateDictAdapter", "deepseek_v4_pro_configs", "get_train_spec"]
