"""``[mok] kernels = "megakernel"`` in the MoE layer, on CPU (Triton's interpreter, the megakernel's serialized
mode), against ``kernels = "triton"`` (the fused path, which runs on CPU at one rank): the layer's output, its input
gradient and every parameter's gradient, bit for bit (torch.equal); with activation checkpointing, with layers
sharing the megakernel's workspace, run to run, in bf16 (the backward through the dgrad launch) and with MXFP8
routed experts (the backward through the recomputed triton forward; each weight quantized once per version for
both); the errors for what the megakernel does not run; and which path ``kernels = "auto"`` takes. On a GPU:
test_mok_megakernel_layer_gpu.py.

Hopper is required by both kernels' build-time check; these tests lift it (``has_cuda_capability``) since the
interpreter runs the same kernels here.
"""

import os

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from titan_mok.kernels import grouped_ffn
from titan_mok.moe import MoE, MoEArgs
from titan_mok.moe import megakernel_rank as mk_rank
from titan_mok.moe import moe as moe_module
from titan_mok.moe.moe import routed_schedule
from titan_mok.moe.workspace import get_workspace

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's serialized "
                                 "megakernel on CPU tensors; on a GPU see test_mok_megakernel_layer_gpu.py")
H, I, E, K, T = 64, 32, 8, 2, 16
CASES = {
    # bf16 parameters; sigmoid scores with the expert bias, an ungated shared expert (bf16 output)
    "bf16": dict(dtype=torch.bfloat16, amp=False, args=dict(route_scale=2.5)),
    # fp32 master weights under autocast (one GPU's AMP); softmax scores, a gated shared expert (fp32 output),
    # DeepSeek-V4's SwiGLU clamp on the routed and shared experts
    "amp_gated_clamped": dict(dtype=torch.float32, amp=True, args=dict(
        score_func="softmax", use_expert_bias=False, load_balance_coeff=None, shared_expert_gate=True,
        swiglu_limit=0.3, shared_expert_swiglu_limit=0.3)),
    # MXFP8 routed experts (the shared expert bf16), with the previous case's AMP, gate and clamps
    "mxfp8_amp_gated_clamped": dict(dtype=torch.float32, amp=True, args=dict(
        precision="mxfp8", score_func="softmax", use_expert_bias=False, load_balance_coeff=None,
        shared_expert_gate=True, swiglu_limit=0.3, shared_expert_swiglu_limit=0.3)),
}


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
    monkeypatch.setattr(moe_module, "has_cuda_capability", lambda major, minor: True)


def _layer(kernels: str, case: str = "bf16", seed: int = 0, **overrides) -> MoE:
    spec = CASES[case]
    args = MoEArgs(num_experts=E, top_k=K, expert_dim=I, shared_expert_dim=32, kernels=kernels,
                   **{**spec["args"], **overrides})
    torch.manual_seed(seed)
    moe = MoE(args, H)
    moe.init_weights(0.1, torch.device("cpu"))
    with torch.no_grad():  # weights large enough that routing and the clamps matter
        for p in moe.parameters():
            p.normal_(0, 0.2)
        moe.expert_bias.normal_(0, 0.1)
    return moe.to(spec["dtype"])


def _inputs(case: str = "bf16", seed: int = 1, tokens: int = T):
    g = torch.Generator().manual_seed(seed)
    dtype = CASES[case]["dtype"]
    return (torch.randn(1, tokens, H, generator=g).to(dtype), torch.randn(1, tokens, H, generator=g).to(dtype))


def run_layers(layers, x, dy, amp: bool = False, checkpointed: bool = False):
    """Output, input gradient and every parameter's gradient (by layer index and name) of the layers in sequence
    (amp: under autocast to bf16 on x's device)."""
    xs = x.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        y = xs
        for layer in layers:
            y = checkpoint(layer, y, use_reentrant=False) if checkpointed else layer(y)
    y.backward(dy)
    grads = {(i, n): p.grad.clone() for i, layer in enumerate(layers) for n, p in layer.named_parameters()
             if p.grad is not None}
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return y.detach(), xs.grad, grads


def _assert_bitwise(got, want):
    (y, dx, grads), (y_want, dx_want, grads_want) = got, want
    assert torch.equal(y, y_want), "output"
    assert torch.equal(dx, dx_want), "input gradient"
    assert grads.keys() == grads_want.keys()
    assert any(name == "experts.w_down" for _, name in grads)  # the routed experts got gradients
    for key in grads_want:
        assert torch.equal(grads[key], grads_want[key]), f"gradient of {key}"


