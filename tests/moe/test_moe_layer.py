"""Single-process MoE layer: parity with HF transformers' MoE blocks (fp32),
gradients against a plain-autograd reference, determinism, batch invariance,
routing extremes, bad input."""

import pytest
import torch
import torch.nn.functional as F

from titan_mok.moe import MoE, MoEArgs
from titan_mok.moe import moe as moe_module
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


# ------------------------------------------- gradients vs plain autograd


def _naive_moe(moe: MoE, x_BSH: torch.Tensor, topk_idx_TK: torch.Tensor) -> torch.Tensor:
    """The layer in plain autograd ops, token by token, for the given expert choice."""
    args = moe.args
    x_TH = x_BSH.reshape(-1, H)
    logits_TE = F.linear(x_TH, moe.router.gate.weight)
    scores_TE = {"sigmoid": torch.sigmoid, "softmax": lambda v: v.softmax(-1),
                 "sqrtsoftplus": lambda v: F.softplus(v).sqrt()}[args.score_func](logits_TE)
    weights_TK = scores_TE.gather(1, topk_idx_TK)
    if args.route_norm:
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    weights_TK = weights_TK * args.route_scale

    def ffn(x, w_gate, w_up, w_down, limit):
        gate, up = F.linear(x, w_gate), F.linear(x, w_up)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return F.linear(F.silu(gate) * up, w_down)

    rows = []
    for t in range(x_TH.shape[0]):
        y = sum(weights_TK[t, j] * ffn(x_TH[t], moe.experts.w_gate[e], moe.experts.w_up[e], moe.experts.w_down[e],
                                      args.swiglu_limit) for j, e in enumerate(topk_idx_TK[t].tolist()))
        rows.append(y)
    y_TH = torch.stack(rows)
    if moe.shared_expert is not None:
        se = moe.shared_expert
        shared = ffn(x_TH, se.w_gate.weight, se.w_up.weight, se.w_down.weight, args.shared_expert_swiglu_limit)
        if se.output_gate is not None:
            shared = shared * torch.sigmoid(F.linear(x_TH, se.output_gate.weight))
        y_TH = y_TH + shared
    loss_extra = 0.0
    if args.aux_loss_coef > 0:
        loss_extra = args.aux_loss_coef * load_balance_aux_loss(scores_TE, topk_idx_TK)
    return y_TH.view_as(x_BSH), loss_extra


@torch.no_grad()
def _route(moe: MoE, x_BSH: torch.Tensor) -> torch.Tensor:
    """The layer's expert choice topk_idx_TK for x_BSH."""
    bias_E = moe.expert_bias if moe.args.use_expert_bias else None
    return moe.router(moe.router.logits(x_BSH.reshape(-1, H)), bias_E, None)[1]


