"""Both MXFP8 layouts of an expert weight from one read of it, beside its reference.

MXFP8 training reads each routed-expert weight w [E, X, Y] in two layouts: the forward's, blocked along Y
(``mxfp8_quantize(w, 2)``), and the dgrad's, blocked along X and stored transposed
(``mxfp8_quantize_transposed(w)``). Made by those two, w is read twice. ``mxfp8_quantize_both`` loads each
[BX, BY] tile of w once and quantizes it both ways from the same registers: the row blocks (32 along Y)
and the column blocks (32 along X) of a tile whose sides are multiples of 32 are whole inside it. Every
block goes through ``mx_quantize_block`` and ``mx_store_bits``, the single-layout kernels' rule, so the
outputs are those kernels' bits (``ref_mxfp8_quantize_both``: the definition, through ``to_mxfp8``).

Legend: E experts, X, Y the stored weight's dims (w_gate/w_up [E, I, H], w_down [E, H, I]), both
multiples of 32; BX, BY a tile's sides.
"""

import triton
import triton.language as tl
import torch

from titan_mok.kernels.mxfp8 import BLOCK, SCALE_DTYPE, MXTensor, _check_blockable, to_mxfp8
from titan_mok.kernels.mxfp8_quant import mx_quantize_block, mx_store_bits, mx_to_mma_order

# (BX, BY, warps) of a program: a guess not yet timed on a GPU; benchmarks/tools/quantize_weights.py times it
# against other tiles
DEFAULT_TILE = (64, 128, 4)


def ref_mxfp8_quantize_both(w_EXY: torch.Tensor, name: str = "w", mma_order: bool = False):
    """(blocked along Y: data, scales [E, X, Y], [E, X, Y/32]; blocked along X, stored transposed: data, scales
    [E, Y, X], [E, Y, X/32]), both MXTensors with ``dim`` 2."""
    return to_mxfp8(w_EXY, 2, name, mma_order), to_mxfp8(w_EXY.transpose(1, 2), 2, name, mma_order)


@triton.jit
def _mx_quant_both_kernel(
    # w [E, X, Y] contiguous; rows_q [E, X, Y], rows_s [E, X, Y/32]; cols_q [E, Y, X], cols_s [E, Y, X/32] uint8
    w_ptr, rows_q_ptr, rows_s_ptr, cols_q_ptr, cols_s_ptr,
    X, Y,
    BX: tl.constexpr, BY: tl.constexpr, MMA_ORDER: tl.constexpr,
):
    i_e = tl.program_id(2).to(tl.int64)
    o_x = tl.program_id(1) * BX + tl.arange(0, BX)
    o_y = tl.program_id(0) * BY + tl.arange(0, BY)
    o_sx = tl.program_id(1) * (BX // 32) + tl.arange(0, BX // 32)
    o_sy = tl.program_id(0) * (BY // 32) + tl.arange(0, BY // 32)
    m = (o_x[:, None] < X) & (o_y[None, :] < Y)
    base = i_e * X * Y  # elements before expert i_e, in w and in both data outputs
    w = tl.load(w_ptr + base + o_x[:, None] * Y + o_y[None, :], mask=m, other=0.0).to(tl.float32)

    # blocked along Y (the rows kernel's rule): data [X, Y], scales [X, Y/32]
    q, e, bad = mx_quantize_block(tl.reshape(w, (BX, BY // 32, 32)), 2)
    q_bits, s_bits = mx_store_bits(q, e, bad)
    q_bits = tl.reshape(q_bits, (BX, BY))
    if MMA_ORDER:
        q_bits = mx_to_mma_order(q_bits, 1, BX, BY)
    tl.store(rows_q_ptr + base + o_x[:, None] * Y + o_y[None, :], q_bits, mask=m)
    m_s = (o_x[:, None] < X) & (o_sy[None, :] < Y // 32)
    tl.store(rows_s_ptr + i_e * X * (Y // 32) + o_x[:, None] * (Y // 32) + o_sy[None, :],
             tl.reshape(s_bits, (BX, BY // 32)), mask=m_s)

    # blocked along X (the columns kernel's rule), stored transposed: data [Y, X], scales [Y, X/32]
    q, e, bad = mx_quantize_block(tl.reshape(w, (BX // 32, 32, BY)), 1)
    q_bits, s_bits = mx_store_bits(q, e, bad)
    q_bits = tl.reshape(q_bits, (BX, BY))
    if MMA_ORDER:
        q_bits = mx_to_mma_order(q_bits, 0, BX, BY)
    tl.store(cols_q_ptr + base + o_y[None, :] * X + o_x[:, None], q_bits, mask=m)
    m_s = (o_sx[:, None] < X // 32) & (o_y[None, :] < Y)
    tl.store(cols_s_ptr + i_e * (X // 32) * Y + o_y[None, :] * (X // 32) + o_sx[:, None],
             tl.reshape(s_bits, (BX // 32, BY)), mask=m_s)


def _check_tile(tile) -> tuple[int, int, int]:
    bx, by, warps = tile
    for key, v in (("BX", bx), ("BY", by)):
        if v < BLOCK or v & (v - 1):
            raise ValueError(f"mxfp8_quantize_both: tile {key} must be a power of two >= {BLOCK}, got {v}")
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"mxfp8_quantize_both: tile warps must be one of 1, 2, 4, 8, 16, got {warps}")
    return bx, by, warps


def mxfp8_quantize_both(w_EXY: torch.Tensor, name: str = "w", mma_order: bool = False,
                        tile: tuple[int, int, int] = DEFAULT_TILE) -> tuple[MXTensor, MXTensor]:
    """``(mxfp8_quantize(w_EXY, 2, name, mma_order), mxfp8_quantize_transposed(w_EXY, name, mma_order))`` from
    one read of w: the same tensors (shapes, contiguous strides, bits). ``tile``: (BX, BY, warps) of a program."""
    if w_EXY.dim() != 3:
        raise ValueError(f"{name}: mxfp8_quantize_both takes a 3-D weight [E, X, Y], got shape {tuple(w_EXY.shape)}")
    _check_blockable(w_EXY, 1, name)
    _check_blockable(w_EXY, 2, name)
    bx, by, warps = _check_tile(tile)
    w_EXY = w_EXY.contiguous()
    num_experts, dim_x, dim_y = w_EXY.shape
    device = w_EXY.device
    rows_q = torch.empty(num_experts, dim_x, dim_y, dtype=torch.uint8, device=device)
    rows_s = torch.empty(num_experts, dim_x, dim_y // BLOCK, dtype=torch.uint8, device=device)
    cols_q = torch.empty(num_experts, dim_y, dim_x, dtype=torch.uint8, device=device)
    cols_s = torch.empty(num_experts, dim_y, dim_x // BLOCK, dtype=torch.uint8, device=device)
    if w_EXY.numel() > 0:
        grid = (triton.cdiv(dim_y, by), triton.cdiv(dim_x, bx), num_experts)
        _mx_quant_both_kernel[grid](w_EXY, rows_q, rows_s, cols_q, cols_s, dim_x, dim_y, BX=bx, BY=by,
                                    MMA_ORDER=mma_order, num_warps=warps)
    return tuple(MXTensor(data=q.view(torch.float8_e4m3fn), scale=s.view(SCALE_DTYPE), dim=2, mma_order=mma_order)
                 for q, s in ((rows_q, rows_s), (cols_q, cols_s)))
