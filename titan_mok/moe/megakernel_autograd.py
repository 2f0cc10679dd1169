"""``[mok] kernels = "megakernel"``: the routed experts' forward through the MoK megakernel
(``titan_mok.moe.megakernel_rank``: this rank's launch, alone or in an expert-parallel group), with a backward, so
that it trains.

Legend: T tokens per rank, K top-k, P ep degree, R = P·T·K grouped rows per rank (the worst case), H hidden,
I expert FFN size, E experts, L = E / P local experts.

Forward: ``out[t] = cast(shared[t] + Σ_j w[t,j]·expert_{e[t,j]}(x[t]))``, the megakernel's one persistent
launch plus its finish, bitwise the ``"triton"`` path's (``titan_mok.moe.fused``) output at the same EP degree.
It returns this rank's schedule (the ``"triton"`` path's: rows grouped by local expert, in (source rank, token,
slot) order, from every rank's gathered ids) as the ``"triton"`` path's handle on the same symmetric workspace;
the backward keeps it.

Backward: the megakernel keeps nothing of its forward: its gate/up/SwiGLU values live in a ring that every
layer of the same shape reuses, and it writes no per-row output (rows go straight into the combine slots). So
the backward runs the ``"triton"`` path's forward again on the saved input and schedule — ``fused_dispatch``
(x → own buffer | barrier | pull the rows from their source ranks), the Triton grouped FFN
(``kernels/grouped_ffn.py``: its rows are the megakernel's bits), ``fused_combine`` (push | barrier | ordered
reduction) — and differentiates it: the ``"triton"`` path's own backward (``combine_weight_grads``; w·dY to
own buffer | barrier | pull; the FFN's backward; push each row's gradient to its source | barrier | ascending
slot fp32 sum), across the EP group through the symmetric workspace's barriers. So every gradient is the
``"triton"`` path's, bit for bit, at any EP degree; the shared output's gradient is dY in its dtype. The
recomputation costs one dispatch, FFN forward and combine per backward, and saves the row activations the
``"triton"`` path keeps from forward to backward. Every rank of the group runs the same backward sequence (the
same layers), so the barriers pair up.

Nothing the backward reads comes from the megakernel's ring or a buffer it left: it saves x, the combine
weights, the bf16 expert weights it was given and the schedule, and rewrites every workspace buffer it reads.

MXFP8 (``ExpertPrecision``): the forward launch reads the MXFP8 weight operands that the Triton grouped FFN keeps
per weight version under the experts module (``grouped_ffn.forward_weight_operands``; in a training forward made
together with the dgrad layouts), and the backward's ``grouped_swiglu_ffn(precision="mxfp8")`` finds them there:
no weight is quantized twice, and every gradient is the ``"triton"`` path's MXFP8 gradient.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_mok.kernels.grouped_ffn import grouped_swiglu_ffn
from titan_mok.moe.fused import FusedHandle, fused_combine, fused_dispatch
from titan_mok.moe.megakernel import MegakernelConfig
from titan_mok.moe.megakernel_rank import megakernel_rank_forward


@dataclass(frozen=True)
class TokenRouting:
    """What the megakernel needs beside the token rows and the expert weights: the router's choice, the shared
    expert's output and the layer's output dtype."""

    weights_TK: torch.Tensor
    """fp32 [T, K] combine weights."""
    topk_idx_TK: torch.Tensor
    """int [T, K] expert ids in [0, E)."""
    shared_TH: torch.Tensor | None
    """The shared expert's output [T, H] (bf16, or fp32 when gated), added before the one rounding; None: none."""
    out_dtype: torch.dtype
    """The layer's output dtype."""


@dataclass(frozen=True)
class ExpertPrecision:
    """The routed experts' GEMM precision and, under mxfp8, where their MXFP8 weight operands are kept
    (``grouped_swiglu_ffn``'s weights_owner and weight_sources): the forward launch and the backward's
    recomputation read the same kept operands."""

    precision: str = "bf16"
    weights_owner: object = None
    weight_sources: tuple | None = None


