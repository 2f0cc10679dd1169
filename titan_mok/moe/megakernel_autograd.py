"""``[mok] kernels = "megakernel"``: the routed experts' forward through the MoK megakernel
(``titan_mok.moe.megakernel_rank``: this rank's launch, alone or in an expert-parallel group), with a backward, so
that it trains.

Legend: T tokens per rank, K top-k, P ep degree, R = P·T·K grouped rows per rank (the worst case), H hidden,
I expert FFN size, E experts, L = E / P local experts.

Forward: ``out[t] = cast(shared[t] + Σ_j w[t,j]·expert_{e[t,j]}(x[t]))``, the megakernel's one persistent
launch plus its finish, bitwise the ``"triton"`` path's (``titan_mok.moe.fused``) output at the same EP degree.
It returns this rank's schedule (the ``"triton"`` path's: rows grouped by local expert, in (source rank, token,
slot) order, from every rank's gathered ids) as the ``"triton"`` path's handle on the same symmetric workspace;
the backward keeps it. When the combine weights need a gradient it also keeps a copy of the expert rows y[t, j]
that the launch pushed into this rank's combine slots (the workspace is every layer's): the ``"triton"`` path's
y_TKH, bit for bit, T·K·H·2 bytes.

Kept rows (when x or an expert weight needs a gradient): the forward launch also stores each schedule row's g, u and
h (its gate/up items' epilogue, ``megakernel_rank_forward(keep_rows=True)``), the bits the Triton grouped FFN's
``grouped_gate_up_swiglu`` gives on the same rows (the same fp32 sums, rounded by the same ``_swiglu_out``; under
MXFP8 h before its quantization along I, the h that path's backward reads), into per-call grouped rows gate_RI,
up_RI, h_RI that the backward holds (ctx.save_for_backward): 3·R·I·2 bytes per layer (Kimi K2.7, 2048 tokens, EP 1:
R = 16,384, I = 2048: 201 MB). Its ring's values are every layer's, so the kept rows are separate buffers.
Recomputing them in the backward instead (the gate/up grouped GEMM, about 2/3 of the forward FFN's FLOPs) was
measured at 37.9 ms per layer backward for Kimi on an H100: keeping takes the gate/up GEMM out of the backward
(docs/design.md §5.9).

Backward (bf16 and MXFP8 alike): the backward pulls the grouped x rows again (``fused_dispatch``'s pull from the
source ranks' x_TH, through the symmetric workspace's barrier: the gate/up weight gradients' operand, R·H·2 bytes
not kept); then the megakernel's dgrad launch (``megakernel_rank_dgrad``: w·dY pulled from the source ranks, the
down projection's dgrad through the SwiGLU backward on the kept g, u, the gate/up dgrad, each row's dx pushed to its
source, the ordered fp32 sum per token) gives dx and the grouped dy, dgate, dup rows; and ``grouped_wgrads`` on
(dgate, x), (dup, x), (dy, h) gives the weight gradients, as the Triton grouped FFN's backward. Under MXFP8
(``ExpertPrecision``) the dgrad launch runs that FFN's MXFP8 dgrad (dy quantized along H on the pull, dgate and dup
along I, the weights' dgrad operands) and ``grouped_wgrads(..., "mxfp8")`` quantizes its operands along the token
axis, as there. The launches read the MXFP8 weight operands that the Triton grouped FFN keeps per weight version
under the experts module (``grouped_ffn.forward_weight_operands`` in the forward, ``dgrad_weight_operands`` in the
backward; FSDP's MXFP8-gathered weights as gathered): no weight is quantized in either pass, and the backward reads
the dgrad layout only (FSDP's backward all-gather carries that one alone). The combine weights' gradient is
``combine_weight_grads(dout, y)`` on the kept expert rows, as ``fused_combine``'s backward; the shared output's
gradient is dY in its dtype. So every gradient is the ``"triton"`` path's, bit for bit, at any EP degree. Every rank
of the group runs the same backward sequence (the same layers), so the barriers pair up and the epochs agree.

Nothing the backward reads comes from the megakernel's ring or a workspace buffer it left: it saves x, the combine
weights, the expert weights it was given, the schedule, the expert rows' copy and the kept g, u, h rows, and
rewrites every workspace buffer it reads.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_mok.kernels.grouped_ffn import wgrad_operands
from titan_mok.kernels.grouped_gemm import grouped_wgrads
from titan_mok.moe.dispatch import combine_weight_grads
from titan_mok.moe.fused import FusedHandle, fused_dispatch
from titan_mok.moe.megakernel import MegakernelConfig
from titan_mok.moe.megakernel_rank import megakernel_rank_dgrad, megakernel_rank_forward


class TokenRouting:
    """What the megakernel needs beside the token rows and the expert weights: the router's choice, the shared
    expert's output and the layer's output dtype.

    Not a dataclass: it is a forward argument of the experts module, and FSDP2 casts the floating-point tensors of
    those (dataclass fields included) to its parameter dtype, which would round the fp32 combine weights and gated
    shared output to bf16. FSDP leaves an object of a plain class as it is."""

    __slots__ = ("weights_TK", "topk_idx_TK", "shared_TH", "out_dtype")

    def __init__(self, weights_TK: torch.Tensor, topk_idx_TK: torch.Tensor, shared_TH: torch.Tensor | None,
                 out_dtype: torch.dtype):
        self.weights_TK = weights_TK
        """fp32 [T, K] combine weights."""
        self.topk_idx_TK = topk_idx_TK
        """int [T, K] expert ids in [0, E)."""
        self.shared_TH = shared_TH
        """The shared expert's output [T, H] (bf16, or fp32 when gated), added before the one rounding; None: none."""
        self.out_dtype = out_dtype
        """The layer's output dtype."""


