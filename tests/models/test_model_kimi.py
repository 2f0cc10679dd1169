"""Kimi K2.7 Code against transformers' DeepseekV3 classes (test-only reference):
logits parity through the HF checkpoint format, exact round trip, flavors.

Where transformers' defaults and the published Kimi config disagree, the test
config follows the published one: untied embeddings (Kimi_K25Config defaults
``tie_word_embeddings=True``), ``n_group = topk_group = 1`` (DeepseekV3Config
defaults 8/4), YaRN factor 64 with beta 32/1 and mscale 1/1.
"""

import torch
import pytest
from safetensors.torch import load_file, save_file

from titan_mok.models.common.params import count_params
from titan_mok.models.common.rope import YaRN
from titan_mok.models.kimi_k2_7_code import (
    KimiK27CodeArgs, KimiK27CodeModel, KimiK27CodeStateDictAdapter, kimi_k2_7_code_configs,
)
from titan_mok.moe import MoEArgs

from tests.models.test_model_kimi_glm_hf import randomize_, relative_error, save_and_load_hf

transformers = pytest.importorskip("transformers")

# the published YaRN; original_seq_len scaled down so a short test sequence spans both ramp ends
TEST_YARN = YaRN(factor=64, original_seq_len=64, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)


def tiny_args() -> KimiK27CodeArgs:
    return KimiK27CodeArgs(
        vocab_size=96, dim=64, n_layers=3, n_dense_layers=1, dense_inter_dim=96, norm_eps=1e-5,
        n_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
        rope_theta=50000.0, rope_interleaved=True, yarn=TEST_YARN, max_seq_len=32,
        moe_args=MoEArgs(num_experts=8, top_k=3, expert_dim=32, score_func="sigmoid", route_norm=True,
                         route_scale=2.827, use_expert_bias=True, shared_expert_dim=32),
    )


def hf_config(a: KimiK27CodeArgs):
    y = a.yarn
    return transformers.DeepseekV3Config(
        vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.dense_inter_dim,
        moe_intermediate_size=a.moe_args.expert_dim, num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads, num_key_value_heads=a.n_heads, n_shared_experts=1,
        n_routed_experts=a.moe_args.num_experts, num_experts_per_tok=a.moe_args.top_k,
        routed_scaling_factor=a.moe_args.route_scale, kv_lora_rank=a.kv_lora_rank, q_lora_rank=a.q_lora_rank,
        qk_rope_head_dim=a.qk_rope_head_dim, qk_nope_head_dim=a.qk_nope_head_dim, v_head_dim=a.v_head_dim,
        n_group=1, topk_group=1, norm_topk_prob=True, rms_norm_eps=a.norm_eps,
        first_k_dense_replace=a.n_dense_layers, rope_interleave=True, max_position_embeddings=a.max_seq_len,
        rope_parameters={"rope_type": "yarn", "rope_theta": a.rope_theta, "factor": y.factor,
                         "original_max_position_embeddings": y.original_seq_len, "beta_fast": y.beta_fast,
                         "beta_slow": y.beta_slow, "mscale": y.mscale, "mscale_all_dim": y.mscale_all_dim},
        tie_word_embeddings=False, num_mtp_layers=0,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    a = tiny_args()
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(hf_config(a)).float().eval()
    hf.config._attn_implementation = "eager"
    randomize_(hf, 0)
    return a, hf, save_and_load_hf(hf, tmp_path_factory.mktemp("kimi_hf"))


def test_logits_match_transformers(checkpoint):
    a, hf, hf_sd = checkpoint
    assert "model.layers.2.mlp.experts.7.gate_proj.weight" in hf_sd  # per-expert HF layout
    ours = KimiK27CodeModel(a)
    ours.init_weights(torch.device("cpu"))
    ours.load_state_dict(KimiK27CodeStateDictAdapter(a, None).from_hf(hf_sd), strict=True)
    tokens = torch.randint(0, a.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        rel = relative_error(ours.eval()(tokens), hf(input_ids=tokens).logits)
    assert rel < 1e-5, f"relative logits error {rel:.2e}"


def test_state_dict_round_trip_is_exact(checkpoint, tmp_path):
    a, _, hf_sd = checkpoint
    adapter = KimiK27CodeStateDictAdapter(a, None)
    ours = adapter.from_hf(hf_sd)
    model = KimiK27CodeModel(a)
    assert set(ours) == set(model.state_dict())
    save_file(adapter.to_hf(ours), tmp_path / "out.safetensors")
    back = load_file(tmp_path / "out.safetensors")
    assert set(back) == set(hf_sd) and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


def test_flavors_are_faithful():
    full, h200 = kimi_k2_7_code_configs["full"], kimi_k2_7_code_configs["h200"]
    assert (full.n_layers, full.n_dense_layers, full.moe_args.num_experts, full.moe_args.top_k) == (61, 1, 384, 8)
    assert (full.moe_args.route_scale, full.moe_args.shared_expert_dim, full.rope_theta) == (2.827, 2048, 50000.0)
    assert full.yarn == YaRN(factor=64, original_seq_len=4096, beta_fast=32, beta_slow=1, mscale=1, mscale_all_dim=1)
    for key in ("dim", "dense_inter_dim", "n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "vocab_size", "yarn"):
        assert getattr(h200, key) == getattr(full, key), key
    assert (h200.moe_args.expert_dim, h200.moe_args.top_k, h200.moe_args.shared_expert_dim) == (2048, 8, 2048)
    with torch.device("meta"):
        counts = count_params(KimiK27CodeModel(full))
    assert 1.02e12 < counts.total < 1.06e12, counts  # Kimi K2: 1.04 T total
    assert 31.5e9 < counts.active < 33.5e9, counts  # 32 B activated
