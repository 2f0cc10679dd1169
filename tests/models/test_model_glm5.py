"""GLM-5.2 against transformers' GlmMoeDsa (test-only reference): logits parity
through the HF checkpoint format, exact state-dict round trips, MTP, the
indexer's KL loss, flavors.

transformers' GlmMoeDsaConfig defaults to an indexer on every layer; the test
configs pass the IndexShare schedule explicitly (``indexer_types``)."""


import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_mok.attached_loss import without_losses
from titan_mok.models.common.mla import keep_mask
from titan_mok.models.common.params import count_params
from titan_mok.models.glm_5_2 import GLM52Args, GLM52Model, GLM52StateDictAdapter, glm_5_2_configs
from titan_mok.models.glm_5_2.dsa import indexer_kl_loss
from titan_mok.moe import MoEArgs

from tests.models.test_model_kimi_glm_hf import randomize_, relative_error, save_and_load_hf

transformers = pytest.importorskip("transformers")

# GLM-5.2's published `indexer_full_layers` (official config.json; shared/reference/model_shapes.json).
PUBLISHED_INDEXER_LAYERS = [0, 1, 2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62, 66, 70, 74]


def tiny_args(**overrides) -> GLM52Args:
    fields = dict(
        vocab_size=96, dim=64, n_layers=5, n_dense_layers=1, dense_inter_dim=96, norm_eps=1e-5,
        n_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=20,
        rope_theta=10000.0, rope_interleaved=True, max_seq_len=32,
        index_n_heads=4, index_head_dim=16, index_topk=6, index_topk_freq=2, index_skip_topk_offset=1,
        n_mtp_layers=0,
        moe_args=MoEArgs(num_experts=8, top_k=3, expert_dim=32, score_func="sigmoid", route_norm=True,
                         route_scale=2.5, use_expert_bias=True, shared_expert_dim=32),
    )
    fields.update(overrides)
    return GLM52Args(**fields)


def hf_config(a: GLM52Args):
    return transformers.GlmMoeDsaConfig(
        vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.dense_inter_dim,
        moe_intermediate_size=a.moe_args.expert_dim, num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads, num_key_value_heads=a.n_heads, n_shared_experts=1,
        n_routed_experts=a.moe_args.num_experts, num_experts_per_tok=a.moe_args.top_k,
        routed_scaling_factor=a.moe_args.route_scale, kv_lora_rank=a.kv_lora_rank, q_lora_rank=a.q_lora_rank,
        qk_rope_head_dim=a.qk_rope_head_dim, qk_nope_head_dim=a.qk_nope_head_dim, v_head_dim=a.v_head_dim,
        n_group=1, topk_group=1, norm_topk_prob=True, rms_norm_eps=a.norm_eps, first_k_dense_replace=a.n_dense_layers,
        rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta}, max_position_embeddings=a.max_seq_len,
        index_topk=a.index_topk, index_head_dim=a.index_head_dim, index_n_heads=a.index_n_heads,
        indexer_types=["full" if a.runs_indexer(i) else "shared" for i in range(a.n_layers)],
        tie_word_embeddings=False,
    )


def hf_checkpoint(a: GLM52Args, tmp_path, seed: int = 0):
    torch.manual_seed(seed)
    hf = transformers.GlmMoeDsaForCausalLM(hf_config(a)).float().eval()
    hf.config._attn_implementation = "eager"
    randomize_(hf, seed)
    return hf, save_and_load_hf(hf, tmp_path)


def load_ours(a: GLM52Args, hf_sd) -> GLM52Model:
    model = GLM52Model(a)
    model.init_weights(torch.device("cpu"))
    model.load_state_dict(GLM52StateDictAdapter(a, None).from_hf(hf_sd), strict=True)
    return model.eval()


@pytest.mark.parametrize("seq_len", [5, 24], ids=["dense(S<=topk)", "sparse(S>topk)"])
def test_logits_match_transformers(tmp_path, seq_len):
    a = tiny_args()
    hf, hf_sd = hf_checkpoint(a, tmp_path)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in hf_sd  # per-expert HF layout
    ours = load_ours(a, hf_sd)
    tokens = torch.randint(0, a.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=tokens).logits
        got = ours(tokens)
    rel = relative_error(got, ref)
    assert rel < 1e-5, f"relative logits error {rel:.2e}"