@dataclass(frozen=True)
class ExpertPrecision:
    """The routed experts' GEMM precision and, under mxfp8, where their MXFP8 weight operands are kept
    (``grouped_swiglu_ffn``'s weights_owner and weight_sources): the forward launch reads the forward layouts kept
    there, the dgrad launch the dgrad layouts."""

    precision: str = "bf16"
    weights_owner: object = None
    weight_sources: tuple | None = None


class _MegakernelRoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, weights_TK, shared_TH, w_gate_LIH, w_up_LIH, w_down_LHI, topk_idx_TK, group, num_experts,
                swiglu_limit, out_dtype, config, experts_precision, keep_expert_rows, keep_ffn_rows):
        out_TH, handle, kept = megakernel_rank_forward(
            x_TH, weights_TK, topk_idx_TK, shared_TH, (w_gate_LIH, w_up_LIH, w_down_LHI), num_experts=num_experts,
            group=group, swiglu_limit=swiglu_limit, out_dtype=out_dtype, config=config,
            precision=experts_precision.precision, weights_owner=experts_precision.weights_owner,
            weight_sources=experts_precision.weight_sources, keep_rows=keep_ffn_rows,
        )
        y_TKH = None
        if keep_expert_rows:
            # the expert rows the finish summed, for the combine weights' gradient (module docstring)
            y_TKH = handle.workspace.slots_NH.view(handle.num_tokens, handle.top_k, -1).clone()
        gate_RI, up_RI, h_RI = kept if kept is not None else (None,) * 3
        ctx.save_for_backward(x_TH, weights_TK, w_gate_LIH, w_up_LIH, w_down_LHI, handle.group_end, handle.row_slot_R,
                              y_TKH, gate_RI, up_RI, h_RI)
        ctx.workspace, ctx.group, ctx.num_experts, ctx.config = handle.workspace, group, num_experts, config
        ctx.swiglu_limit, ctx.out_dtype, ctx.experts_precision = swiglu_limit, out_dtype, experts_precision
        ctx.shared_dtype = None if shared_TH is None else shared_TH.dtype
        ctx.mark_non_differentiable(handle.group_end)
        return out_TH, handle.group_end

    @staticmethod
    def backward(ctx, dout_TH, _dgroup_end):
        x_TH, weights_TK, w_gate_LIH, w_up_LIH, w_down_LHI, group_end_L, row_slot_R, y_TKH, *kept = ctx.saved_tensors
        needs = ctx.needs_input_grad
        needs_dx, needs_dweights, needs_dw = needs[0], needs[1], needs[3:6]
        dshared_TH = None if ctx.shared_dtype is None else dout_TH.to(ctx.shared_dtype)  # the fused combine's
        unused = (None,) * 9  # topk_idx, group, num_experts, swiglu_limit, out_dtype, config, precision, keeps
        if not (needs_dx or needs_dweights or any(needs_dw)):
            return None, None, dshared_TH, None, None, None, *unused
        num_tokens, top_k = weights_TK.shape
        handle = FusedHandle(num_tokens, top_k, row_slot_R, group_end_L, ctx.workspace)
        expert_weights = (w_gate_LIH, w_up_LIH, w_down_LHI)
        dx_TH, dweights_TK, *dw = _dgrad_launch_backward(ctx, dout_TH.contiguous(), x_TH, weights_TK, expert_weights,
                                                         handle, y_TKH, kept)
        return dx_TH, dweights_TK, dshared_TH, *dw, *unused


