"""Row-batch-invariant building blocks: every per-row computation runs on
tiles of exactly ``TILE_M`` rows (the last one zero-padded).

Why tiles: a GEMM's reduction order may depend on its M (a one-row product
takes a GEMV path on CPU BLAS; cuBLAS picks split-K by shape), and CPU
elementwise kernels switch between a vectorised and a scalar path (different
exp/log rounding) at positions that depend on the tensor's size. With one
fixed tile shape, every row meets the same kernels at the same positions, so
its bits do not depend on the batch around it or on the EP degree (docs/design.md, determinism).
Elementwise transcendentals that sit on a decode/trainer path without a row
structure run once on a flat tensor padded to a fixed multiple instead
(``pointwise_padded``: one kernel, no tail).
fp32 GEMMs on CUDA (the router's logits) run instead as one Triton launch whose
per-element FMA order is fixed (``row_linear``): invariant by construction, without a
launch per tile.
Weight gradients are one GEMM over all rows (deterministic; they are sums over
the batch, not per-row results).

Legend: M rows, K reduction, N output features.
"""

import torch
import torch.nn.functional as F

from titan_mok.kernels.row_linear import row_linear_fp32

TILE_M = 64
"""Rows per GEMM tile: every forward and input-gradient product has this M."""


def _pad_rows(x_M: torch.Tensor) -> torch.Tensor:
    num_padded = -(-x_M.shape[0] // TILE_M) * TILE_M
    if num_padded == x_M.shape[0]:
        return x_M
    return torch.cat([x_M, x_M.new_zeros(num_padded - x_M.shape[0], *x_M.shape[1:])])


def map_row_tiles(fn, *xs_M: torch.Tensor):
    """``fn`` (row-wise, plain autograd ops) applied tile by tile to the rows of xs_M
    (all with M rows); returns fn's tensor or tuple of tensors, M rows each."""
    num_rows = xs_M[0].shape[0]
    padded = [_pad_rows(x_M) for x_M in xs_M]
    outs = [fn(*(x[start : start + TILE_M] for x in padded)) for start in range(0, padded[0].shape[0], TILE_M)]
    if not outs:  # no rows: run fn once on an empty tile for the output shapes
        return fn(*(x[:0] for x in xs_M))
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts)[:num_rows] for parts in zip(*outs))
    return torch.cat(outs)[:num_rows]


def tiled_mm(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """``a_MK @ b_KN`` tile by tile (TILE_M rows per GEMM), row-batch-invariant."""
    num_rows = a_MK.shape[0]
    a_MK = _pad_rows(a_MK)
    out_MN = a_MK.new_empty(a_MK.shape[0], b_KN.shape[1])
    for start in range(0, a_MK.shape[0], TILE_M):
        torch.mm(a_MK[start : start + TILE_M], b_KN, out=out_MN[start : start + TILE_M])
    return out_MN[:num_rows]


def row_invariant_mm(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """``a_MK @ b_KN``, row-batch-invariant: fp32 on CUDA in one Triton launch (kernels/row_linear.py says
    why), else on row tiles."""
    if a_MK.is_cuda and a_MK.dtype == torch.float32 and b_KN.dtype == torch.float32:
        return row_linear_fp32(a_MK, b_KN)
    return tiled_mm(a_MK, b_KN)


class _RowInvariantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_MK, w_NK)
        return row_invariant_mm(x_MK, w_NK.t())

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):
        x_MK, w_NK = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx_MK = row_invariant_mm(dy_MN, w_NK) if ctx.needs_input_grad[0] else None
        dw_NK = torch.mm(dy_MN.t(), x_MK) if ctx.needs_input_grad[1] else None
        return dx_MK, dw_NK


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast runs x's matmuls in where it is on for x's device, else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def row_invariant_linear(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """``x_MK @ w_NK.T`` (no bias); each output row's bits depend only on its input row."""
    if x_MK.dim() != 2 or w_NK.dim() != 2 or x_MK.shape[1] != w_NK.shape[1]:
        raise ValueError(f"row_invariant_linear: x {tuple(x_MK.shape)} and w {tuple(w_NK.shape)} must be [M, K] and [N, K]")
    if x_MK.dtype != w_NK.dtype:
        raise TypeError(f"row_invariant_linear: x is {x_MK.dtype} but w is {w_NK.dtype}; cast one of them first")
    return _RowInvariantLinear.apply(x_MK.contiguous(), w_NK)


POINTWISE_MULTIPLE = 256
"""``pointwise_padded`` pads to a multiple of this many elements: a multiple of the CPU
vector loops' step (two vectors: 32 fp32 or 64 bf16 elements with AVX-512)."""


def pointwise_padded(fn, x: torch.Tensor) -> torch.Tensor:
    """An elementwise ``fn`` (SiLU, sigmoid, softplus) on x flattened and zero-padded to a
    multiple of ``POINTWISE_MULTIPLE`` elements. CPU kernels finish a tensor's tail (numel
    mod two vectors) with scalar code whose transcendentals can differ from the vectorised
    body's in the last bit, so a value's bits would depend on where it sits in the tensor;
    with no tail every element meets the same code (one thread: threads split the loop at
    size-dependent points)."""
    flat = x.reshape(-1)  # [numel]
    pad = (-flat.numel()) % POINTWISE_MULTIPLE
    return fn(F.pad(flat, (0, pad)) if pad else flat)[: flat.numel()].view(x.shape)