def test_state_dict_round_trip_is_exact(tmp_path):
    a = tiny_args(n_mtp_layers=1)
    _, hf_sd = hf_checkpoint(tiny_args(), tmp_path)
    # the MTP block (HF model.layers.{n_layers}.*) with its copies of embedding and head
    model = GLM52Model(a)
    model.init_weights(torch.device("cpu"))
    mtp = f"model.layers.{a.n_layers}."
    mtp_hf = {k: v for k, v in GLM52StateDictAdapter(a, None).to_hf(model.state_dict()).items() if k.startswith(mtp)}
    assert {mtp + n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                              "self_attn.indexer.wk.weight", "mlp.experts.0.gate_proj.weight")} <= set(mtp_hf)
    hf_sd.update(mtp_hf)
    copies = {mtp + "embed_tokens.weight": hf_sd["model.embed_tokens.weight"], mtp + "shared_head.head.weight": hf_sd["lm_head.weight"]}
    adapter = GLM52StateDictAdapter(a, None)
    ours = adapter.from_hf({**hf_sd, **copies})
    assert set(ours) == set(model.state_dict())
    save_file(adapter.to_hf(ours), tmp_path / "out.safetensors")
    back = load_file(tmp_path / "out.safetensors")
    assert set(back) == set(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


def test_adapter_rejects_unknown_and_incomplete(tmp_path):
    a = tiny_args()
    _, hf_sd = hf_checkpoint(a, tmp_path)
    adapter = GLM52StateDictAdapter(a, None)
    with pytest.raises(KeyError, match="model.layers.0.self_attn.bogus"):
        adapter.from_hf({**hf_sd, "model.layers.0.self_attn.bogus": torch.zeros(1)})
    del hf_sd["model.layers.2.mlp.experts.3.up_proj.weight"]
    with pytest.raises(KeyError, match="incomplete routed experts"):
        adapter.from_hf(hf_sd)


def test_mtp_trains_through_main_loss():
    a = tiny_args(n_mtp_layers=1, mtp_loss_coef=0.5)
    model = GLM52Model(a)
    model.init_weights(torch.device("cpu"))
    tokens = torch.randint(0, a.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    logits = model(tokens)
    with torch.no_grad():
        assert torch.equal(logits, model(tokens))  # the MTP head does not change the main logits
    logits.float().logsumexp(-1).mean().backward()
    mtp = model.layers[str(a.n_layers)]
    assert mtp.eh_proj.weight.grad is not None and mtp.eh_proj.weight.grad.abs().sum() > 0
    # switched off (the RL trainer), the block is not run
    model.zero_grad(set_to_none=True)
    with without_losses("mtp"):
        model(tokens).float().sum().backward()
    assert mtp.eh_proj.weight.grad is None
    # with coefficient 0 the block is loadable but not run
    frozen = GLM52Model(tiny_args(n_mtp_layers=1, mtp_loss_coef=0.0))
    frozen.init_weights(torch.device("cpu"))
    frozen(tokens).float().sum().backward()
    assert frozen.layers[str(a.n_layers)].eh_proj.weight.grad is None


def test_indexshare_schedule_matches_published_config():
    assert glm_5_2_configs["full"].indexer_layers == PUBLISHED_INDEXER_LAYERS


def test_flavors_are_faithful():
    full, h200 = glm_5_2_configs["full"], glm_5_2_configs["h200"]
    assert (full.n_layers, full.n_dense_layers, full.moe_args.num_experts, full.moe_args.top_k) == (78, 3, 256, 8)
    assert (full.qk_head_dim, full.v_head_dim, full.n_mtp_layers) == (256, 256, 1)
    for key in ("dim", "dense_inter_dim", "n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "vocab_size"):
        assert getattr(h200, key) == getattr(full, key), key
    assert (h200.moe_args.expert_dim, h200.moe_args.top_k) == (2048, 8)
    with torch.device("meta"):
        model = GLM52Model(full)
    main = count_params(model).total - count_params(model.layers[str(full.n_layers)]).total
    # GLM-5's published 744 B has an indexer on every one of the 78 layers (DeepSeek-V3.2
    # style); IndexShare (GLM-5.2) keeps 21 of them. The MTP block is not counted.
    indexer = count_params(model.layers["0"].attention.indexer).total
    dropped = full.n_layers - len(full.indexer_layers)
    assert 743.5e9 < main + dropped * indexer < 744.5e9, (main, indexer)


def hf_rmsnorm(weight: torch.Tensor, eps: float):
    norm = transformers.models.glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaRMSNorm(weight.shape[0], eps)
    norm.weight.data.copy_(weight)
    return norm


def test_mtp_block_matches_transformers_layers(tmp_path):
    """The MTP block = HF's GlmMoeDsa decoder layer inside transformers' MtpLayer formula
    (``eh_proj(cat(enorm(emb_{i+1}), hnorm(h_i)))`` → layer → ``shared_head.norm``),
    loaded from HF names ``model.layers.{n_layers}.*``."""
    a = tiny_args(n_layers=3, n_mtp_layers=1)
    # HF model with one more layer: its last layer (sparse, own indexer) plays the MTP block's decoder layer
    cfg = hf_config(tiny_args(n_layers=4))
    cfg.indexer_types[3] = "full"
    torch.manual_seed(0)
    hf = transformers.GlmMoeDsaForCausalLM(cfg).float().eval()
    hf.config._attn_implementation = "eager"
    randomize_(hf, 3)
    hf_sd = save_and_load_hf(hf, tmp_path)
    g = torch.Generator().manual_seed(4)
    dim = a.dim
    mtp_extra = {"enorm.weight": 1 + 0.2 * torch.randn(dim, generator=g), "hnorm.weight": 1 + 0.2 * torch.randn(dim, generator=g),
                 "eh_proj.weight": torch.randn(dim, 2 * dim, generator=g) / (2 * dim) ** 0.5,
                 "shared_head.norm.weight": 1 + 0.2 * torch.randn(dim, generator=g)}
    hf_sd.update({f"model.layers.3.{k}": v for k, v in mtp_extra.items()})
    ours = load_ours(a, hf_sd)

    seq = 16  # > index_topk: the MTP block's own indexer selects keys
    tokens = torch.randint(0, a.vocab_size, (2, seq), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = hf.model(input_ids=tokens, output_hidden_states=True)
        h_ref = hf.model.norm(out.hidden_states[3])  # after the 3 main layers
        emb = hf.model.embed_tokens(tokens)
        enorm, hnorm, post = (hf_rmsnorm(mtp_extra[k], a.norm_eps) for k in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"))
        x = torch.cat([enorm(emb[:, 1:]), hnorm(h_ref[:, :-1])], dim=-1) @ mtp_extra["eh_proj.weight"].T
        pos = torch.arange(seq - 1)[None]
        mask = torch.full((seq - 1, seq - 1), torch.finfo(torch.float32).min).triu(1)[None, None]
        x, _ = hf.model.layers[3](x, attention_mask=mask, position_ids=pos,
                                  position_embeddings=hf.model.rotary_emb(x, pos))
        ref = hf.lm_head(post(x))

        h_ours = ours.norm(ours.decode(ours.tok_embeddings(tokens)))
        got = ours.output(ours.layers["3"](ours.tok_embeddings(tokens)[:, 1:], h_ours[:, :-1], ours.rope_cache))
    rel = relative_error(got, ref)
    assert rel < 1e-5, f"relative MTP logits error {rel:.2e}"


def test_indexer_kl_loss_is_zero_at_the_attention_distribution():
    g = torch.Generator().manual_seed(6)
    bsz, heads, seq, dim, topk = 2, 5, 12, 8, 4
    q, k = torch.randn(bsz, heads, seq, dim, generator=g), torch.randn(bsz, heads, seq, dim, generator=g)
    index = torch.randn(bsz, seq, seq, generator=g).masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    topk_idx = index.topk(topk, dim=-1).indices
    keep = keep_mask(topk_idx)
    p = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~keep[:, None], float("-inf")).softmax(-1).mean(1)
    at_p = p.log().masked_fill(~keep, float("-inf"))
    for chunk in (1, 2, 8):
        assert indexer_kl_loss(q, k, 0.3, at_p, topk_idx, heads_per_chunk=chunk).abs() < 1e-6
    assert indexer_kl_loss(q, k, 0.3, index, topk_idx) > 1e-2


def test_indexer_loss_trains_only_the_indexer():
    grads = {}
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(7))  # S > index_topk
    for coef in (0.0, 1.0):
        torch.manual_seed(0)
        model = GLM52Model(tiny_args(index_loss_coef=coef))
        model.init_weights(torch.device("cpu"))
        model(tokens).float().logsumexp(-1).mean().backward()
        grads[coef] = {n: p.grad for n, p in model.named_parameters()}
    indexer = [n for n in grads[1.0] if ".indexer." in n]
    assert indexer and all(grads[0.0][n] is None and grads[1.0][n].abs().sum() > 0 for n in indexer)
    assert all(torch.equal(grads[0.0][n], grads[1.0][n]) for n in grads[0.0] if n not in indexer)