@pytest.mark.parametrize("case", list(CASES))
@interpreted
def test_forward_and_every_gradient_equal_the_triton_path(case):
    x, dy = _inputs(case)
    triton_layer, mega_layer = _layer("triton", case), _layer("megakernel", case)
    want = run_layers([triton_layer], x, dy, CASES[case]["amp"])
    calls = get_workspace(None, T, K, H, torch.bfloat16, torch.device("cpu")).megakernel_calls
    epoch = calls.epoch
    got = run_layers([mega_layer], x, dy, CASES[case]["amp"])
    # the forward launch and the dgrad launch (bf16 and MXFP8): no recomputed forward
    assert calls.epoch - epoch == 2
    _assert_bitwise(got, want)
    assert got[0].dtype == CASES[case]["dtype"]
    # the metrics' dropless check: the experts computed every routed slot (T·K rows), as on the fused path
    assert mega_layer.experts.rows_computed.item() == triton_layer.experts.rows_computed.item() == T * K
    assert torch.equal(mega_layer.tokens_per_expert, triton_layer.tokens_per_expert)
    _assert_bitwise(run_layers([mega_layer], x, dy, CASES[case]["amp"]), got)  # run to run


@interpreted
def test_hash_routed_layer_equals_the_triton_path():
    """DeepSeek-V4's hash-routed layers (each token's experts from its token id, sqrtsoftplus scores): the output and
    every gradient equal the triton path's."""
    x, dy = _inputs(seed=9)
    token_ids = torch.randint(0, 50, (1, T), generator=torch.Generator().manual_seed(9))

    def run(kernels):
        layer = _layer(kernels, score_func="sqrtsoftplus", hash_routing=True, hash_vocab_size=50)
        xs = x.clone().requires_grad_()
        y = layer(xs, token_ids)
        y.backward(dy)
        return y.detach(), xs.grad, {(0, n): p.grad for n, p in layer.named_parameters() if p.grad is not None}

    _assert_bitwise(run("megakernel"), run("triton"))


@pytest.mark.parametrize("frozen", ["input", "experts", "experts_and_input"])
@interpreted
def test_gradients_of_what_requires_them(frozen):
    """An input or expert weights without requires_grad: the other gradients are still the triton path's."""
    x, dy = _inputs(seed=6)
    results = []
    for kernels in ("triton", "megakernel"):
        layer = _layer(kernels)
        if "experts" in frozen:
            layer.experts.requires_grad_(False)
        xs = x.clone().requires_grad_("input" not in frozen)
        y = layer(xs)
        y.backward(dy)
        grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
        results.append((y.detach(), xs.grad, grads))
    (y_want, dx_want, grads_want), (y, dx, grads) = results
    assert torch.equal(y, y_want) and (dx is None) == (dx_want is None) == ("input" in frozen)
    assert dx is None or torch.equal(dx, dx_want)
    assert grads.keys() == grads_want.keys() and ("experts.w_gate" in grads) == ("experts" not in frozen)
    assert all(torch.equal(grads[n], grads_want[n]) for n in grads_want)


@interpreted
def test_activation_checkpointing_and_layers_sharing_the_workspace():
    """Two layers of one shape (one megakernel workspace), each recomputed in the backward (non-reentrant
    checkpointing, as TorchTitan's apply_ac): the gradients of both equal the triton path's without checkpointing."""
    x, dy = _inputs(seed=2)
    want = run_layers([_layer("triton", seed=3), _layer("triton", seed=4)], x, dy)
    mega = [_layer("megakernel", seed=3), _layer("megakernel", seed=4)]
    _assert_bitwise(run_layers(mega, x, dy, checkpointed=True), want)
    _assert_bitwise(run_layers(mega, x, dy), want)