def _dgrad_launch_backward(ctx, dout_TH, x_TH, weights_TK, expert_weights, handle: FusedHandle, y_TKH, kept):
    """(dx, dweights, dw_gate, dw_up, dw_down), each None where not needed: through the dgrad launch on the forward's
    kept g, u, h rows, in the forward's precision (module docstring)."""
    needs_dx, needs_dweights, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3:6]
    # <dY[t], y[t, j]> in fp32, as the fused combine's backward
    dweights_TK = combine_weight_grads(dout_TH.float(), y_TKH) if needs_dweights else None
    if not (needs_dx or any(needs_dw)):
        return None, dweights_TK, None, None, None
    gate_RI, up_RI, h_RI = kept  # kept whenever x or an expert weight needs a gradient (megakernel_..._trainable)
    x_RH = fused_dispatch(x_TH, handle)  # the forward's rows in the schedule's order (grad mode is off here)
    mx = ctx.experts_precision
    dgrad = megakernel_rank_dgrad(dout_TH, weights_TK, gate_RI, up_RI, expert_weights, handle,
                                  num_experts=ctx.num_experts, group=ctx.group, swiglu_limit=ctx.swiglu_limit,
                                  config=ctx.config, precision=mx.precision,
                                  weights_owner=mx.weights_owner, weight_sources=mx.weight_sources)
    pairs = wgrad_operands(x_RH, h_RI, dgrad.dy_RH, dgrad.dgate_RI, dgrad.dup_RI).values()
    # MXFP8: grouped_wgrads quantizes both operands along the token axis per expert, as the Triton FFN's backward
    computed = grouped_wgrads([pair for pair, need in zip(pairs, needs_dw) if need], handle.group_end, mx.precision)
    dw = [next(computed) if need else None for need in needs_dw]
    return dgrad.dx_TH if needs_dx else None, dweights_TK, *dw


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
    # inside the Function's forward grad mode is off and needs_input_grad holds under no_grad too
    keep_expert_rows = torch.is_grad_enabled() and routing.weights_TK.requires_grad
    # the dgrad launch and the weight gradients read g, u, h: kept when dx or an expert weight's gradient is due
    keep_ffn_rows = torch.is_grad_enabled() and any(t.requires_grad for t in (x_TH, *expert_weights))
    return _MegakernelRoutedExperts.apply(
        x_TH, routing.weights_TK, routing.shared_TH, *expert_weights, routing.topk_idx_TK, group, num_experts,
        swiglu_limit, routing.out_dtype, config, experts_precision, keep_expert_rows, keep_ffn_rows,
    )
