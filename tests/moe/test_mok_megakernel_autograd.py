"""The megakernel's training backward (``titan_mok.moe.megakernel_autograd``) on CPU, in Triton's interpreter: the
routed experts and combine on given router outputs, through ``megakernel_routed_experts_trainable`` against the
``"triton"`` path (``fused_routed_experts`` with the Triton grouped FFN) on the same rows, every gradient (x, the
combine weights, the shared output, w_gate, w_up, w_down) bit for bit (torch.equal), under the routing extremes
(skewed, everything to two experts, experts with no rows), with and without a shared output (bf16, or fp32 with an
fp32 output), with and without the SwiGLU clamp, bf16 and MXFP8; that the backward is the dgrad launch (one
megakernel call per backward, no recomputed forward, no gate/up GEMM) on the forward launch's kept g, u, h rows, and
that those equal ``grouped_gate_up_swiglu``'s on the schedule's rows bit for bit. EP = 2 (two gloo processes):
test_mok_megakernel_ep.py; the layer (router, shared expert, activation checkpointing, run to run, MXFP8):
test_mok_megakernel_layer.py; GPUs: test_mok_megakernel_layer_gpu.py.
"""

import os

import pytest
import torch

from tests.kernels.test_mok_megakernel import DEVICE, SMALL, E, K, T, layer_inputs, routing
from titan_mok.kernels import grouped_gemm
from titan_mok.kernels.grouped_ffn import grouped_swiglu_ffn
from titan_mok.kernels.grouped_gemm import grouped_gate_up_swiglu
from titan_mok.kernels.mok_megakernel import SharedFFN
from titan_mok.moe.fused import fused_dispatch, fused_routed_experts
from titan_mok.moe.megakernel_autograd import ExpertPrecision, TokenRouting, megakernel_routed_experts_trainable
from titan_mok.moe.megakernel_rank import megakernel_rank_forward
from titan_mok.moe.workspace import get_workspace

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's serialized "
                                 "megakernel on CPU tensors; on a GPU see test_mok_megakernel_layer_gpu.py")
GRADIENTS = ("x", "weights", "shared", "w_gate", "w_up", "w_down")


def routed_gradients(kernels: str, x_TH, weights_TK, topk_idx_TK, shared_TH, expert_weights, dout_TH, *,
                     num_experts: int = E, group=None, swiglu_limit=None, out_dtype=torch.bfloat16, config=SMALL,
                     precision="bf16"):
    """(out, {name: gradient}) of this rank's routed experts and combine (every rank of ``group`` calls it alike):
    kernels "triton" (the fused path with the Triton grouped FFN) or "megakernel"; expert_weights: the rank's;
    precision: the routed experts' GEMMs ("bf16" or "mxfp8")."""
    leaves = [None if t is None else t.detach().clone().requires_grad_()
              for t in (x_TH, weights_TK, shared_TH, *expert_weights)]
    x, weights, shared, *experts = leaves
    if kernels == "triton":
        def ffn(x_RH, group_end_L):
            return grouped_swiglu_ffn(x_RH, group_end_L, *experts, swiglu_limit=swiglu_limit, use_triton=True,
                                      precision=precision)

        out = fused_routed_experts(x, weights, topk_idx_TK, shared, group, ffn, num_experts=num_experts,
                                   out_dtype=out_dtype)
    else:
        out, _ = megakernel_routed_experts_trainable(
            x, TokenRouting(weights, topk_idx_TK, shared, out_dtype), tuple(experts), num_experts=num_experts,
            group=group, swiglu_limit=swiglu_limit, config=config, experts_precision=ExpertPrecision(precision))
    out.backward(dout_TH)
    return out.detach(), {name: t.grad for name, t in zip(GRADIENTS, leaves) if t is not None}


def assert_same_gradients(got, want, what) -> None:
    (out, grads), (out_want, grads_want) = got, want
    assert torch.equal(out, out_want), (what, "output")
    assert grads.keys() == grads_want.keys() and {"x", "weights", "w_down"} <= grads.keys(), what
    for name in grads_want:
        assert grads[name].dtype == grads_want[name].dtype and torch.equal(grads[name], grads_want[name]), (what, name)