@interpreted
def test_backward_reads_nothing_from_the_workspace():
    """The workspaces are every same-shaped layer's (the forward launch's ring and h, the dgrad launch's ring, the
    mok workspace's symmetric buffers, which the backward rewrites before it reads them: the x rows' pull, w·dY, the
    dgrad launch's pushed rows; the combine slots' expert rows are kept as a copy): overwritten with NaN between the
    forward and the backward, the gradients are still the triton path's."""
    x, dy = _inputs(seed=5)
    want = run_layers([_layer("triton")], x, dy)
    layer = _layer("megakernel")
    run_layers([layer], x, dy)  # both launches' workspaces made
    xs = x.clone().requires_grad_()
    y = layer(xs)
    assert {key[0] for key in mk_rank._WORKSPACES} == {"forward", "dgrad"}
    with torch.no_grad():
        for ws in mk_rank._WORKSPACES.values():
            named = ("ring_VQMH", "h_VQMI")  # the dgrad launch's: a ring only
            for buf in (*(getattr(ws.bufs, name, None) for name in named), ws.group_ws.x_TH, ws.group_ws.slots_NH,
                        ws.group_ws.dy_NH):
                if buf is not None:
                    buf.fill_(float("nan"))
    y.backward(dy)
    grads = {(0, n): p.grad for n, p in layer.named_parameters() if p.grad is not None}
    _assert_bitwise((y.detach(), xs.grad, grads), want)


def test_what_the_megakernel_does_not_run_is_refused():
    with pytest.raises(ValueError, match="max_rows_per_rank = 10 bounds the reference schedule's receive buffer"):
        MoE(MoEArgs(num_experts=E, expert_dim=I, kernels="megakernel", max_rows_per_rank=10), H)
    with pytest.raises(ValueError, match="TorchTitan's bf16 grouped GEMM baseline.*kernels 'megakernel'"):
        MoE(MoEArgs(num_experts=E, expert_dim=I, kernels="megakernel", backend="torchtitan"), H)
    with pytest.raises(ValueError, match=r"MoEArgs.kernels = 'fused'; choose one of \['auto', 'reference', "
                                         r"'triton', 'megakernel'\]"):
        MoE(MoEArgs(kernels="fused"), H)
    # fp32 activations (no AMP): the megakernel runs bf16
    with pytest.raises(ValueError, match="x_TH of rank 0 must be .* torch.bfloat16"):
        _layer("megakernel", "amp_gated_clamped")(torch.randn(1, T, H))


def test_megakernel_needs_hopper_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(moe_module, "has_cuda_capability", lambda major, minor: False)
    with pytest.raises(ValueError, match="kernels = 'megakernel' needs a CUDA GPU with compute capability >= 9.0"):
        MoE(MoEArgs(kernels="megakernel"), H)


@pytest.mark.parametrize("kernels, max_rows, hopper_tensors, fixed, want", [
    ("auto", None, True, True, "fused"),  # Hopper: the fastest measured path
    ("auto", 100, True, True, "reference"),  # a capacity: the fused buffers are the worst case
    ("auto", None, True, False, "reference"),  # token counts vary (RL rollouts)
    ("auto", None, False, True, "reference"),  # CPU tensors or an older GPU
    ("reference", None, True, True, "reference"),
    ("triton", None, False, True, "fused"),
    ("megakernel", None, True, True, "megakernel"),
])
def test_auto_takes_the_fused_path_where_it_can_run(kernels, max_rows, hopper_tensors, fixed, want):
    assert routed_schedule(kernels, max_rows, hopper_tensors, fixed) == want


def test_auto_on_cpu_tensors_is_the_reference_and_checks_router_logits():
    """A Hopper machine's "auto" layer on CPU tensors: the reference schedule, with its host check of the logits."""
    layer = _layer("auto")
    x, _ = _inputs()
    assert layer.use_triton and layer._schedule(x[0]) == "reference"
    x[0, 3, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN or Inf"):
        layer(x)


@interpreted
def test_mxfp8_weights_are_quantized_once_per_version(monkeypatch):
    """Under mxfp8 the forward launch and the dgrad launch read the MXFP8 weight operands kept under the experts
    module: a training step quantizes each routed weight once per layout it reads (the forward's, the dgrad's), the
    next step with the same weights not at all."""
    made = []
    quantize = grouped_ffn.weight_operand
    monkeypatch.setattr(grouped_ffn, "weight_operand", lambda w, p, along, name, **kw: made.append((name, along))
                        or quantize(w, p, along, name, **kw))
    x, dy = _inputs("mxfp8_amp_gated_clamped", seed=7)
    layer = _layer("megakernel", "mxfp8_amp_gated_clamped")
    first = run_layers([layer], x, dy, amp=True)
    assert sorted(made) == [(n, along) for n in ("w_down_EHI", "w_gate_EIH", "w_up_EIH") for along in (1, 2)]
    _assert_bitwise(run_layers([layer], x, dy, amp=True), first)
    assert len(made) == 6