class _MegakernelRoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, weights_TK, shared_TH, w_gate_LIH, w_up_LIH, w_down_LHI, topk_idx_TK, group, num_experts,
                swiglu_limit, out_dtype, config, experts_precision):
        out_TH, handle = megakernel_rank_forward(
            x_TH, weights_TK, topk_idx_TK, shared_TH, (w_gate_LIH, w_up_LIH, w_down_LHI), num_experts=num_experts,
            group=group, swiglu_limit=swiglu_limit, out_dtype=out_dtype, config=config,
            precision=experts_precision.precision, weights_owner=experts_precision.weights_owner,
            weight_sources=experts_precision.weight_sources,
        )
        ctx.save_for_backward(x_TH, weights_TK, w_gate_LIH, w_up_LIH, w_down_LHI, handle.group_end, handle.row_slot_R)
        ctx.workspace = handle.workspace
        ctx.swiglu_limit, ctx.out_dtype, ctx.experts_precision = swiglu_limit, out_dtype, experts_precision
        ctx.shared_dtype = None if shared_TH is None else shared_TH.dtype
        ctx.mark_non_differentiable(handle.group_end)
        return out_TH, handle.group_end

    @staticmethod
    def backward(ctx, dout_TH, _dgroup_end):
        x_TH, weights_TK, w_gate_LIH, w_up_LIH, w_down_LHI, group_end_L, row_slot_R = ctx.saved_tensors
        needs = ctx.needs_input_grad
        needs_dx, needs_dweights, needs_dw = needs[0], needs[1], needs[3:6]
        dshared_TH = None if ctx.shared_dtype is None else dout_TH.to(ctx.shared_dtype)  # the fused combine's
        unused = (None,) * 7  # topk_idx, group, num_experts, swiglu_limit, out_dtype, config, precision
        if not (needs_dx or needs_dweights or any(needs_dw)):
            return None, None, dshared_TH, None, None, None, *unused
        num_tokens, top_k = weights_TK.shape
        handle = FusedHandle(num_tokens, top_k, row_slot_R, group_end_L, ctx.workspace)
        with torch.enable_grad():  # the "triton" path's forward, on the saved rows and schedule
            x = x_TH.detach().requires_grad_(needs_dx)
            w_TK = weights_TK.detach().requires_grad_(needs_dweights)
            experts = [w.detach().requires_grad_(need) for w, need in zip((w_gate_LIH, w_up_LIH, w_down_LHI),
                                                                             needs_dw)]
            mx = ctx.experts_precision
            y_RH = grouped_swiglu_ffn(fused_dispatch(x, handle), group_end_L, *experts, precision=mx.precision,
                                      swiglu_limit=ctx.swiglu_limit, use_triton=True, weights_owner=mx.weights_owner,
                                      weight_sources=mx.weight_sources)
            out = fused_combine(y_RH, w_TK, None, handle, ctx.out_dtype)
        leaves = (x, w_TK, *experts)
        wanted = [t for t in leaves if t.requires_grad]
        computed = iter(torch.autograd.grad(out, wanted, dout_TH))
        dx_TH, dweights_TK, *dw = [next(computed) if t.requires_grad else None for t in leaves]
        return dx_TH, dweights_TK, dshared_TH, *dw, *unused


def megakernel_routed_experts_trainable(
    x_TH: torch.Tensor,
    routing: TokenRouting,
    expert_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    num_experts: int,
    group: dist.ProcessGroup | None,
    swiglu_limit: float | None,
    config: MegakernelConfig,
    experts_precision: ExpertPrecision = ExpertPrecision(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_TH [T, H] in routing.out_dtype, group_end_L int32 [L]): this rank's routed experts combined with the
    shared output (module docstring), differentiable in x, the combine weights, the shared output and the rank's
    expert weights (bf16, contiguous: w_gate, w_up [L, I, H], w_down [L, H, I]; under mxfp8 also FSDP's
    MXFP8-gathered weights). Every rank of ``group`` (None: this rank alone) calls it in the same order. No host
    sync."""
    return _MegakernelRoutedExperts.apply(
        x_TH, routing.weights_TK, routing.shared_TH, *expert_weights, routing.topk_idx_TK, group, num_experts,
        swiglu_limit, routing.out_dtype, config, experts_precision,
    )