H = 32  # and I = 32: one 32-column block per GEMM (SMALL)
CASES = {
    # routing, shared output (None, bf16, fp32: then an fp32 output, so dout arrives in fp32), SwiGLU clamp, precision
    "skewed_shared": ("skewed", torch.bfloat16, None, "bf16"),
    "two_experts_clamped": ("one_expert", None, 0.5, "bf16"),  # 6 of 8 experts without rows
    "empty_experts_fp32_clamped": ("empty_experts", torch.float32, 0.3, "bf16"),
    "mxfp8_skewed_shared": ("skewed", torch.bfloat16, None, "mxfp8"),
    "mxfp8_two_experts_fp32_clamped": ("one_expert", torch.float32, 0.5, "mxfp8"),
}


@pytest.mark.parametrize("case", list(CASES))
@interpreted
def test_every_gradient_equals_the_triton_path(case, monkeypatch):
    kind, shared_dtype, limit, precision = CASES[case]
    (x, weights, shared), expert_weights = layer_inputs(1, H, seed=3, dim_i=32)
    shared = None if shared_dtype is None else shared.to(shared_dtype)
    out_dtype = torch.float32 if shared_dtype == torch.float32 else torch.bfloat16
    dout = torch.randn(T, H, generator=torch.Generator().manual_seed(4)).to(out_dtype).to(DEVICE)
    ids = routing(kind, 1, seed=5).to(DEVICE)
    call = lambda kernels: routed_gradients(kernels, x, weights, ids, shared, expert_weights, dout,  # noqa: E731
                                            swiglu_limit=limit, out_dtype=out_dtype, precision=precision)
    want = call("triton")
    calls = get_workspace(None, T, K, H, torch.bfloat16, x.device).megakernel_calls
    epoch = calls.epoch
    launch_mm, modes = grouped_gemm._launch_mm, []

    def counted(mode, *args, **kwargs):  # the Triton grouped GEMMs the megakernel's forward and backward launch
        modes.append(mode)
        return launch_mm(mode, *args, **kwargs)

    monkeypatch.setattr(grouped_gemm, "_launch_mm", counted)
    got = call("megakernel")
    assert calls.epoch == epoch + 2  # the forward launch and the dgrad launch: no recomputed forward
    assert grouped_gemm.SWIGLU not in modes, modes  # g, u, h kept by the forward launch, not recomputed
    assert_same_gradients(got, want, case)


@pytest.mark.parametrize("kind, tokens, shared_dim, limit", [("skewed", T, 32, None), ("empty_experts", T, 0, 0.3),
                                                             ("one_expert", T - 3, 0, None)])
@interpreted
def test_kept_rows_equal_the_gate_up_launch(kind, tokens, shared_dim, limit):
    """The training launch's kept g, u, h (``megakernel_rank_forward(keep_rows=True)``) are
    ``grouped_gate_up_swiglu``'s on the schedule's rows (the x rows ``fused_dispatch`` pulls), bit for bit, every row
    up to the schedule's end: tiles that run past their expert's end (16-row tiles, expert sizes not multiples of
    16), experts with no rows, everything to two experts, the clamp; and with the shared expert's items in the
    launch (their rows must not land in the kept rows)."""
    (x, weights, shared), expert_weights = layer_inputs(1, H, seed=6, tokens=tokens, dim_i=32)
    ids = routing(kind, 1, tokens=tokens, seed=7).to(DEVICE)
    shared_expert = None
    if shared_dim:
        g = torch.Generator().manual_seed(8)
        shared_weights = [(torch.randn(*shape, generator=g) * 0.1).to(torch.bfloat16).to(DEVICE)
                          for shape in ((shared_dim, H), (shared_dim, H), (H, shared_dim))]
        shared_expert, shared = SharedFFN(*shared_weights), None
    with torch.no_grad():
        _, handle, kept = megakernel_rank_forward(x, weights, ids, shared, expert_weights, num_experts=E, group=None,
                                                  swiglu_limit=limit, config=SMALL, shared_expert=shared_expert,
                                                  keep_rows=True)
        want = grouped_gate_up_swiglu(fused_dispatch(x, handle), handle.group_end, *expert_weights[:2], limit)
    sizes = torch.diff(handle.group_end, prepend=handle.group_end.new_zeros(1))
    assert (sizes % SMALL.block_m != 0).any() and (kind == "skewed" or (sizes == 0).any()), sizes
    rows = int(handle.group_end[-1])
    assert rows == tokens * K
    for name, got_RI, want_RI in zip(("gate", "up", "h"), kept, want):
        assert got_RI.shape == want_RI.shape and got_RI.dtype == torch.bfloat16, name
        assert torch.equal(got_RI[:rows], want_RI[:rows]), name
