"""Qwen3.5-397B-A17B: Gated DeltaNet chunked vs recurrent, logits parity with
transformers' qwen3_5_moe (weights through the StateDictAdapter and safetensors),
adapter round trip, flavors. CPU, fp32."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from titan_mok.models.qwen3_5_397b_a17b import Qwen35Model, Qwen35ModelArgs, Qwen35StateDictAdapter
from titan_mok.models.qwen3_5_397b_a17b import qwen3_5_397b_a17b_configs as configs
from titan_mok.models.qwen3_5_397b_a17b.gated_deltanet import (
    causal_depthwise_conv,
    chunk_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
)
from titan_mok.attached_loss import take_tally
from titan_mok.moe import MoEArgs

transformers = pytest.importorskip("transformers")
from transformers import Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM  # noqa: E402


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _deltanet_inputs(seq_len: int, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seq_len)
    shapes = dict(q=(2, seq_len, 2, 16), k=(2, seq_len, 2, 16), v=(2, seq_len, 4, 8))
    inputs = {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}
    inputs["g"] = -2 * torch.rand(2, seq_len, 4, generator=g)
    inputs["beta"] = torch.rand(2, seq_len, 4, generator=g)
    return {name: t.requires_grad_(requires_grad) for name, t in inputs.items()}


@pytest.mark.parametrize("seq_len,chunk_size", [(1, 4), (16, 4), (37, 8), (40, 64)], ids=["one", "exact", "ragged", "short"])
def test_chunked_deltanet_matches_recurrent(seq_len, chunk_size):
    ref_in = _deltanet_inputs(seq_len, requires_grad=True)
    tri_in = _deltanet_inputs(seq_len, requires_grad=True)
    ref = naive_recurrent_gated_delta_rule(*ref_in.values())
    tri = chunk_gated_delta_rule(*tri_in.values(), chunk_size=chunk_size)
    assert rel_err(tri, ref) < 1e-5, "o"
    grad_o = torch.randn_like(ref)
    ref.backward(grad_o)
    tri.backward(grad_o)
    for name in ref_in:
        assert rel_err(tri_in[name].grad, ref_in[name].grad) < 1e-4, f"d{name}"


def test_causal_depthwise_conv_matches_conv1d_and_continues_from_history():
    g = torch.Generator().manual_seed(3)
    x, weight = torch.randn(2, 11, 6, generator=g), torch.randn(6, 4, generator=g)
    ref = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), weight[:, None], groups=6).transpose(1, 2)
    out = causal_depthwise_conv(x, weight)
    torch.testing.assert_close(out, ref)
    # rows 7.. from the 3 rows before them: the same bits as in the full pass
    assert torch.equal(causal_depthwise_conv(x[:, 7:], weight, x[:, 4:7]), out[:, 7:])


TINY = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_experts=8,
    num_experts_per_tok=3,
    rms_norm_eps=1e-6,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
)


def _our_args() -> Qwen35ModelArgs:
    return Qwen35ModelArgs(
        vocab_size=96,
        dim=32,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        deltanet_chunk_size=8,
        max_seq_len=64,
        moe_args=MoEArgs(
            num_experts=8,
            top_k=3,
            expert_dim=16,
            score_func="softmax",
            route_norm=True,
            use_expert_bias=False,
            load_balance_coeff=None,
            aux_loss_coef=1e-3,
            shared_expert_dim=24,
            shared_expert_gate=True,
        ),
        n_mtp_layers=1,
    )


def _hf_checkpoint(tmp_path) -> dict:
    """A random tiny HF Qwen3.5 text model saved with save_pretrained, renamed to the
    published multimodal layout (``model.`` -> ``model.language_model.``), plus random
    ``mtp.*`` tensors (transformers has no MTP module)."""
    torch.manual_seed(0)
    hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TINY)).eval()
    with torch.no_grad():  # perturb every weight: zero/one inits would hide layout mistakes
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    ckpt = {("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v for k, v in saved.items()}
    layer3 = "model.language_model.layers.3."
    for key in [k for k in ckpt if k.startswith(layer3)]:
        ckpt["mtp.layers.0." + key[len(layer3) :]] = torch.randn_like(ckpt[key])
    ckpt["mtp.fc.weight"] = torch.randn(32, 64) * 0.1
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        ckpt[f"mtp.{name}.weight"] = torch.randn(32) * 0.1
    return hf, ckpt


def test_logits_match_transformers_through_adapter(tmp_path):
    hf, ckpt = _hf_checkpoint(tmp_path)
    save_file(ckpt, tmp_path / "published.safetensors")
    loaded = load_file(tmp_path / "published.safetensors")

    args = _our_args()
    adapter = Qwen35StateDictAdapter(args, None)
    ours = Qwen35Model(args).eval()
    missing, unexpected = ours.load_state_dict(adapter.from_hf(loaded), strict=False)
    assert unexpected == []
    assert all(k.endswith(("moe.expert_bias", "moe.tokens_per_expert")) for k in missing), missing

    # round trip: native -> HF reproduces the checkpoint exactly
    back = adapter.to_hf(ours.state_dict())
    assert back.keys() == loaded.keys()
    assert all(torch.equal(back[k], loaded[k]) for k in loaded)

    tokens = torch.randint(0, 96, (2, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert rel_err(got, expected) < 1e-5


def test_mtp_module_runs_on_trunk_states():
    torch.manual_seed(0)
    model = Qwen35Model(_our_args())
    model.init_weights()
    tokens = torch.randint(0, 96, (2, 12))
    h = model.trunk(tokens)
    logits = model.mtp_logits(h[:, :-1], tokens[:, 1:])
    assert logits.shape == (2, 11, 96) and torch.isfinite(logits).all()


def test_mtp_trains_through_main_loss():
    """mtp_loss_coef > 0: the main logits are unchanged, the attached "mtp" loss is the
    cross-entropy of ``mtp_logits`` (final-normed states at t, token t+1) on token t+2, and
    the MTP module gets gradients; at 0 it is not run."""
    torch.manual_seed(0)
    model = Qwen35Model(replace(_our_args(), mtp_loss_coef=0.5))
    model.init_weights()
    tokens = torch.randint(0, 96, (2, 12))
    take_tally()
    logits = model(tokens)
    mtp_total, mtp_count = take_tally()["mtp"]
    with torch.no_grad():
        assert torch.equal(logits, model(tokens))
        h = model.norm(model.trunk(tokens))
        mtp_logits = model.mtp_logits(h[:, :-1], tokens[:, 1:])[:, :-1]
        expected = F.cross_entropy(mtp_logits.flatten(0, 1).float(), tokens[:, 2:].flatten())
    assert mtp_count == 1 and torch.allclose(mtp_total.float(), expected, rtol=1e-6)
    logits.float().logsumexp(-1).mean().backward()
    assert model.mtp.fc.weight.grad is not None and model.mtp.fc.weight.grad.abs().sum() > 0
    frozen = Qwen35Model(_our_args())
    frozen.init_weights()
    frozen(tokens).float().sum().backward()
    assert frozen.mtp.fc.weight.grad is None
    with pytest.raises(ValueError, match="mtp_loss_coef"):
        replace(_our_args(), n_mtp_layers=0, mtp_loss_coef=0.3)


def test_flavors():
    full = configs["full"]
    assert [full.is_full_attention(i) for i in range(8)] == [False, False, False, True] * 2
    assert (full.dim, full.n_layers, full.vocab_size, full.rotary_dim) == (4096, 60, 248320, 64)
    h200 = configs["h200"]
    assert (h200.dim, h200.moe_args.expert_dim, h200.moe_args.top_k, h200.head_dim) == (4096, 1024, 10, 256)
    with pytest.raises(ValueError, match="full_attention_interval"):
        Qwen35ModelArgs(n_layers=6)


def test_full_flavor_sizes_on_meta():
    """Published: 397B total, 17B active. Ours: text trunk 396.35 B (the published
    total also counts the vision tower, not modelled, and not the 6.6 B MTP module
    that ships in the checkpoint); active 17.35 B per token."""
    args = configs["full"]
    with torch.device("meta"):
        model = Qwen35Model(args)
    total, active = args.get_nparams(model)
    mtp = sum(p.numel() for p in model.mtp.parameters())
    assert 6.5e9 < mtp < 6.7e9, mtp
    assert 396e9 < total - mtp < 397e9, total - mtp
    assert 17e9 < active < 17.5e9, active


def test_update_from_config_copies_mok_section():
    from types import SimpleNamespace

    args = _our_args()
    job = SimpleNamespace(training=SimpleNamespace(seq_len=96), mok=SimpleNamespace(backend="torchtitan", precision="mxfp8", kernels="reference"))
    args.update_from_config(job)
    assert (args.max_seq_len, args.moe_args.backend, args.moe_args.precision, args.moe_args.kernels) == (96, "torchtitan", "mxfp8", "reference")
    with pytest.raises(ValueError, match=r"\[mok\] section"):
        args.update_from_config(SimpleNamespace(training=SimpleNamespace(seq_len=96)))


def test_causal_and_bf16():
    """Changing tokens from position t on leaves the logits before t unchanged;
    the model also runs forward and backward in bf16, close to fp32."""
    torch.manual_seed(0)
    model = Qwen35Model(_our_args())
    model.init_weights()
    tokens = torch.randint(0, 96, (2, 29), generator=torch.Generator().manual_seed(2))
    edited = tokens.clone()
    edited[:, 13:] = (edited[:, 13:] + 1) % 96
    with torch.no_grad():
        a, b = model(tokens), model(edited)
    assert torch.allclose(a[:, :13], b[:, :13], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 13:], b[:, 13:])

    model_bf16 = model.to(torch.bfloat16)
    logits = model_bf16(tokens)
    logits.float().square().mean().backward()
    assert logits.dtype == torch.bfloat16 and rel_err(logits.float(), a) < 5e-2
    assert all(torch.isfinite(p.grad).all() for p in model_bf16.parameters() if p.grad is not None)
