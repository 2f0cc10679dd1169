"""DeepSeek-V4-Pro: logits parity with transformers' deepseek_v4 on one safetensors
checkpoint in the official layout (written through our StateDictAdapter, read by
transformers' own key conversion and by ours), adapter round trip, Sinkhorn,
MTP, flavors. CPU, fp32."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from titan_mok.attached_loss import take_tally
from titan_mok.models.deepseek_v4_pro import DeepSeekV4Model, DeepSeekV4ModelArgs, DeepSeekV4StateDictAdapter
from titan_mok.models.deepseek_v4_pro import deepseek_v4_pro_configs as configs
from titan_mok.models.deepseek_v4_pro.hyper_connections import HyperConnection

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4ForCausalLM  # noqa: E402

VOCAB, SEQ = 80, 40


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _our_args() -> DeepSeekV4ModelArgs:
    """HCA, HCA, CSA, sliding-only; hash, hash, hash, learned router; windows and
    ratios small enough that every branch is active at SEQ tokens."""
    return replace(
        configs["debug"], vocab_size=VOCAB, sliding_window=8, compress_ratios=(8, 8, 4, 0), hca_ratio=8, index_topk=3, max_seq_len=64
    )


def _hf_config(args: DeepSeekV4ModelArgs) -> DeepseekV4Config:
    kinds = {0: "sliding_attention", args.csa_ratio: "compressed_sparse_attention", args.hca_ratio: "heavily_compressed_attention"}
    moe = args.moe_args
    return DeepseekV4Config(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        moe_intermediate_size=moe.expert_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        head_dim=args.head_dim,
        q_lora_rank=args.q_lora_rank,
        num_experts_per_tok=moe.top_k,
        n_routed_experts=moe.num_experts,
        routed_scaling_factor=moe.route_scale,
        layer_types=[kinds[r] for r in args.compress_ratios],
        compress_rates={"compressed_sparse_attention": args.csa_ratio, "heavily_compressed_attention": args.hca_ratio},
        sliding_window=args.sliding_window,
        o_groups=args.o_groups,
        o_lora_rank=args.o_lora_rank,
        index_n_heads=args.index_n_heads,
        index_head_dim=args.index_head_dim,
        index_topk=args.index_topk,
        partial_rotary_factor=args.rope_head_dim / args.head_dim,
        rope_theta=args.rope_theta,
        compress_rope_theta=args.compress_rope_theta,
        rope_scaling={
            "type": "yarn",
            "factor": args.rope_factor,
            "original_max_position_embeddings": args.original_seq_len,
            "beta_fast": args.beta_fast,
            "beta_slow": args.beta_slow,
        },
        max_position_embeddings=int(args.original_seq_len * args.rope_factor),
        swiglu_limit=moe.swiglu_limit,
        rms_norm_eps=args.norm_eps,
        hc_mult=args.hc_mult,
        hc_sinkhorn_iters=args.hc_sinkhorn_iters,
        hc_eps=args.hc_eps,
    )


def _random_model(args: DeepSeekV4ModelArgs) -> DeepSeekV4Model:
    torch.manual_seed(0)
    model = DeepSeekV4Model(args).eval()
    model.init_weights()
    with torch.no_grad():  # perturb everything: zero/one inits would hide layout mistakes
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))
            elif name.endswith("hash_table"):
                buf.copy_(torch.stack([torch.randperm(args.moe_args.num_experts)[: args.moe_args.top_k] for _ in range(len(buf))]))
    return model


def test_logits_match_transformers_through_adapter(tmp_path):
    args = _our_args()
    adapter = DeepSeekV4StateDictAdapter(args, None)
    source = _random_model(args)
    ckpt = adapter.to_hf(source.state_dict())
    assert "layers.0.ffn.gate.tid2eid" in ckpt and "layers.0.ffn.gate.bias" not in ckpt
    assert "layers.3.ffn.gate.bias" in ckpt and "layers.2.attn.indexer.compressor.ape" in ckpt
    (tmp_path / "ckpt").mkdir()
    save_file({k: v.contiguous() for k, v in ckpt.items()}, tmp_path / "ckpt" / "model.safetensors")
    _hf_config(args).save_pretrained(tmp_path / "ckpt")

    loaded = load_file(tmp_path / "ckpt" / "model.safetensors")
    ours = DeepSeekV4Model(args).eval()
    missing, unexpected = ours.load_state_dict(adapter.from_hf(loaded), strict=False)
    assert unexpected == []
    assert all(k.endswith("moe.tokens_per_expert") or k.startswith(("layers.0.", "layers.1.", "layers.2.")) and k.endswith("expert_bias") for k in missing), missing
    back = adapter.to_hf(ours.state_dict())
    assert back.keys() == loaded.keys()
    assert all(torch.equal(back[k], loaded[k]) for k in loaded)

    hf, info = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "ckpt", output_loading_info=True, torch_dtype=torch.float32)
    assert info["missing_keys"] == set() or not info["missing_keys"], info["missing_keys"]
    assert not [k for k in info["unexpected_keys"] if not k.startswith("mtp.")], info["unexpected_keys"]

    # SEQ: every branch active; 3 tokens: shorter than every window and ratio (no compressed entries)
    for seq_len in (SEQ, 3):
        tokens = torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = hf.eval()(tokens).logits
            got = ours(tokens)
        assert rel_err(got, expected) < 1e-5, seq_len


def test_sinkhorn_makes_comb_doubly_stochastic():
    torch.manual_seed(0)
    hc = HyperConnection(dim=8, hc_mult=4, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
    hc.init_weights()
    _, post, comb = hc(torch.randn(2, 3, 4, 8))
    assert torch.allclose(comb.sum(-1), torch.ones(2, 3, 4), atol=1e-4)
    assert torch.allclose(comb.sum(-2), torch.ones(2, 3, 4), atol=1e-4)
    assert (post > 0).all() and (post < 2).all()


def test_mtp_module_runs_on_trunk_streams():
    model = _random_model(_our_args())
    tokens = torch.randint(0, VOCAB, (2, 12))
    streams = model.trunk(tokens)
    logits = model.mtp_logits(streams[:, :-1], tokens[:, 1:])
    assert logits.shape == (2, 11, VOCAB) and torch.isfinite(logits).all()


def test_mtp_trains_through_main_loss():
    """mtp_loss_coef > 0: the main logits are unchanged, the attached "mtp" loss is the
    cross-entropy of ``mtp_logits`` (streams at t, token t+1) on token t+2, and MTP module 0
    gets gradients; at 0 it is not run."""
    model = _random_model(replace(_our_args(), mtp_loss_coef=0.5))
    tokens = torch.randint(0, VOCAB, (2, 12))
    take_tally()
    logits = model(tokens)
    mtp_total, mtp_count = take_tally()["mtp"]
    with torch.no_grad():
        assert torch.equal(logits, model(tokens))
        mtp_logits = model.mtp_logits(model.trunk(tokens)[:, :-1], tokens[:, 1:])[:, :-1]
        expected = F.cross_entropy(mtp_logits.flatten(0, 1).float(), tokens[:, 2:].flatten())
    assert mtp_count == 1 and torch.allclose(mtp_total.float(), expected, rtol=1e-6)
    logits.float().logsumexp(-1).mean().backward()
    e_proj = model.mtp["0"].e_proj.weight
    assert e_proj.grad is not None and e_proj.grad.abs().sum() > 0
    frozen = _random_model(replace(_our_args(), mtp_loss_coef=0.0))
    frozen(tokens).float().sum().backward()
    assert frozen.mtp["0"].e_proj.weight.grad is None
    with pytest.raises(ValueError, match="mtp_loss_coef"):
        replace(_our_args(), n_mtp_layers=2, mtp_loss_coef=0.3)


def test_flavors():
    full = configs["full"]
    assert full.compress_ratios[:4] == (128, 128, 4, 128) and full.compress_ratios[-1] == 4
    assert len(full.compress_ratios) == 61
    h200 = configs["h200"]
    assert (h200.dim, h200.moe_args.expert_dim, h200.moe_args.top_k, h200.n_heads) == (7168, 3072, 6, 128)
    with pytest.raises(ValueError, match="compress_ratios"):
        DeepSeekV4ModelArgs(n_layers=3)


def test_full_flavor_sizes_on_meta():
    """Published: 1.6 T total (DeepSeek counts the MTP module, as for V3's 671 B),
    49 B active. Ours: 1598.8 B total (25.8 B of it MTP), 49.8 B active per token
    (embedding and head included, MTP excluded)."""
    args = configs["full"]
    with torch.device("meta"):
        model = DeepSeekV4Model(args)
    total, active = args.get_nparams(model)
    mtp = sum(p.numel() for p in model.mtp.parameters())
    assert 1.59e12 < total < 1.61e12, total
    assert 25e9 < mtp < 26e9, mtp
    assert 49e9 < active < 50.5e9, active


def test_adapter_round_trips_sharded_experts(one_rank_gloo):
    """EP/FSDP-sharded routed experts (DTensor Shard(0), here on a 1-rank gloo mesh)
    split into this rank's per-expert tensors and stack back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    args = _our_args()
    adapter = DeepSeekV4StateDictAdapter(args, None)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    plain = _random_model(args).state_dict()
    sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) if ".moe.experts." in k else v for k, v in plain.items()}
    hf = adapter.to_hf(sharded)
    assert isinstance(hf["layers.3.ffn.experts.0.w1.weight"], torch.Tensor)
    back = adapter.from_hf(hf)
    stacked = back["layers.3.moe.experts.w_gate"]
    assert isinstance(stacked, DTensor) and torch.equal(stacked.full_tensor(), plain["layers.3.moe.experts.w_gate"])


def test_causal_and_bf16():
    """Changing tokens from position t on leaves the logits before t unchanged
    (window, compressed entries and indexer are causal); the model also runs
    forward and backward in bf16 (as under FSDP mixed precision), close to fp32."""
    model = _random_model(_our_args())
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    edited = tokens.clone()
    edited[:, 21:] = (edited[:, 21:] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(tokens), model(edited)
    assert torch.equal(a[:, :21], b[:, :21])
    assert not torch.equal(a[:, 21:], b[:, 21:])

    model_bf16 = _random_model(_our_args()).to(torch.bfloat16)
    logits = model_bf16(tokens)
    logits.float().square().mean().backward()
    assert logits.dtype == torch.bfloat16 and rel_err(logits.float(), a) < 5e-2
    assert all(torch.isfinite(p.grad).all() for p in model_bf16.parameters() if p.grad is not None)
