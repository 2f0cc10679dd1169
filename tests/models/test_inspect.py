"""titan_mok.inspect: counts on the meta device, checked against closed-form
parameter formulas; JSON keys; errors that list the valid choices."""

import json

import pytest
import torch

from titan_mok import registry
from titan_mok.inspect import inspect_model, main
from titan_mok.models.common.params import count_params
from titan_mok.models.kimi_k2_7_code import KimiK27CodeModel, kimi_k2_7_code_configs


def kimi_closed_form(a, seq_len: int) -> tuple[int, int, int]:
    """(total, active, training FLOPs/token) of a Kimi flavor, from its dims alone."""
    h, n, m = a.dim, a.n_heads, a.moe_args
    attention = (h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * n * a.qk_head_dim
                 + h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
                 + a.kv_lora_rank * n * (a.qk_nope_head_dim + a.v_head_dim) + n * a.v_head_dim * h)
    dense_block = attention + 2 * h + 3 * h * a.dense_inter_dim
    moe_block_shared = attention + 2 * h + m.num_experts * h + 3 * m.shared_expert_dim * h
    routed = 3 * m.expert_dim * h
    n_moe = a.n_layers - a.n_dense_layers
    outer = 2 * a.vocab_size * h + h
    total = outer + a.n_dense_layers * dense_block + n_moe * (moe_block_shared + m.num_experts * routed)
    active = outer + a.n_dense_layers * dense_block + n_moe * (moe_block_shared + m.top_k * routed)
    flops = 6 * (active - a.vocab_size * h) + 6 * a.n_layers * n * (a.qk_head_dim + a.v_head_dim) * seq_len
    return total, active, flops


@pytest.mark.parametrize("flavor", ["debug", "one_gpu", "h200", "full"])
def test_kimi_counts_match_closed_form(flavor):
    report = inspect_model("kimi_k2_7_code", flavor, seq_len=4096)
    expected = kimi_closed_form(kimi_k2_7_code_configs[flavor], 4096)
    assert (report["total_params"], report["active_params"], report["flops_per_token"]) == expected
    assert sum(layer["total_params"] for layer in report["layers"]) + report["non_layer_params"] == expected[0]


def test_meta_counts_equal_a_materialised_model():
    report = inspect_model("glm_5_2", "debug", seq_len=64)
    model = registry.model_module("glm_5_2").get_train_spec().model_cls(registry.flavors("glm_5_2")["debug"])
    assert report["total_params"] == sum(p.numel() for p in model.parameters())
    assert report["active_params"] == count_params(model).active < report["total_params"]
    assert [layer["layer"] for layer in report["layers"]] == [str(i) for i in range(5)]  # 4 + the MTP block
    assert report["layers"][-1]["kind"] == "MTPBlock (MoE)"


def test_json_output(capsys):
    main(["--model", "kimi_k2_7_code", "--flavor", "debug", "--json"])
    report = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        total = count_params(KimiK27CodeModel(kimi_k2_7_code_configs["debug"])).total
    assert report["total_params"] == total
    assert {"total_params", "active_params", "flops_per_token"} <= set(report)


def test_unknown_model_or_flavor_lists_the_valid_ones(capsys):
    with pytest.raises(SystemExit, match="glm_5_2"):
        main(["--model", "gpt5", "--flavor", "full"])
    with pytest.raises(SystemExit, match=r"\['debug', 'one_gpu', 'h200', 'full'\]"):
        main(["--model", "glm_5_2", "--flavor", "huge"])


def glm_closed_form(a, seq_len: int) -> tuple[int, int]:
    """(total, training FLOPs/token) of a GLM flavor with its MTP block and indexer trained."""
    h, n, m, e = a.dim, a.n_heads, a.moe_args, a.qk_head_dim
    attention = (h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * n * e + h * (a.kv_lora_rank + a.qk_rope_head_dim)
                 + a.kv_lora_rank + a.kv_lora_rank * n * (a.qk_nope_head_dim + a.v_head_dim) + n * a.v_head_dim * h)
    indexer = a.q_lora_rank * a.index_n_heads * a.index_head_dim + h * a.index_head_dim + 2 * a.index_head_dim + h * a.index_n_heads
    moe_shared = m.num_experts * h + 3 * m.shared_expert_dim * h
    routed = 3 * m.expert_dim * h
    n_moe, n_index = a.n_layers - a.n_dense_layers, len(a.indexer_layers) + 1  # + the MTP block's
    mtp_extra = 2 * h + 2 * h * h + h
    blocks = a.n_layers * (attention + 2 * h) + a.n_dense_layers * 3 * h * a.dense_inter_dim
    total = (2 * a.vocab_size * h + h + blocks + n_index * indexer + n_moe * (moe_shared + m.num_experts * routed)
             + attention + 2 * h + moe_shared + m.num_experts * routed + mtp_extra)
    active_matmul = (h + blocks + n_moe * (moe_shared + m.top_k * routed) + attention + 2 * h + moe_shared
                     + m.top_k * routed + mtp_extra + 2 * a.vocab_size * h)  # the head runs twice
    keys = min(seq_len, a.index_topk)
    flops = 6 * active_matmul + 6 * (a.n_layers + 1) * n * (e + a.v_head_dim) * keys
    if seq_len > a.index_topk:  # indexers: forward + weight grads, scores ×3, KL target forward
        flops += 4 * n_index * indexer + 6 * n_index * a.index_n_heads * (a.index_head_dim + 1) * seq_len
        flops += 2 * n_index * n * e * seq_len
    return total, flops


@pytest.mark.parametrize("seq_len", [1024, 4096], ids=["S<=topk", "S>topk"])
def test_glm_counts_match_closed_form(seq_len):
    a = registry.flavors("glm_5_2")["h200"]
    assert a.mtp_loss_coef > 0 and a.index_loss_coef > 0
    report = inspect_model("glm_5_2", "h200", seq_len=seq_len)
    assert (report["total_params"], report["flops_per_token"]) == glm_closed_form(a, seq_len)
