"""Tile enumeration and output epilogues shared by the grouped GEMM kernels (Triton and Gluon).

``_tile_of_program`` maps a program to its (expert, row tile, column tile) from device-side tile
prefix sums, ``_wgrad_job`` a weight-gradient program to its expert's rows and K tiles;
``_epilogue`` rounds and stores one fp32 output tile for each kind of grouped_mm (plain, SwiGLU,
SwiGLU backward, dual), in whatever register layout the kernel holds it.
"""

import triton
import triton.language as tl

from titan_mok.kernels.mxfp8_quant import _ROUND_IN_FP32


@triton.jit
def _group_of(t, end_ptr, E, LOG_E: tl.constexpr):
    """The first e with end[e] > t (binary search over E cumulative counts, LOG_E >= log2(E + 1)
    steps); E - 1 for t past the last (see the callers)."""
    lo = t * 0
    hi = lo + E
    for _ in tl.static_range(LOG_E):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(end_ptr + tl.minimum(mid, E - 1))
        right = active & (v <= t)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & (v > t), mid, hi)
    return tl.minimum(lo, E - 1)


@triton.jit
def _tile_of_program(t, group_end_ptr, tile_end_ptr, N, E, LOG_E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     GROUP_M: tl.constexpr):
    """Tile t -> (expert, first row of the tile, end row of the expert, first column)."""
    e = _group_of(t, tile_end_ptr, E, LOG_E)  # past the last tile: any expert, nothing is stored
    tile_start = tl.load(tile_end_ptr + e - 1, mask=e > 0, other=0)
    row_start = tl.load(group_end_ptr + e - 1, mask=e > 0, other=0).to(tl.int32)
    row_end = tl.load(group_end_ptr + e).to(tl.int32)
    local = t - tile_start
    m_tiles = tl.cdiv(row_end - row_start, BM)
    in_group = GROUP_M * tl.cdiv(N, BN)
    first_m = (local // in_group) * GROUP_M
    group_m = tl.maximum(tl.minimum(m_tiles - first_m, GROUP_M), 1)
    pid_m = first_m + (local % in_group) % group_m
    pid_n = (local % in_group) // group_m
    return e, row_start + pid_m * BM, row_end, pid_n * BN


@triton.jit
def _wgrad_job(p, group_end_ptr, prog_end_ptr, k_tiles_per_prog_ptr, K, E, LOG_E: tl.constexpr, BK: tl.constexpr):
    """The weight gradient's program p (of one column of features) -> (expert, first K tile, K tiles, first row,
    rows): the expert's K tiles from (p - prog_end[e - 1]) * k_tiles_per_prog[e] (grouped_gemm._wgrad_programs).
    An expert without rows gets first row 0: its TMA descriptors start there, inside the operands, not at its group
    end, which for the experts after the last row is the operands' end; with such starts the kernels stopped on an
    illegal memory access on an H100 (docs/design.md §10)."""
    e = _group_of(p, prog_end_ptr, E, LOG_E)
    chunk = p - tl.load(prog_end_ptr + e - 1, mask=e > 0, other=0)
    k_tiles_per_prog = tl.load(k_tiles_per_prog_ptr + e)
    first_k_tile = chunk * k_tiles_per_prog
    k_tiles = tl.minimum(k_tiles_per_prog, tl.cdiv(K, BK) - first_k_tile)
    row_start = tl.load(group_end_ptr + e - 1, mask=e > 0, other=0).to(tl.int32)
    rows = tl.load(group_end_ptr + e).to(tl.int32) - row_start
    return e, first_k_tile, k_tiles, tl.where(rows == 0, 0, row_start), rows


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16, round to nearest even: the GPU's cast (cvt.rn); under Triton 3.6's CPU
    interpreter, which truncates in .to(tl.bfloat16), spelled out in integer ops."""
    if _ROUND_IN_FP32:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(tl.bfloat16)


@triton.jit
def _swiglu_clamped(g, u, limit, HAS_LIMIT: tl.constexpr):
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return g, u


@triton.jit
def _swiglu_out(acc1, acc2, limit, HAS_LIMIT: tl.constexpr):
    """(g, u, h) in bf16 from the gate and up accumulators: g, u rounded to the activation dtype, h = silu(g) * u
    from the rounded values."""
    g = _bf16_rne(acc1)
    u = _bf16_rne(acc2)
    gc, uc = _swiglu_clamped(g.to(tl.float32), u.to(tl.float32), limit, HAS_LIMIT)
    return g, u, _bf16_rne(gc * tl.sigmoid(gc) * uc)


@triton.jit
def _swiglu_grads(dh, g_ptr, u_ptr, c_off, c_ok, limit, HAS_LIMIT: tl.constexpr):
    """(dg, du) in fp32 (the caller rounds them to bf16) of h = silu(clamp(g)) * clamp(u) from the fp32 dh tile and the
    stored g, u at c_off (zeros where not c_ok); the clamp passes the gradient only where it did not clip."""
    g = tl.load(g_ptr + c_off, mask=c_ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + c_off, mask=c_ok, other=0.0).to(tl.float32)
    gc, uc = _swiglu_clamped(g, u, limit, HAS_LIMIT)
    sig = tl.sigmoid(gc)
    dg = dh * uc * sig * (1 + gc * (1 - sig))
    du = dh * gc * sig
    if HAS_LIMIT:
        dg = tl.where(g <= limit, dg, 0.0)
        du = tl.where(tl.abs(u) <= limit, du, 0.0)
    return dg, du


@triton.jit
def _epilogue(acc1, acc2, c_off, c_ok, c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr, limit, MODE: tl.constexpr,
              HAS_LIMIT: tl.constexpr):
    """Stores of one output tile (either orientation: c_off/c_ok give each element's place)."""
    if MODE == 1:
        g, u, h = _swiglu_out(acc1, acc2, limit, HAS_LIMIT)
        tl.store(c1_ptr + c_off, g, mask=c_ok)
        tl.store(c2_ptr + c_off, u, mask=c_ok)
        tl.store(c3_ptr + c_off, h, mask=c_ok)
    elif MODE == 2:  # acc1 = dh
        dg, du = _swiglu_grads(acc1, g_ptr, u_ptr, c_off, c_ok, limit, HAS_LIMIT)
        tl.store(c1_ptr + c_off, _bf16_rne(dg), mask=c_ok)
        tl.store(c2_ptr + c_off, _bf16_rne(du), mask=c_ok)
    else:
        tl.store(c1_ptr + c_off, _bf16_rne(acc1), mask=c_ok)
