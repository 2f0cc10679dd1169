"""The MoK schedule on device (docs/design.md, the fused path): every rank's top-k ids → this rank's grouped rows.

Legend: P ep degree, T tokens per rank, K top-k, N = T·K slots per rank, E experts,
L = E / P local experts, R = P·N row capacity (the worst case: every slot of every rank).

Input ``ids_PN`` (int32 [P, N]) holds every rank's expert ids, slot ``t·K + j`` of rank p at
``[p, t·K + j]`` (gathered from the peers' symmetric buffers). For ep rank ``rank`` (experts
``rank·L .. rank·L + L - 1``) the schedule is

- ``group_end_L`` (int32 [L]): cumulative rows per local expert;
- ``row_slot_R`` (int32 [R]): grouped row i comes from gathered slot ``row_slot[i] = p·N + t·K + j``;
  the rows of each local expert in ascending (source rank p, token t, slot j) order, i.e.
  ascending gathered index: the reference backend's order (``dispatch.build_dispatch_handle``).
  Entries at or past ``group_end[L-1]`` are not written.

The same list drives all four transfers (pull x, push y, pull dY, push dX). Counts stay on the
device: one program per local expert scans the ids in fixed blocks (the id count is a
compile-time constant: one compilation per batch shape) (count, then fill with a
prefix sum inside each block): fixed order, no atomics, no host sync. An id outside [0, E) is a
bug upstream (the router makes valid ids): the count kernel's device assert stops the run
instead of silently dropping the slot.
"""

import torch
import triton
import triton.language as tl

_BLOCK = 1024
"""Ids scanned per step of each expert's program."""


def ref_mok_schedule(ids_PN: torch.Tensor, rank: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(group_end_L int64, row_slot int64 [rows]) in plain PyTorch. NOTE: host sync (nonzero)."""
    flat_ids = ids_PN.reshape(-1).long()  # [P·N], gathered index p·N + t·K + j
    local_ids = flat_ids - rank * num_local
    mine = torch.nonzero((local_ids >= 0) & (local_ids < num_local)).squeeze(1)  # ascending index
    order = torch.sort(local_ids[mine], stable=True).indices  # by (local expert, index)
    group_end_L = torch.bincount(local_ids[mine], minlength=num_local).cumsum(0)
    return group_end_L, mine[order]


@triton.jit(debug=True)  # debug: the id-range device assert below is compiled in
def _count_kernel(ids_ptr, counts_ptr, first_expert, num_experts, NUM_IDS: tl.constexpr, BLOCK: tl.constexpr):
    local = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, NUM_IDS, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < NUM_IDS
        ids = tl.load(ids_ptr + offs, mask=ok, other=0)
        tl.device_assert((ids >= 0) & (ids < num_experts), "mok schedule: expert id outside [0, num_experts)")
        acc += (ok & (ids == first_expert + local)).to(tl.int32)
    tl.store(counts_ptr + local, tl.sum(acc, axis=0))


@triton.jit
def _fill_kernel(ids_ptr, counts_ptr, group_end_ptr, row_slot_ptr, first_expert, num_local,
                 NUM_IDS: tl.constexpr, BLOCK: tl.constexpr, L_POW2: tl.constexpr):
    local = tl.program_id(0)
    offs_l = tl.arange(0, L_POW2)
    counts = tl.load(counts_ptr + offs_l, mask=offs_l < num_local, other=0)
    row = tl.sum(tl.where(offs_l < local, counts, 0), axis=0)  # first row of this expert
    tl.store(group_end_ptr + local, row + tl.sum(tl.where(offs_l == local, counts, 0), axis=0))
    for start in range(0, NUM_IDS, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < NUM_IDS
        hit = (ok & (tl.load(ids_ptr + offs, mask=ok, other=-1) == first_expert + local)).to(tl.int32)
        rank_in_block = tl.cumsum(hit, axis=0) - 1  # ascending index within the block
        tl.store(row_slot_ptr + row + rank_in_block, offs, mask=hit > 0)
        row += tl.sum(hit, axis=0)


def mok_schedule(ids_PN: torch.Tensor, rank: int, num_local: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(group_end_L int32 [L], row_slot_R int32 [P·N]) for ep rank ``rank``; no host sync."""
    if ids_PN.dim() != 2 or ids_PN.dtype != torch.int32 or not ids_PN.is_contiguous():
        raise ValueError(f"mok_schedule: ids_PN must be contiguous int32 [P, N], got {ids_PN.dtype} {tuple(ids_PN.shape)}")
    num_ids = ids_PN.numel()
    if num_local <= 0 or num_experts < num_local * ids_PN.shape[0] or not 0 <= rank < ids_PN.shape[0]:
        raise ValueError(
            f"mok_schedule: rank {rank}, num_local {num_local}, num_experts {num_experts} do not fit P = {ids_PN.shape[0]}"
        )
    row_slot_R = torch.empty(num_ids, dtype=torch.int32, device=ids_PN.device)
    counts_L = torch.empty(num_local, dtype=torch.int32, device=ids_PN.device)
    group_end_L = torch.empty(num_local, dtype=torch.int32, device=ids_PN.device)
    first = rank * num_local
    _count_kernel[(num_local,)](ids_PN, counts_L, first, num_experts, NUM_IDS=num_ids, BLOCK=_BLOCK)
    _fill_kernel[(num_local,)](ids_PN, counts_L, group_end_L, row_slot_R, first, num_local,
                               NUM_IDS=num_ids, BLOCK=_BLOCK, L_POW2=triton.next_power_of_2(num_local))
    return group_end_L, row_slot_R
