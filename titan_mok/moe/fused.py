"""The mok EP backend's GPU path (``[mok] kernels = "triton"``): dispatch and combine over
symmetric memory with Triton kernels, behind the reference backend's seam.

Legend: T tokens per rank, K top-k, H hidden, I expert FFN size, E experts, L local experts,
P ep degree, N = T·K slots per rank, R = P·N row capacity (grouped rows, worst case).

Same contract as ``titan_mok.moe.dispatch`` (the reference): ``build_fused_handle`` is the
schedule, ``fused_dispatch`` maps [T, H] → [R, H] rows grouped by (local expert, source rank,
token, slot), ``fused_combine`` maps them back and reduces, and both backwards mirror them.
Results are bitwise those of the reference's dispatch/combine (same permutation, same fp32
order); the row buffers are sized R (the worst case) instead of the host-known count, so rows
at or past ``group_end[L-1]`` are padding, which the grouped FFN skips.

Per layer call (each step between workspace barriers, all on the current stream, no host sync):
  forward   ids → own buffer | barrier | gather ids, schedule kernel (kernels/mok_schedule.py)
            x → own buffer | barrier | pull rows from the source ranks (kernels/mok_rows.py)
            the layer's RoutedExperts module: Triton grouped FFN (kernels/grouped_ffn.py, bf16 or
            mxfp8; its tile map keeps every GEMM tile inside one expert, so the schedule's rows
            are contiguous per expert rather than padded)
            push each result row to its source's slot (token, slot) | barrier |
            fp32 ordered slot reduction + shared expert (kernels/mok_combine.py)
  backward  w·dY → own dY buffer | barrier | pull dY rows; expert dgrad/wgrad (grouped FFN);
            push each row gradient to its source's slot | barrier | fp32 ordered slot sum → dX
Not fused: these are separate kernel launches (schedule ×2, pull, 3 FFN GEMMs, push, reduce),
not one persistent kernel with readiness flags; communication and compute do not overlap. MXFP8
quantization of the activations happens in the grouped GEMM's tile loads, not during the pull
(rows cross NVLink in bf16). The only device-side waits are the workspace barriers (bounded, then
a device error); the kernels themselves never spin.

Requirements: every rank of the EP group calls with the same T, K, H and dtype (symmetric
buffers), and ``MoEArgs.max_rows_per_rank`` is None (capacity = the worst case).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_mok.kernels.mok_combine import slot_reduce, slot_scale
from titan_mok.kernels.mok_rows import move_rows
from titan_mok.kernels.mok_schedule import mok_schedule
from titan_mok.moe.dispatch import combine_weight_grads, shared_output
from titan_mok.moe.workspace import MokWorkspace, get_workspace


@dataclass
class FusedHandle:
    """The schedule of one layer call on this rank; dispatch, combine and both backwards read it."""

    num_tokens: int
    top_k: int
    row_slot_R: torch.Tensor
    """int32 [R]: grouped row i comes from gathered slot p·N + t·K + j (kernels/mok_schedule.py)."""
    group_end: torch.Tensor
    """int32 [L]: cumulative rows per local expert, on device."""
    workspace: MokWorkspace


def build_fused_handle(
    topk_idx_TK: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None,
    dim: int,
    dtype: torch.dtype,
    max_rows_per_rank: int | None = None,
) -> FusedHandle:
    """The schedule, on device: every rank's ids gathered through symmetric memory, then sorted
    into this rank's rows. Every rank of ``group`` calls it with the same T, K, H and dtype."""
    num_tokens, top_k = topk_idx_TK.shape
    ep_degree = 1 if group is None else dist.get_world_size(group)
    capacity = ep_degree * num_tokens * top_k
    if max_rows_per_rank is not None and max_rows_per_rank < capacity:
        raise ValueError(
            f"MoEArgs.max_rows_per_rank = {max_rows_per_rank}: the triton kernels size the receive buffers for the "
            f"worst case ({ep_degree}·{num_tokens}·{top_k} = {capacity} rows) so that counts stay on the device; "
            "set it to None (or >= that) with kernels = 'triton'"
        )
    if num_experts % ep_degree:
        raise ValueError(f"num_experts = {num_experts} must be a multiple of the ep degree {ep_degree}")
    ws = get_workspace(group, num_tokens, top_k, dim, dtype, topk_idx_TK.device)
    ws.ids_N.copy_(topk_idx_TK.reshape(-1))  # int64 → int32, slot t·K + j
    ids_PN = torch.empty(ep_degree, num_tokens * top_k, dtype=torch.int32, device=topk_idx_TK.device)
    ws.barrier()
    ws.gather_ids(ids_PN)
    num_local = num_experts // ep_degree
    group_end_L, row_slot_R = mok_schedule(ids_PN, ws.ep_rank, num_local, num_experts)
    return FusedHandle(num_tokens, top_k, row_slot_R, group_end_L, ws)


