"""Kimi K2.7 Code (text): a DeepSeek-V3-style MLA + MoE decoder with YaRN RoPE.

Shapes: shared/reference/model_shapes.json (the text_config, identical to
Kimi-K2.5/K2.6). Flavors:

- ``debug``: tiny (3 layers, 8 experts, top-2), trains on CPU (2 ranks, EP=2) in
  the test suite.
- ``one_gpu``: trains on one 80 GB GPU (train_configs/kimi_k2_7_code/one_gpu.toml: one
  process, AMP, full activation checkpointing, seq 4096 × batch 1). The MoE layer as published
  (H 7168, expert FFN 2048, top-8, shared expert 2048, sigmoid + bias, scale 2.827), the
  published MLA and dense FFN. Cut: 61 → 3 layers (the dense one, then 2 MoE), 384 → 32
  experts, vocab 163840 → 32768 (``titan_mok.models.common.one_gpu`` says why). 4.08 B
  parameters: 65.2 GB of fp32 weights + grads + AdamW states (16 B/param), ~15 GB left for
  activations and the allocator. At 4096 tokens per step, 4096·8/32 = 1,024 rows per expert.
  TorchTitan's deepseek_v3 at these dimensions is the end-to-end baseline (``titan_mok.baseline``).
- ``h200``: every per-layer shape of the full model (H 7168, dense FFN 18432,
  expert FFN 2048, top-8, shared expert 2048, 64 MLA heads and ranks, YaRN,
  vocab 163840). Cut: 61 → 4 layers (the dense one, then 3 MoE) and 384 → 48
  experts per MoE layer. Why: 9.62 B parameters, whose fp32 weights + grads +
  AdamW states (16 B/param) take ~77 GB per GPU when sharded over 2×H200 (141 GB
  each), leaving room for activations and the fp32 logits of the 163840-token
  vocabulary at seq 4096. (More experts would leave top-8 of E closer to the real
  8/384 routing sparsity, but 64 already needs ~94 GB per GPU before activations.)
- ``full``: the published architecture (61 layers, 384 experts): 1026.4 B
  parameters, 32.9 B active per token (published: "1 T total, 32 B activated").

Checked against transformers' DeepseekV3 classes (tests/models/test_model_kimi.py).
Where they or TorchTitan's DeepSeek-V3 differ from the published config, we
follow the config: untied embeddings (``Kimi_K25Config`` defaults to tied);
``n_group = topk_group = 1`` (DeepseekV3Config defaults 8/4); YaRN frequencies
and the mscale² softmax factor always on (TorchTitan applies them only when
training beyond the original 4096 tokens); q/kv latent RMSNorm eps 1e-6 as in
the reference code (TorchTitan uses the block eps).
"""

from torchtitan.protocols.train_spec import TrainSpec

from titan_mok.data import VOCAB_SIZE
from titan_mok.models.common import one_gpu
from titan_mok.models.common.args import sigmoid_noaux_moe
from titan_mok.models.common.rope import YaRN
from titan_mok.models.common.train_spec import moe_train_spec

from .args import KimiK27CodeArgs
from .model import KimiK27CodeModel
from .state_dict_adapter import KimiK27CodeStateDictAdapter

__all__ = ["KimiK27CodeArgs", "KimiK27CodeModel", "KimiK27CodeStateDictAdapter", "kimi_k2_7_code_configs", "get_train_spec"]


def _kimi_moe(num_experts: int):
    return sigmoid_noaux_moe(num_experts, top_k=8, expert_dim=2048, route_scale=2.827)


# rope_scaling of the published config
_YARN = YaRN(factor=64, original_seq_len=4096, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)

# Published Kimi K2.7 Code per-layer shapes.
_KIMI_LAYER = dict(
    vocab_size=163840,
    dim=7168,
    n_dense_layers=1,
    dense_inter_dim=18432,
    norm_eps=1e-5,
    n_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_theta=50000.0,
    rope_interleaved=True,
    yarn=_YARN,
)

kimi_k2_7_code_configs = {
    "debug": KimiK27CodeArgs(
        vocab_size=VOCAB_SIZE,
        dim=128,
        n_layers=3,
        n_dense_layers=1,
        dense_inter_dim=384,
        n_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        rope_theta=50000.0,
        yarn=_YARN,
        moe_args=sigmoid_noaux_moe(num_experts=8, top_k=2, expert_dim=64, route_scale=2.827),
    ),
    "one_gpu": KimiK27CodeArgs(**{**_KIMI_LAYER, "vocab_size": one_gpu.VOCAB_SIZE}, n_layers=3, moe_args=_kimi_moe(32)),
    "h200": KimiK27CodeArgs(**_KIMI_LAYER, n_layers=4, moe_args=_kimi_moe(48)),
    "full": KimiK27CodeArgs(**_KIMI_LAYER, n_layers=61, moe_args=_kimi_moe(384)),
}


def get_train_spec() -> TrainSpec:
    return moe_train_spec(KimiK27CodeModel, kimi_k2_7_code_configs, KimiK27CodeStateDictAdapter)
