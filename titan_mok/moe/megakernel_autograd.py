"""``[mok] kernels = "megakernel"``: the routed experts' forward through the MoK megakernel
(``titan_mok.moe.megakernel.megakernel_routed_experts``, one rank), with a backward, so that it trains.

Legend: T tokens, K top-k, N = T·K slots, R = N rows grouped by expert (one rank: every slot is one row),
H hidden, I expert FFN size, E experts.

Forward: ``out[t] = cast(shared[t] + Σ_j w[t,j]·expert_{e[t,j]}(x[t]))``, the megakernel's one persistent
launch plus its finish, bitwise the ``"triton"`` path's (``titan_mok.moe.fused``) output. Beside it, the
schedule (``kernels/mok_schedule.py``, the same the megakernel builds inside: rows grouped by expert, in
(token, slot) order) is kept for the backward and for the experts' row count.

Backward: the megakernel keeps nothing of its forward: its gate/up/SwiGLU values live in a workspace that
every layer of the same shape reuses, and it writes no per-row output (rows go straight into the combine
slots). So the backward recomputes the FFN forward on the grouped rows rebuilt from the saved input and
schedule (the Triton grouped FFN, ``kernels/grouped_ffn.py``: its output rows are the megakernel's bits),
then runs that FFN's backward and the fused path's reductions in the fused path's order:
``combine_weight_grads`` for the combine weights, ``slot_scale`` for w·dY, ``slot_reduce`` (ascending
slot, fp32) for dx; the shared output's gradient is dY in its dtype. Every gradient is bitwise the
``"triton"`` path's. The recomputation costs one FFN forward per backward and saves the g, u, h and
row activations the ``"triton"`` path keeps from forward to backward.

Nothing the backward reads comes from the megakernel's workspace: it saves x, the combine weights, the
bf16 expert weights it was given and the schedule.
"""

from dataclasses import dataclass

import torch

from titan_mok.kernels.grouped_ffn import grouped_swiglu_ffn
from titan_mok.kernels.mok_combine import slot_reduce, slot_scale
from titan_mok.kernels.mok_schedule import mok_schedule
from titan_mok.moe.dispatch import combine_weight_grads
from titan_mok.moe.megakernel import MegakernelConfig, megakernel_routed_experts


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


class _MegakernelRoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, weights_TK, shared_TH, w_gate_EIH, w_up_EIH, w_down_EHI, topk_idx_TK, group_end_E,
                row_slot_N, swiglu_limit, out_dtype, config):
        out_TH = megakernel_routed_experts(
            x_TH, weights_TK, topk_idx_TK, shared_TH, (w_gate_EIH, w_up_EIH, w_down_EHI),
            num_experts=w_gate_EIH.shape[0], swiglu_limit=swiglu_limit, out_dtype=out_dtype, config=config,
        )
        ctx.save_for_backward(x_TH, weights_TK, w_gate_EIH, w_up_EIH, w_down_EHI, group_end_E, row_slot_N)
        ctx.swiglu_limit = swiglu_limit
        ctx.shared_dtype = None if shared_TH is None else shared_TH.dtype
        return out_TH

    @staticmethod
    def backward(ctx, dout_TH):
        x_TH, weights_TK, w_gate_EIH, w_up_EIH, w_down_EHI, group_end_E, row_slot_N = ctx.saved_tensors
        needs_dx, needs_dweights, _, *needs_dw = ctx.needs_input_grad[:6]
        ffn_needs = [needs_dx, *needs_dw]  # through the FFN: its rows, w_gate, w_up, w_down
        num_tokens, top_k = weights_TK.shape
        dout_TH = dout_TH.contiguous()
        dshared_TH = None if ctx.shared_dtype is None else dout_TH.to(ctx.shared_dtype)
        unused = (None,) * 6  # topk_idx, group_end, row_slot, swiglu_limit, out_dtype, config
        if not (needs_dweights or any(ffn_needs)):
            return None, None, dshared_TH, None, None, None, *unused
        rows_of_slots_N = _inverse_permutation(row_slot_N)

        def to_slots(rows_NH):  # grouped rows → [T, K, H] by (token, slot): the fused path's push
            return rows_NH.index_select(0, rows_of_slots_N).view(num_tokens, top_k, -1)

        with torch.enable_grad():
            # grouped row i is token row_slot[i] // K (the fused path's pull)
            x_RH = x_TH.detach().index_select(0, row_slot_N // top_k).requires_grad_(needs_dx)
            weights = [w.detach().requires_grad_(need) for w, need in zip((w_gate_EIH, w_up_EIH, w_down_EHI),
                                                                            needs_dw)]
            y_RH = grouped_swiglu_ffn(x_RH, group_end_E, *weights, swiglu_limit=ctx.swiglu_limit, use_triton=True)
        # <dY[t], row[t, j]> in fp32, as the fused combine's backward
        dweights_TK = combine_weight_grads(dout_TH.float(), to_slots(y_RH.detach())) if needs_dweights else None
        grads = [None] * 4
        if any(ffn_needs):
            dy_TKH = dout_TH.new_empty(num_tokens, top_k, dout_TH.shape[1], dtype=x_TH.dtype)
            slot_scale(weights_TK.contiguous(), dout_TH, dy_TKH)  # w·dY per (token, slot)
            dy_RH = dy_TKH.view(num_tokens * top_k, -1).index_select(0, row_slot_N)
            del dy_TKH
            inputs = [t for t, need in zip((x_RH, *weights), ffn_needs) if need]
            computed = iter(torch.autograd.grad(y_RH, inputs, dy_RH))
            grads = [next(computed) if need else None for need in ffn_needs]
        dx_RH, *dw = grads
        # each row's gradient to its (token, slot), then the sum over slots in ascending order, in fp32
        dx_TH = slot_reduce(to_slots(dx_RH), None, None, x_TH.dtype) if needs_dx else None
        return dx_TH, dweights_TK, dshared_TH, *dw, *unused


def _inverse_permutation(row_slot_N: torch.Tensor) -> torch.Tensor:
    """rows_of_slots[s] = the grouped row of slot s (one rank: the schedule is a permutation of the N slots)."""
    positions_N = torch.arange(row_slot_N.shape[0], dtype=row_slot_N.dtype, device=row_slot_N.device)
    return torch.empty_like(row_slot_N).scatter_(0, row_slot_N.long(), positions_N)


def megakernel_routed_experts_trainable(
    x_TH: torch.Tensor,
    routing: TokenRouting,
    expert_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    swiglu_limit: float | None,
    config: MegakernelConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_TH [T, H] in routing.out_dtype, group_end_E int32 [E]): the routed experts combined with the shared
    output on one rank (module docstring), differentiable in x, the combine weights, the shared output and the
    expert weights (bf16, contiguous: w_gate, w_up [E, I, H], w_down [E, H, I]). No host sync."""
    num_experts = expert_weights[0].shape[0]
    ids_1N = routing.topk_idx_TK.reshape(1, -1).to(torch.int32).contiguous()
    group_end_E, row_slot_N = mok_schedule(ids_1N, 0, num_experts, num_experts)
    out_TH = _MegakernelRoutedExperts.apply(
        x_TH, routing.weights_TK, routing.shared_TH, *expert_weights, routing.topk_idx_TK, group_end_E, row_slot_N,
        swiglu_limit, routing.out_dtype, config,
    )
    return out_TH, group_end_E