def _move(handle: FusedHandle, rows_RH: torch.Tensor, buffer: str, *, push: bool) -> None:
    rows_div = handle.top_k if buffer == "x_TH" else 1  # token buffer [T, H] or slot buffer [N, H]
    move_rows(rows_RH, handle.workspace.tables[buffer], handle.row_slot_R, handle.group_end,
              handle.num_tokens * handle.top_k, rows_div, push=push)


def _empty_rows(handle: FusedHandle, like_TH: torch.Tensor) -> torch.Tensor:
    return like_TH.new_empty(handle.row_slot_R.shape[0], like_TH.shape[1])  # [R, H], R = capacity


class _FusedDispatch(torch.autograd.Function):
    """fused_dispatch(x_TH, handle): token rows to their experts' ranks, [T, H] → [R, H] grouped by local expert
    (R = capacity)."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, handle: FusedHandle) -> torch.Tensor:
        ctx.handle = handle
        ws = handle.workspace
        ws.x_TH.copy_(x_TH)
        ws.barrier()
        x_RH = _empty_rows(handle, x_TH)
        _move(handle, x_RH, "x_TH", push=False)  # pull from the source ranks
        return x_RH

    @staticmethod
    def backward(ctx, dx_RH: torch.Tensor):
        handle = ctx.handle
        ws = handle.workspace
        _move(handle, dx_RH.contiguous(), "slots_NH", push=True)  # each row's gradient to its (token, slot)
        ws.barrier()
        slots_TKH = ws.slots_NH.view(handle.num_tokens, handle.top_k, -1)  # [N, H] → [T, K, H]
        return slot_reduce(slots_TKH, None, None, dx_RH.dtype), None


class _FusedCombine(torch.autograd.Function):
    """fused_combine(y_RH, weights_TK, shared_TH, handle, out_dtype): expert results back to their (token, slot)
    and reduced, [R, H] → [T, H] in out_dtype."""

    @staticmethod
    def forward(ctx, y_RH, weights_TK, shared_TH, handle: FusedHandle, out_dtype: torch.dtype):
        ws = handle.workspace
        _move(handle, y_RH.contiguous(), "slots_NH", push=True)  # each result row to its (token, slot)
        ws.barrier()
        slots_TKH = ws.slots_NH.view(handle.num_tokens, handle.top_k, -1)  # [N, H] → [T, K, H]
        y_TKH = torch.empty_like(slots_TKH) if weights_TK.requires_grad else None  # kept for dweights
        out_TH = slot_reduce(slots_TKH, weights_TK.contiguous(), shared_TH, out_dtype, copy_TKH=y_TKH)
        ctx.save_for_backward(y_TKH, weights_TK)
        ctx.handle, ctx.row_dtype = handle, y_RH.dtype
        ctx.shared_dtype = None if shared_TH is None else shared_TH.dtype
        return out_TH

    @staticmethod
    def backward(ctx, dout_TH: torch.Tensor):
        y_TKH, weights_TK = ctx.saved_tensors
        handle = ctx.handle
        ws = handle.workspace
        dout_TH = dout_TH.contiguous()
        dweights_TK = None
        if y_TKH is not None:  # the reference's expression, row tile by row tile (bitwise equal)
            dweights_TK = combine_weight_grads(dout_TH.float(), y_TKH)
        slot_scale(weights_TK.contiguous(), dout_TH, ws.dy_NH.view(handle.num_tokens, handle.top_k, -1))
        ws.barrier()
        dy_RH = dout_TH.new_empty(handle.row_slot_R.shape[0], dout_TH.shape[1], dtype=ctx.row_dtype)
        _move(handle, dy_RH, "dy_NH", push=False)  # pull w·dY from the source ranks
        dshared_TH = None if ctx.shared_dtype is None else dout_TH.to(ctx.shared_dtype)
        return dy_RH, dweights_TK, dshared_TH, None, None


fused_dispatch = _FusedDispatch.apply
fused_combine = _FusedCombine.apply


def fused_routed_experts(
    x_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    shared: torch.Tensor | Callable[[], torch.Tensor] | None,
    group: dist.ProcessGroup | None,
    experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    num_experts: int,
    max_rows_per_rank: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """schedule → dispatch → experts → combine; [T, H] → [T, H] in out_dtype (None: x's dtype).

    ``experts(x_RH, group_end_L) -> y_RH`` is the layer's routed-experts module (its forward runs
    the Triton grouped FFN, ``kernels/grouped_ffn.py``, and lets FSDP gather its weights); ``shared`` the
    shared expert's output, None, or a function returning it (called after the experts' launch)."""
    handle = build_fused_handle(topk_idx_TK, num_experts, group, x_TH.shape[1], x_TH.dtype, max_rows_per_rank)
    y_RH = experts(fused_dispatch(x_TH, handle), handle.group_end)
    return fused_combine(y_RH, weights_TK, shared_output(shared), handle, out_dtype or x_TH.dtype)