def _grads(moe: MoE, x: torch.Tensor, loss_fn) -> dict[str, torch.Tensor]:
    moe.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    loss_fn(x).backward()
    return {"x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}


CASES = {
    "kimi_like": dict(route_scale=2.827),
    "qwen_like": dict(score_func="softmax", use_expert_bias=False, aux_loss_coef=0.1, shared_expert_gate=True),
    "v4_like": dict(score_func="sqrtsoftplus", swiglu_limit=1.0, shared_expert_swiglu_limit=1.0, route_scale=2.5),
    "groups_no_shared": dict(num_expert_groups=4, num_limited_groups=2, shared_expert_dim=0, route_norm=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_match_plain_autograd(case):
    moe = _moe(**CASES[case])
    x = torch.randn(2, 9, H)
    g = torch.randn(2, 9, H)
    topk_idx_TK = _route(moe, x)
    ours = _grads(moe, x, lambda xx: (moe(xx) * g).sum())

    def naive_loss(xx):
        y, extra = _naive_moe(moe, xx, topk_idx_TK)
        return (y * g).sum() + extra

    ref = _grads(moe, x, naive_loss)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _naive_moe(moe, x, topk_idx_TK)[0], rtol=0, atol=1e-5)
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"grad {name}: {m}")


# ------------------------------------------------- determinism (bitwise)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_seed_bitwise(dtype):
    x = torch.randn(3, 11, H, dtype=dtype)
    results = []
    for _ in range(2):
        moe = _moe(dtype, seed=3, **CASES["qwen_like"])
        y = moe(x.requires_grad_(False))
        results.append((y, _grads(moe, x, lambda xx: moe(xx).float().square().sum())))
    assert torch.equal(results[0][0], results[1][0])
    for name, grad in results[0][1].items():
        assert torch.equal(grad, results[1][1][name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["kimi_like", "qwen_like", "v4_like"])
@torch.no_grad()
def test_token_output_independent_of_batch(case, dtype):
    moe = _moe(dtype, **CASES[case])
    x = torch.randn(4, 37, H, dtype=dtype)  # 148 tokens: several row tiles
    token = x[2, 17]
    alone = moe(token.view(1, 1, H))[0, 0]
    in_batch = moe(x)[2, 17]
    other = torch.randn(1, 70, H, dtype=dtype)
    other[0, 3] = token
    elsewhere = moe(other)[0, 3]
    assert torch.equal(alone, in_batch)
    assert torch.equal(alone, elsewhere)


@pytest.mark.parametrize("backend", ["mok", "torchtitan"])
def test_autocast_runs_the_experts_in_its_dtype(backend):
    """TorchTitan's AMP (mixed precision without FSDP, e.g. one GPU): the routed and shared experts
    compute in autocast's dtype (the Triton FFN runs only bf16), the layer returns its input dtype."""
    moe = _moe(backend=backend, kernels="reference")  # CPU tensors, also on a GPU machine
    seen = []
    for module in (moe.experts, moe.shared_expert):
        module.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    x = torch.randn(2, 9, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    assert y.dtype == torch.float32
    assert seen == [torch.bfloat16, torch.bfloat16]
    y_fp32 = moe(x)
    assert ((y - y_fp32).norm() / y_fp32.norm()).item() < 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_kernels_run_the_reference_on_cpu_tensors(monkeypatch, dtype):
    """kernels = "auto" on a Hopper machine picks the Triton expert FFN for CUDA tensors; a layer on
    the CPU there runs the reference, bit for bit as kernels = "reference" (not an error)."""
    monkeypatch.setattr(moe_module, "has_cuda_capability", lambda major, minor: True)
    auto = _moe(dtype, kernels="auto")
    assert auto.use_triton
    x = torch.randn(2, 9, H, dtype=dtype)
    assert torch.equal(auto(x), _moe(dtype, kernels="reference")(x))


# ------------------------------------------------------ routing extremes


@torch.no_grad()
def test_all_tokens_one_expert_and_empty_experts():
    moe = _moe(top_k=1)
    moe.expert_bias.zero_()
    moe.expert_bias[5] = 100.0  # sigmoid scores are < 1: the bias decides
    x = torch.randn(2, 13, H)
    topk_idx_TK = _route(moe, x)
    assert (topk_idx_TK == 5).all()
    torch.testing.assert_close(moe(x), _naive_moe(moe, x, topk_idx_TK)[0], rtol=0, atol=1e-5)
    assert moe.tokens_per_expert[5] == 26 and moe.tokens_per_expert.sum() == 26


@torch.no_grad()
def test_ties_go_to_lower_expert_id():
    moe = _moe(num_expert_groups=4, num_limited_groups=2)
    moe.router.gate.weight.zero_()  # every score is sigmoid(0): all tied
    moe.expert_bias.zero_()
    x = torch.randn(1, 5, H)
    topk_idx_TK = _route(moe, x)
    assert topk_idx_TK.tolist() == [[0, 1, 2]] * 5
    torch.testing.assert_close(moe(x), _naive_moe(moe, x, topk_idx_TK)[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 65])
def test_token_counts_not_multiples(num_tokens):
    moe = _moe(**CASES["v4_like"])
    x = torch.randn(1, num_tokens, H, requires_grad=True)
    with torch.no_grad():
        topk_idx_TK = _route(moe, x)
        torch.testing.assert_close(moe(x), _naive_moe(moe, x, topk_idx_TK)[0], rtol=0, atol=1e-5)
    moe(x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_load_counts_and_reset():
    moe = _moe()
    moe(torch.randn(2, 5, H))
    assert moe.tokens_per_expert.sum() == 2 * 5 * K
    assert torch.equal(moe.expert_load, moe.tokens_per_expert)


# -------------------------------------------------------------- bad input


def test_bad_inputs():
    moe = _moe()
    with pytest.raises(ValueError, match="x_BSH must be"):
        moe(torch.randn(5, H))
    with pytest.raises(ValueError, match="x_BSH must be"):
        moe(torch.randn(1, 5, H + 1))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        moe(torch.randn(1, 5, H, dtype=torch.float64))
    with pytest.raises(ValueError, match="is on meta"):
        moe(torch.randn(1, 5, H, device="meta"))
    bad = torch.randn(1, 5, H)
    bad[0, 2, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        moe(bad)
    bad[0, 2, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        moe(bad)


def test_bad_args():
    with pytest.raises(ValueError, match="top_k = 9"):
        MoE(MoEArgs(num_experts=8, top_k=9), H)
    with pytest.raises(ValueError, match="num_expert_groups = 3"):
        MoE(MoEArgs(num_experts=8, num_expert_groups=3, num_limited_groups=1), H)
    with pytest.raises(ValueError, match="num_limited_groups"):
        MoE(MoEArgs(num_experts=8, num_limited_groups=1), H)
    with pytest.raises(ValueError, match="hash_vocab_size"):
        MoE(MoEArgs(hash_routing=True), H)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="compute capability"):
            MoE(MoEArgs(kernels="triton"), H)
    with pytest.raises(ValueError, match="multiples of 32"):
        MoE(MoEArgs(precision="mxfp8", expert_dim=48), 64)
    with pytest.raises(ValueError, match="TorchTitan's bf16 grouped GEMM baseline"):
        MoE(MoEArgs(backend="torchtitan", precision="mxfp8"), 64)
    with pytest.raises(ValueError, match="score_func"):
        MoE(MoEArgs(score_func="relu"), H)


def test_hash_routing_token_ids_checked():
    moe = _moe(score_func="sqrtsoftplus", hash_routing=True, hash_vocab_size=50)
    x = torch.randn(1, 4, H)
    with pytest.raises(ValueError, match="needs token_ids_BS"):
        moe(x)
    with pytest.raises(ValueError, match="hash_vocab_size = 50"):
        moe(x, torch.tensor([[1, 2, 50, 3]]))
    with pytest.raises(ValueError, match="must be int32/int64 of shape"):
        moe(x, torch.tensor([[1, 2, 3]]))


def test_overflow_is_an_error_not_a_drop():
    moe = _moe(max_rows_per_rank=10)
    with pytest.raises(RuntimeError, match="receives 15 rows but its buffer holds max_rows_per_rank = 10"):
        moe(torch.randn(1, 5, H))


# ------------------------------------------------- backend = "torchtitan"


def test_backends_same_seed_same_init():
    layers = []
    for backend in ("mok", "torchtitan"):
        torch.manual_seed(5)
        moe = MoE(MoEArgs(num_experts=E, top_k=K, expert_dim=I, shared_expert_dim=24, backend=backend), H)
        moe.init_weights(0.02, torch.device("cpu"))
        layers.append(moe.state_dict())
    assert all(torch.equal(layers[0][name], layers[1][name]) for name in layers[0])


@pytest.mark.parametrize("case", list(CASES))
def test_torchtitan_backend_matches_mok(case):
    mok = _moe(**CASES[case])
    titan = _moe(backend="torchtitan", **CASES[case])
    assert list(titan.state_dict()) == list(mok.state_dict())
    titan.load_state_dict(mok.state_dict())
    x = torch.randn(2, 9, H)
    g = torch.randn(2, 9, H)
    with torch.no_grad():
        torch.testing.assert_close(titan(x), mok(x), rtol=0, atol=1e-5)
    ours = _grads(mok, x, lambda xx: (mok(xx) * g).sum())
    theirs = _grads(titan, x, lambda xx: (titan(xx) * g).sum())
    for name in ours:
        torch.testing.assert_close(theirs[name], ours[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"grad {name}: {m}")


# ------------------------------------------------------- precision = mxfp8


def test_mxfp8_close_to_bf16_and_batch_invariant():
    bf16 = _moe(expert_dim=32, shared_expert_dim=32)
    mx = _moe(expert_dim=32, shared_expert_dim=32, precision="mxfp8")
    mx.load_state_dict(bf16.state_dict())
    x = torch.randn(2, 9, H)
    with torch.no_grad():
        ref, got = bf16(x), mx(x)
        rel = (got - ref).norm() / ref.norm()
        assert 0 < rel < 0.1, f"MXFP8 relative error {rel:.3g}"
        assert torch.equal(mx(x[1:, 4:5])[0, 0], got[1, 4])
    x.requires_grad_(True)
    mx(x).sum().backward()
    assert torch.isfinite(x.grad).all() and mx.experts.w_down.grad.abs().sum() > 0


# ---------------------------------------------------------------- shared expert on the Triton FFN


@pytest.mark.parametrize("limit", [None, 0.5])
def test_shared_expert_triton_path_matches_tiles_and_is_row_invariant(limit):
    """``use_triton`` (Hopper, BF16): the shared expert as one expert of the routed experts'
    Triton FFN (here through TRITON_INTERPRET without a GPU) — close to the 64-row-tile path,
    and each row's output and input gradient independent of the rows around it."""
    from titan_mok.moe.experts import SharedExpert

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    tiles = SharedExpert(64, 96, output_gate=False, swiglu_limit=limit, use_triton=False)
    for p in tiles.parameters():
        torch.nn.init.normal_(p, std=0.15)
    triton_ = SharedExpert(64, 96, output_gate=False, swiglu_limit=limit, use_triton=True)
    triton_.load_state_dict(tiles.state_dict())
    tiles, triton_ = tiles.to(device, torch.bfloat16), triton_.to(device, torch.bfloat16)
    x = torch.randn(70, 64, device=device).to(torch.bfloat16)  # more than one 64-row tile

    def run(module, x_TH):
        x_TH = x_TH.detach().clone().requires_grad_()
        y = module(x_TH)
        y.float().square().sum().backward()
        return y.detach(), x_TH.grad

    y_tiles, dx_tiles = run(tiles, x)
    y_triton, dx_triton = run(triton_, x)
    for a, b in ((y_triton, y_tiles), (dx_triton, dx_tiles)):  # bf16 intermediates round differently
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() < 1e-2
    y_alone, dx_alone = run(triton_, x[5:9])
    assert torch.equal(y_alone, y_triton[5:9]) and torch.equal(dx_alone, dx_triton[5:9])
