"""The mok expert-parallel schedule, reference backend: dispatch and combine.

Legend: T local tokens, K top-k, H hidden, E experts, L local experts
(E / ep), R rows received by this rank (grouped by local expert), P ep degree.

The mok strategy's semantics (docs/design.md), in plain PyTorch with ``all_to_all_single`` (gloo on CPU,
NCCL on GPU):
- ``build_dispatch_handle`` (the schedule): each rank's rows (token, slot) go
  to the rank owning their expert; on the owner, the rows of each local expert
  are ordered by (source rank, source token, slot). Everything that follows
  reads this one handle (DeepEP style: dispatch returns it, combine consumes it).
- ``dispatch`` (forward: rows to experts; backward: each row's gradient back to
  its source, summed over the token's slots in ascending slot order in fp32).
- ``combine`` (forward: each result row back to its own (token, slot) combine
  slot, then y[t] = Σ_j w[t,j]·row[t,j] in ascending j, in fp32, + shared[t],
  cast once; backward: dY·w back to the expert rows, <dY, row> to the weights).
Every index operation is a permutation (each destination written once): no
atomics and no accumulation order left to the hardware. With P = 1 there is no
communication and the same code is the single-process layer, which is why EP
outputs are bitwise equal to it.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_mok.kernels.mok_combine import ref_slot_reduce, ref_slot_scale
from titan_mok.kernels.row_tiles import map_row_tiles



@dataclass
class DispatchHandle:
    """Layout of one dispatch; ``combine`` and both backwards read it."""

    num_tokens: int
    """T: tokens on this rank."""
    top_k: int
    """K: slots per token."""
    send_order: torch.Tensor
    """[T·K] int64: slot ids (t·K + j) in send order, sorted by (expert, token, slot)."""
    send_splits: list[int]
    """Rows sent to each ep rank (host ints)."""
    recv_splits: list[int]
    """Rows received from each ep rank (host ints)."""
    recv_to_grouped: torch.Tensor
    """[R] int64: grouped row i is received row ``recv_to_grouped[i]``."""
    group_end: torch.Tensor
    """[L] int64: cumulative rows per local expert, on device."""
    group: dist.ProcessGroup | None
    """The ep process group; None: no expert parallelism (P = 1)."""


def _all_to_all(x_RH: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    if group is None:
        return x_RH
    out_RH = x_RH.new_empty(sum(out_splits), *x_RH.shape[1:])
    dist.all_to_all_single(out_RH, x_RH.contiguous(), out_splits, in_splits, group=group)
    return out_RH


def _permute_back(rows_RH: torch.Tensor, order_R: torch.Tensor) -> torch.Tensor:
    """Inverse of ``rows_RH[order_R]``: out[order_R[i]] = rows_RH[i] (a permutation)."""
    out_RH = torch.empty_like(rows_RH)
    out_RH[order_R] = rows_RH
    return out_RH


def _gather_counts(counts_E: torch.Tensor, group) -> torch.Tensor:
    """[P, E]: every ep rank's rows per expert (the schedule's input)."""
    if group is None:
        return counts_E.unsqueeze(0)
    parts = [torch.empty_like(counts_E) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, counts_E, group=group)
    return torch.stack(parts)


def build_dispatch_handle(
    topk_idx_TK: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None, max_rows_per_rank: int | None
) -> DispatchHandle:
    """The schedule. Every rank sees every rank's counts, so an overflow raises the
    same error on all ranks. NOTE: host sync (the split sizes); the fused path sizes
    its buffers for the worst case instead and reads the counts on device."""
    num_tokens, top_k = topk_idx_TK.shape
    ep_degree, ep_rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    num_local = num_experts // ep_degree
    flat_idx_R = topk_idx_TK.reshape(-1)  # [T·K], slot id t·K + j
    send_order = torch.sort(flat_idx_R, stable=True).indices  # by (expert, token, slot)
    counts_PPL = _gather_counts(torch.bincount(flat_idx_R, minlength=num_experts), group).view(
        ep_degree, ep_degree, num_local
    )  # [source rank, destination rank, local expert]
    recv_counts_PL = counts_PPL[:, ep_rank]  # [source rank, local expert]

    rows_per_rank = counts_PPL.sum(dim=(0, 2)).tolist()
    capacity = max_rows_per_rank if max_rows_per_rank is not None else sum(rows_per_rank)
    if max(rows_per_rank) > capacity:
        worst = max(range(ep_degree), key=rows_per_rank.__getitem__)
        raise RuntimeError(
            f"MoE dispatch overflow: ep rank {worst} receives {rows_per_rank[worst]} rows but its buffer holds "
            f"max_rows_per_rank = {capacity}; raise MoEArgs.max_rows_per_rank (rows are never dropped)"
        )
    send_splits = counts_PPL[ep_rank].sum(dim=1).tolist()
    recv_splits = recv_counts_PL.sum(dim=1).tolist()
    num_recv = rows_per_rank[ep_rank]
    # Received rows come by source rank, each source's rows by (local expert, token, slot);
    # a stable sort by local expert makes them (local expert, source rank, token, slot).
    local_ids = torch.arange(num_local, device=topk_idx_TK.device).repeat(ep_degree)  # [P·L]
    recv_expert_R = torch.repeat_interleave(local_ids, recv_counts_PL.reshape(-1), output_size=num_recv)
    recv_to_grouped = torch.sort(recv_expert_R, stable=True).indices
    group_end = recv_counts_PL.sum(dim=0).cumsum(dim=0)
    return DispatchHandle(num_tokens, top_k, send_order, send_splits, recv_splits, recv_to_grouped, group_end, group)


def combine_weight_grads(dout32_TH: torch.Tensor, y_TKH: torch.Tensor) -> torch.Tensor:
    """d(combine)/d(weights): [T, K] = Σ_h dout[t, h] · y[t, j, h] in fp32, on row tiles."""
    return map_row_tiles(lambda dout, y: (dout.unsqueeze(1) * y.float()).sum(dim=-1), dout32_TH, y_TKH)


def shared_output(shared):
    """The shared expert's output for the combine: ``shared`` itself (a tensor or None), or what it returns when it
    is a function (the layer passes one so that the shared expert runs after the routed experts are launched)."""
    return shared() if callable(shared) else shared


class _Dispatch(torch.autograd.Function):
    """dispatch(x_TH, handle): token rows to their experts' ranks, [T, H] → [R, H] grouped by local expert."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        ctx.handle = handle
        rows_send_RH = x_TH[handle.send_order // handle.top_k]  # [T·K, H] in send order
        rows_recv_RH = _all_to_all(rows_send_RH, handle.recv_splits, handle.send_splits, handle.group)
        return rows_recv_RH[handle.recv_to_grouped]  # [R, H] grouped by local expert

    @staticmethod
    def backward(ctx, drows_RH: torch.Tensor):
        handle = ctx.handle
        drows_recv_RH = _permute_back(drows_RH, handle.recv_to_grouped)
        drows_send_RH = _all_to_all(drows_recv_RH, handle.send_splits, handle.recv_splits, handle.group)
        dslots_TKH = _permute_back(drows_send_RH, handle.send_order).view(handle.num_tokens, handle.top_k, -1)
        return ref_slot_reduce(dslots_TKH, None, None, drows_RH.dtype), None


class _Combine(torch.autograd.Function):
    """combine(y_RH, weights_TK, shared_TH, handle, out_dtype): expert results back to their (token, slot) and
    reduced, [R, H] → [T, H] in out_dtype."""

    @staticmethod
    def forward(ctx, y_RH, weights_TK, shared_TH, handle: DispatchHandle, out_dtype: torch.dtype):
        y_recv_RH = _permute_back(y_RH, handle.recv_to_grouped)
        y_send_RH = _all_to_all(y_recv_RH, handle.send_splits, handle.recv_splits, handle.group)
        y_TKH = _permute_back(y_send_RH, handle.send_order).view(handle.num_tokens, handle.top_k, -1)
        ctx.save_for_backward(y_TKH, weights_TK)
        ctx.handle, ctx.has_shared = handle, shared_TH is not None
        ctx.shared_dtype = None if shared_TH is None else shared_TH.dtype
        return ref_slot_reduce(y_TKH, weights_TK, shared_TH, out_dtype)

    @staticmethod
    def backward(ctx, dout_TH: torch.Tensor):
        y_TKH, weights_TK = ctx.saved_tensors
        handle = ctx.handle
        dout32_TH = dout_TH.float()
        dweights_TK = combine_weight_grads(dout32_TH, y_TKH)
        dy_TKH = ref_slot_scale(weights_TK, dout32_TH, y_TKH.dtype)
        dy_send_RH = dy_TKH.view(-1, dy_TKH.shape[-1])[handle.send_order]
        dy_recv_RH = _all_to_all(dy_send_RH, handle.recv_splits, handle.send_splits, handle.group)
        dy_RH = dy_recv_RH[handle.recv_to_grouped]
        dshared_TH = dout_TH.to(ctx.shared_dtype) if ctx.has_shared else None
        return dy_RH, dweights_TK, dshared_TH, None, None


dispatch = _Dispatch.apply
combine = _Combine.apply
