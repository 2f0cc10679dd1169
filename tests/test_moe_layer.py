"""Single-process MoE layer: parity with HF transformers' MoE blocks (fp32),
gradients against a plain-autograd reference, determinism, batch invariance,
routing extremes, bad input."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titan_mok.moe import MoE, MoEArgs
from titan_mok.moe.aux_loss import load_balance_aux_loss

H, I, E, K = 32, 16, 8, 3


def _moe(dtype=torch.float32, seed=0, **overrides) -> MoE:
    args = MoEArgs(**{"num_experts": E, "top_k": K, "expert_dim": I, "shared_expert_dim": 24, **overrides})
    torch.manual_seed(seed)
    moe = MoE(args, H)
    moe.init_weights(0.1, torch.device("cpu"))
    with torch.no_grad():  # large enough weights that routing and clamps matter
        for p in moe.parameters():
            p.normal_(0, 0.3)
        moe.expert_bias.normal_(0, 0.1)
    return moe.to(dtype)


# ---------------------------------------------------------------- HF parity


def _load_experts(moe: MoE, hf_experts) -> None:
    hf_experts.gate_up_proj.copy_(torch.cat([moe.experts.w_gate, moe.experts.w_up], dim=1))
    hf_experts.down_proj.copy_(moe.experts.w_down)


def _load_shared(moe: MoE, hf_mlp) -> None:
    hf_mlp.gate_proj.weight.copy_(moe.shared_expert.w_gate.weight)
    hf_mlp.up_proj.weight.copy_(moe.shared_expert.w_up.weight)
    hf_mlp.down_proj.weight.copy_(moe.shared_expert.w_down.weight)


def _hf_deepseek_v3_style(module_path, config_name, block_name, n_group, topk_group):
    import importlib

    mod = importlib.import_module(module_path)
    config = getattr(mod, config_name)(
        hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
        n_shared_experts=1, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True,
    )
    return getattr(mod, block_name)(config)


@pytest.mark.parametrize("model", ["deepseek_v3", "deepseek_v3_groups", "glm_moe_dsa"])
@torch.no_grad()
def test_parity_deepseek_v3_style(model):
    groups = model == "deepseek_v3_groups"
    path, cfg, blk = {
        "deepseek_v3": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3Config", "DeepseekV3MoE"),
        "deepseek_v3_groups": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3Config", "DeepseekV3MoE"),
        "glm_moe_dsa": ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaConfig", "GlmMoeDsaMoE"),
    }[model]
    hf = _hf_deepseek_v3_style(path, cfg, blk, 4 if groups else 1, 2 if groups else 1)
    moe = _moe(
        shared_expert_dim=I, route_scale=2.5,
        **({"num_expert_groups": 4, "num_limited_groups": 2} if groups else {}),
    )
    hf.gate.weight.copy_(moe.router.gate.weight)
    hf.gate.e_score_correction_bias.copy_(moe.expert_bias)
    _load_experts(moe, hf.experts)
    _load_shared(moe, hf.shared_experts)
    x = torch.randn(3, 7, H)
    torch.testing.assert_close(moe(x), hf(x), rtol=0, atol=1e-5)


@torch.no_grad()
def test_parity_qwen3_5_moe():
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    hf = Qwen3_5MoeSparseMoeBlock(
        Qwen3_5MoeTextConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                             shared_expert_intermediate_size=24)
    )
    moe = _moe(score_func="softmax", use_expert_bias=False, load_balance_coeff=None, aux_loss_coef=1e-3,
               shared_expert_gate=True)
    hf.gate.weight.copy_(moe.router.gate.weight)
    _load_experts(moe, hf.experts)
    _load_shared(moe, hf.shared_expert)
    hf.shared_expert_gate.weight.copy_(moe.shared_expert.output_gate.weight)
    x = torch.randn(3, 7, H)
    torch.testing.assert_close(moe(x), hf(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("layer", [0, 3], ids=["hash_layer", "topk_layer"])
@torch.no_grad()
def test_parity_deepseek_v4(layer):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Config, DeepseekV4SparseMoeBlock

    vocab = 50
    hf = DeepseekV4SparseMoeBlock(
        DeepseekV4Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                         vocab_size=vocab, num_hidden_layers=4, routed_scaling_factor=2.5, swiglu_limit=1.0),
        layer,
    )
    moe = _moe(score_func="sqrtsoftplus", route_scale=2.5, swiglu_limit=1.0, shared_expert_swiglu_limit=1.0,
               shared_expert_dim=I, hash_routing=layer == 0, hash_vocab_size=vocab)
    hf.gate.weight.copy_(moe.router.gate.weight)
    if layer == 0:
        hf.gate.tid2eid.copy_(moe.router.hash_table)
    else:
        hf.gate.e_score_correction_bias.copy_(moe.expert_bias)
    _load_experts(moe, hf.experts)
    _load_shared(moe, hf.shared_experts)
    x = torch.randn(3, 7, H)
    token_ids = torch.randint(vocab, (3, 7))
    gate_pre = F.linear(x, moe.experts.w_gate[0])
    assert (gate_pre > 1.0).any(), "the clamp must be exercised"
    torch.testing.assert_close(moe(x, token_ids), hf(x, token_ids), rtol=0, atol=1e-5)
