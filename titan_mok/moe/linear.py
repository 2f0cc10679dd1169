"""Row-batch-invariant linear layer: ``y_MN = x_MK @ w_NK.T`` computed in
fixed-size row tiles.

A GEMM's reduction order may depend on its M (a one-row product takes a GEMV
path on CPU BLAS; cuBLAS picks split-K by shape). Running every product on
tiles of exactly ``TILE_M`` rows (the last one zero-padded) gives every row the
same kernel and so the same bits, whatever the batch around it: a token's
router logits and shared-expert output do not depend on its batch-mates or on
the EP degree (DESIGN §7). Weight gradients are one GEMM over all rows
(deterministic, not batch-invariant: they are sums over the batch anyway).

Legend: M rows, K reduction, N output features.
"""

import torch

TILE_M = 64
"""Rows per GEMM tile: every forward and input-gradient product has this M."""


def tiled_mm(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """``a_MK @ b_KN`` tile by tile (TILE_M rows per GEMM), row-batch-invariant."""
    num_rows = a_MK.shape[0]
    num_padded = -(-num_rows // TILE_M) * TILE_M
    if num_padded != num_rows:
        a_MK = torch.cat([a_MK, a_MK.new_zeros(num_padded - num_rows, a_MK.shape[1])])
    out_MN = a_MK.new_empty(num_padded, b_KN.shape[1])
    for start in range(0, num_padded, TILE_M):
        torch.mm(a_MK[start : start + TILE_M], b_KN, out=out_MN[start : start + TILE_M])
    return out_MN[:num_rows]


class _RowInvariantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_MK, w_NK)
        return tiled_mm(x_MK, w_NK.t())

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):
        x_MK, w_NK = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx_MK = tiled_mm(dy_MN, w_NK) if ctx.needs_input_grad[0] else None
        dw_NK = torch.mm(dy_MN.t(), x_MK) if ctx.needs_input_grad[1] else None
        return dx_MK, dw_NK


def row_invariant_linear(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """``x_MK @ w_NK.T`` (no bias); each output row's bits depend only on its input row."""
    if x_MK.dim() != 2 or w_NK.dim() != 2 or x_MK.shape[1] != w_NK.shape[1]:
        raise ValueError(f"row_invariant_linear: x {tuple(x_MK.shape)} and w {tuple(w_NK.shape)} must be [M, K] and [N, K]")
    if x_MK.dtype != w_NK.dtype:
        raise TypeError(f"row_invariant_linear: x is {x_MK.dtype} but w is {w_NK.dtype}; cast one of them first")
    return _RowInvariantLinear.apply(x_MK.contiguous(), w_NK)
