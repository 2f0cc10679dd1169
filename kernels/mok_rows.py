"""Row transfers of the MoK schedule over peer pointers: pull rows from, or push rows to, the
source ranks' symmetric buffers (docs/design.md, the fused path: dispatch, combine, backward).

Legend: R grouped rows (capacity), H hidden, P ep degree, N = T·K slots per rank, K top-k.

Grouped row i (i < ``group_end[L-1]``) belongs to gathered slot ``s = row_slot[i] = p·N + t·K + j``
(``kernels/mok_schedule.py``). Its remote row lives in rank p's buffer, whose address is
``table[p]`` (int64 [P], peer pointers from ``symm_mem.rendezvous``), at row
``(s mod N) // rows_div``: ``rows_div = K`` addresses a [T, H] token buffer (pull x),
``rows_div = 1`` a [T·K, H] slot buffer (push y, pull dY, push dX).

- pull: ``local[i] = remote[p][row]`` (forward dispatch, backward pull of dY);
- push: ``remote[p][row] = local[i]`` (forward combine, backward dX).

Each destination row is written by exactly one program (a permutation): no atomics. The grid
covers the row capacity; programs past the real row count (read on device) exit. Peer loads
and stores are plain NVLink accesses; the caller orders them with the workspace's barriers.
"""

import torch
import triton
import triton.language as tl

_ROWS, _BLOCK_H = 4, 1024
"""Rows per program and hidden columns per step: 16-byte accesses, 4K elements in flight."""


def ref_pull_rows(remote_PXH: list[torch.Tensor], row_slot: torch.Tensor, slots_per_rank: int, rows_div: int):
    """local [rows, H] with local[i] = remote[p][(s mod N) // rows_div] for s = row_slot[i]."""
    rows = [remote_PXH[s // slots_per_rank][(s % slots_per_rank) // rows_div] for s in row_slot.long().tolist()]
    return torch.stack(rows) if rows else remote_PXH[0][:0]


def ref_push_rows(local_RH: torch.Tensor, remote_PXH: list[torch.Tensor], row_slot: torch.Tensor, slots_per_rank: int):
    """remote[p][s mod N] = local[i] for s = row_slot[i] (in place)."""
    for i, s in enumerate(row_slot.long().tolist()):
        remote_PXH[s // slots_per_rank][s % slots_per_rank] = local_RH[i]


@triton.jit
def _move_rows_kernel(local_ptr, table_ptr, row_slot_ptr, group_end_ptr, num_local, capacity, slots_per_rank, rows_div,
                      H: tl.constexpr, PUSH: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    first = tl.program_id(0) * ROWS
    num_rows = tl.minimum(tl.load(group_end_ptr + num_local - 1), capacity)
    if first >= num_rows:
        return  # the grid covers the capacity
    rows = first + tl.arange(0, ROWS)
    ok = rows < num_rows
    slot = tl.load(row_slot_ptr + rows, mask=ok, other=0)
    src = slot // slots_per_rank
    remote_row = ((slot % slots_per_rank) // rows_div).to(tl.int64)
    base = tl.load(table_ptr + src, mask=ok, other=0)  # int64 addresses of the ranks' buffers
    remote_ptrs = base.to(local_ptr.dtype) + remote_row * H  # [ROWS] row pointers on the peers
    local_ptrs = local_ptr + rows.to(tl.int64) * H
    for h in range(0, H, BLOCK_H):
        cols = h + tl.arange(0, BLOCK_H)
        m = ok[:, None] & (cols < H)[None, :]
        if PUSH:
            tl.store(remote_ptrs[:, None] + cols[None, :], tl.load(local_ptrs[:, None] + cols[None, :], mask=m), mask=m)
        else:
            tl.store(local_ptrs[:, None] + cols[None, :], tl.load(remote_ptrs[:, None] + cols[None, :], mask=m), mask=m)


def move_rows(local_RH: torch.Tensor, table_P: torch.Tensor, row_slot_R: torch.Tensor, group_end_L: torch.Tensor,
              slots_per_rank: int, rows_div: int, *, push: bool) -> None:
    """Pull (``push=False``) rows into ``local_RH`` or push its rows out (module docstring); no host sync.

    local_RH: [R, H] contiguous, R = the row capacity (P·N; rows past the real count are untouched);
    table_P: int64 [P] buffer addresses, on local_RH's device; row_slot_R, group_end_L: the schedule.
    """
    if local_RH.dim() != 2 or not local_RH.is_contiguous():
        raise ValueError(f"move_rows: local_RH must be a contiguous [R, H] tensor, got {tuple(local_RH.shape)}")
    if table_P.dtype != torch.int64 or row_slot_R.dtype != torch.int32 or row_slot_R.numel() < local_RH.shape[0]:
        raise ValueError(
            f"move_rows: table_P must be int64 (got {table_P.dtype}) and row_slot_R int32 with >= {local_RH.shape[0]} "
            f"entries (got {row_slot_R.dtype} {tuple(row_slot_R.shape)})"
        )
    if local_RH.shape[0] == 0:
        return
    grid = (triton.cdiv(local_RH.shape[0], _ROWS),)
    _move_rows_kernel[grid](local_RH, table_P, row_slot_R, group_end_L, group_end_L.shape[0], local_RH.shape[0],
                            slots_per_rank,
                            rows_div, H=local_RH.shape[1], PUSH=push, ROWS=_ROWS, BLOCK_H=_BLOCK_H)
