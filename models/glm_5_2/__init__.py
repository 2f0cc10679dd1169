"""GLM-5.2 (text): MLA + DeepSeek Sparse Attention with IndexShare, MoE, one MTP block.

Shapes: shared/reference/model_shapes.json. Flavors:

- ``debug``: tiny, trains on CPU (2 ranks, EP=2) in the test suite; a short
  ``index_topk`` and IndexShare every 2nd layer so the sparse path is exercised.
- ``one_gpu``: trains on one 80 GB GPU (train_configs/glm_5_2/one_gpu.toml: one process,
  AMP, full activation checkpointing, seq 4096 × batch 1, so DSA's indexer picks 2048 of up to
  4096 keys). The MoE layer as published (H 6144, expert FFN 2048, top-8, shared expert 2048,
  sigmoid + bias, scale 2.5), the published MLA, indexer and dense FFN. Cut: 78 → 4 layers
  (1 dense, then 3 MoE; layers 0–2 run their own indexer, layer 3 reuses layer 2's top-k, as
  IndexShare does from layer 3 on), 256 → 20 experts, no MTP block, vocab 154880 → 32768
  (``titan_mok.models.common.one_gpu`` says why). 3.70 B parameters: 59.1 GB of fp32 weights +
  grads + AdamW states (16 B/param), ~21 GB left for activations and the allocator (fewer
  experts than Kimi's flavor: at seq 4096 a layer's indexer scores alone, [S, 32 heads, S] fp32,
  take 2.1 GB, and DSA's masked attention does not run flash). At 4096 tokens per step,
  4096·8/20 = 1,638 rows per expert.
- ``h200``: per-layer shapes of the full model (H 6144, dense FFN 12288, expert
  FFN 2048, top-8, shared expert 2048, 64 heads, MLA and indexer dims, vocab,
  MTP). Cut: 78 → 5 main layers (the 3 dense ones, then 2 MoE; layers 3–4 reuse
  layer 2's top-k as in the full model) and 256 → 48 experts per MoE layer (MTP
  block included). Why: 9.24 B parameters, whose fp32 weights + grads + AdamW
  states (16 B/param) take ~74 GB per GPU when sharded over 2×H200 (141 GB each),
  leaving room for activations and the fp32 logits of the 154880-token
  vocabulary (train_configs/glm_5_2/h200.toml: seq 3072 > index_topk, so DSA runs).
- ``full``: the published architecture (78 layers + MTP, 256 experts): 753.3 B
  parameters with the MTP block, 743.4 B without; GLM-5's published 744 B has an
  indexer on all 78 layers (+0.53 B), IndexShare keeps 21.

Training choices, all flavors: the MTP loss is added with weight 0.3 (DeepSeek-V3's
first-phase value) and the indexer learns its KL objective (weight 1; it trains the
indexer only). Set ``mtp_loss_coef``/``index_loss_coef`` to 0 to freeze them.

Checked against transformers' GlmMoeDsa (tests/models/test_model_glm5.py). Where its
defaults differ from the published config, we follow the config: IndexShare
schedule freq 4 / offset 3 (transformers defaults to an indexer on every
layer). transformers drops the MTP layer
(``model.layers.78``) on load; we define, load and optionally train it, with
transformers' MtpLayer input order (embedding first, then hidden state).
"""

from torchtitan.protocols.train_spec import TrainSpec

from titan_mok.data import VOCAB_SIZE
from titan_mok.models.common import one_gpu
from titan_mok.models.common.args import sigmoid_noaux_moe
from titan_mok.models.common.train_spec import moe_train_spec

from .args import GLM52Args
from .model import GLM52Model
from .state_dict_adapter import GLM52StateDictAdapter

__all__ = ["GLM52Args", "GLM52Model", "GLM52StateDictAdapter", "glm_5_2_configs", "get_train_spec"]


def _glm_moe(num_experts: int):
    return sigmoid_noaux_moe(num_experts, top_k=8, expert_dim=2048, route_scale=2.5)


# Published GLM-5 per-layer shapes (model_shapes.json "glm_5_2").
_GLM_LAYER = dict(
    vocab_size=154880,
    dim=6144,
    n_dense_layers=3,
    dense_inter_dim=12288,
    norm_eps=1e-5,
    n_heads=64,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    rope_theta=8_000_000.0,
    rope_interleaved=True,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
    index_topk_freq=4,
    index_skip_topk_offset=3,
    index_loss_coef=1.0,
    n_mtp_layers=1,
)

glm_5_2_configs = {
    "debug": GLM52Args(
        vocab_size=VOCAB_SIZE,
        dim=128,
        n_layers=4,
        n_dense_layers=1,
        dense_inter_dim=384,
        n_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=48,
        qk_rope_head_dim=16,
        v_head_dim=64,
        rope_theta=8_000_000.0,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=32,
        index_topk_freq=2,
        index_skip_topk_offset=1,
        index_loss_coef=1.0,
        n_mtp_layers=1,
        mtp_loss_coef=0.3,
        moe_args=sigmoid_noaux_moe(num_experts=8, top_k=2, expert_dim=64, route_scale=2.5),
    ),
    "one_gpu": GLM52Args(**{**_GLM_LAYER, "vocab_size": one_gpu.VOCAB_SIZE, "n_dense_layers": 1, "n_mtp_layers": 0},
                         n_layers=4, mtp_loss_coef=0.0, moe_args=_glm_moe(20)),
    "h200": GLM52Args(**_GLM_LAYER, n_layers=5, mtp_loss_coef=0.3, moe_args=_glm_moe(48)),
    "full": GLM52Args(**_GLM_LAYER, n_layers=78, mtp_loss_coef=0.3, moe_args=_glm_moe(256)),
}


def get_train_spec() -> TrainSpec:
    return moe_train_spec(GLM52Model, glm_5_2_configs, GLM52StateDictAdapter)
