"""Grouped GEMMs for routed experts (Triton, Hopper), beside their PyTorch references.

Legend: R rows grouped by expert, E experts (local), K reduction dim, N output features,
H hidden, I expert FFN size.

``group_end_E`` (int32/int64 [E], on the rows' device) holds cumulative row counts: expert e
owns rows ``group_end[e-1]:group_end[e]``; rows at or past ``group_end[E-1]`` are padding
(outputs zero; their values never reach a stored output). No launcher syncs with the host.

Two GEMM shapes cover the expert FFN's forward and backward:
- ``grouped_mm``: ``c_RN[r] = a_RK[r] @ b_ENK[e(r)].T`` — forward (b = w_gate, w_up, w_down)
  and dgrad (b = a weight's transposed view; MXFP8 dgrad weights come quantized straight into a
  contiguous [E, N, K]). Weights are read by TMA: a contiguous [E, N, K] or the transposed view
  of a contiguous [E, K, N], rows of 16-byte multiples. Fused
  variants: gate/up with the SwiGLU epilogue, down-dgrad with the SwiGLU-backward epilogue,
  and a two-term sum (dx).
- ``grouped_wgrad``: ``c_ENK[e] = a_RN[rows of e].T @ b_RK[rows of e]``, each expert's rows read
  by TMA through descriptors the kernel makes over them (rows past the expert's end read as zeros);
  ``grouped_wgrads``: several such pairs, an operand shared by two quantized once for MXFP8.

Which kernel and tile config each launch runs is ``tile_configs.select``'s choice, from the kind, the precision,
the rows per expert and the chip: the Triton kernels here (the definition, and all that Triton's CPU interpreter
runs), or on CUDA ``grouped_mm_ws`` / ``grouped_wgrad_ws`` (warp-specialized) or ``grouped_mm_coop`` (cooperative),
which give the same bits.

Precision: bf16 operands, or MXFP8 (``mxfp8``). Weights arrive as ``MXTensor`` blocked along
K (quantized once per pass by ``mxfp8_quantize``, in the layout each GEMM reads; the MoE layer's
in MMA order, ``MXTensor.mma_order``). Activations
are quantized once per GEMM by a one-pass kernel with the reference rule (``mx_quantize_block``),
along K for grouped_mm and along the token axis for grouped_wgrad (blocks of 32 rows starting at
each group's first row; a group's last block is zero-padded), so no tile re-quantizes its A.
Default (``_grouped_mm_tma_kernel``, bf16 and MXFP8): operand tiles by TMA; an MXFP8 weight tile is dequantized in
registers one 32-wide scale block at a time (E4M3 * 2^e -> bf16, exact) and reaches the bf16 tensor cores through
shared memory, against bf16 activations holding the MXFP8 values; the scales of block k+1 are loaded while block k
runs (``grouped_mm_ws`` computes the same bits transposed, the dequantized weights as the MMA's register operand).
fp32 accumulation, each output tile computed by one program, fixed K order: no split-K, no atomics, run-to-run
deterministic.

Row-batch invariance: every row goes through the same instruction sequence whatever its group's size or its position
in a tile. Tile shapes depend on the kind of GEMM and the precision, and the token tile also on the rows held per
expert (``tile_configs``): a row's bits do not follow the token tile (each MMA sums a row's K in the same order
whatever its M or N; a GPU test compares 64-, 128- and 256-token tiles bit for bit), so that choice keeps them.

Grid: tiles are enumerated expert by expert (tile prefix sums computed on the device), and
within an expert in GROUP_M-row super-tiles, so the programs of one expert's N-tiles run side
by side and each weight tile is read from HBM once per pass while an expert has <= BM rows
(the MoE regime: tens of rows per expert).
"""

import dataclasses
import os

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation as triton_allocation
from triton.tools.tensor_descriptor import TensorDescriptor

from titan_mok.kernels import grouped_mm_coop, grouped_mm_ws, grouped_wgrad_ws, tile_configs
from titan_mok.kernels.grouped_tiles import _bf16_rne, _epilogue, _tile_of_program, _wgrad_job
from titan_mok.kernels.mxfp8 import BLOCK, MXTensor, fake_quantize_mxfp8
from titan_mok.kernels.mxfp8_quant import (
    _COLS_BQ,
    _COLS_WARPS,
    WIDE_SCALE_BITS,
    mx_dequantize_bf16,
    mx_dequantize_bits,
    mx_from_mma_order,
    mx_quantize_block,
    mxfp8_fake_quantize,
)
from titan_mok.kernels.row_tiles import tiled_mm

# Kinds of grouped_mm (the MODE constexpr).
PLAIN, SWIGLU, SWIGLU_BWD, DUAL = 0, 1, 2, 3

_INTERPRETED_PROGRAMS = 1  # a PERSISTENT config's programs under Triton's interpreter: one loops over all tiles
# The weight gradient's flat loop splits an expert's K tiles among more programs where there would be fewer than this
# many, and for experts with more rows than average (_wgrad_programs).
_WGRAD_MIN_PROGRAMS = 1024


# Triton 3.6's CPU interpreter multiplies bf16 tiles as their raw uint16 bits in tl.dot: under
# it, operands go to fp32 first (bf16 products are exact in fp32, so the result is the same).
_DOT_F32 = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------- references


def _group_bounds_sync(group_end_E: torch.Tensor, num_rows: int) -> list[tuple[int, int]]:
    # NOTE: host sync: the references loop over experts on the host.
    ends = group_end_E.tolist()
    starts = [0] + ends[:-1]
    if any(end < start for start, end in zip(starts, ends)) or (ends and not 0 <= ends[-1] <= num_rows):
        raise ValueError(f"group_end_E must be non-decreasing within [0, {num_rows}] (the rows), got {ends}")
    return list(zip(starts, ends))


def _operand_fp32(t: torch.Tensor, precision: str, dim: int, name: str) -> torch.Tensor:
    """The values a GEMM multiplies: t itself (bf16 path) or its MXFP8 fake-quantization."""
    return fake_quantize_mxfp8(t, dim, name) if precision == "mxfp8" else t.float()


def _weight_fp32(b_ENK, precision: str) -> torch.Tensor:
    """B's values: ``_operand_fp32``'s, or an MXTensor (MXFP8 blocked along K, as given) dequantized."""
    if not isinstance(b_ENK, MXTensor):
        return _operand_fp32(b_ENK, precision, -1, "b_ENK")
    if precision != "mxfp8" or b_ENK.dim != 2:
        raise ValueError(f"b_ENK: an MXTensor B needs precision 'mxfp8' and blocks along K (dim 2), got "
                         f"precision {precision!r}, dim {b_ENK.dim}")
    return b_ENK.dequantize(torch.float32)


def ref_grouped_mm(a_RK: torch.Tensor, group_end_E: torch.Tensor, b_ENK, precision: str) -> torch.Tensor:
    """fp32 c_RN[r] = a_RK[r] @ b_ENK[e(r)].T on the exact operand values (MXFP8 along K; b_ENK may be
    given as an MXTensor, already quantized)."""
    a_RK = _operand_fp32(a_RK, precision, -1, "a_RK")
    b_ENK = _weight_fp32(b_ENK, precision)
    c_RN = a_RK.new_zeros(a_RK.shape[0], b_ENK.shape[1])
    for e, (start, end) in enumerate(_group_bounds_sync(group_end_E, a_RK.shape[0])):
        if end > start:
            c_RN[start:end] = tiled_mm(a_RK[start:end], b_ENK[e].t())  # row tiles: row-batch-invariant too
    return c_RN


def ref_grouped_wgrad(a_RN: torch.Tensor, b_RK: torch.Tensor, group_end_E: torch.Tensor, precision: str) -> torch.Tensor:
    """fp32 c_ENK[e] = a_RN[rows of e].T @ b_RK[rows of e]; MXFP8 blocks of 32 rows per group, zero-padded."""
    c_ENK = a_RN.new_zeros(group_end_E.shape[0], a_RN.shape[1], b_RK.shape[1], dtype=torch.float32)
    for e, (start, end) in enumerate(_group_bounds_sync(group_end_E, a_RN.shape[0])):
        if end == start:
            continue
        pad = -(end - start) % BLOCK
        a_rN = torch.nn.functional.pad(a_RN[start:end], (0, 0, 0, pad))  # [rows + pad, N]
        b_rK = torch.nn.functional.pad(b_RK[start:end], (0, 0, 0, pad))  # [rows + pad, K]
        c_ENK[e] = _operand_fp32(a_rN, precision, 0, "a_RN").t() @ _operand_fp32(b_rK, precision, 0, "b_RK")
    return c_ENK


# ----------------------------------------------------------------------------- Triton


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    # NOTE: Triton compiles the statements after a constexpr-guarded return too: one return per helper.
    if DOT_F32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _grouped_mm_tma_kernel(
    # tensor descriptors (TMA): A operands [R, K] bf16 (MXFP8 values on that path), blocks [BM, KB]
    # (a1h/a2h: the same with [BM / 2, KB] blocks, for HALF_TILES); B operands bf16 or E4M3 as 2D
    # views, blocks [BN, KB] of [E*N, K] or, with B_KN, [KB, BN] of [E*K, N]
    a1_desc, a2_desc, a1h_desc, a2h_desc, b1_desc, b2_desc,
    # E8M0 bits of MXFP8 B operands [E, N, K/32] (any strides; unused in bf16)
    sb1_ptr, sb2_ptr,
    # outputs [R, N] row-major; g/u inputs [R, N] of the SwiGLU backward
    c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr,
    group_end_ptr, tile_end_ptr,
    # dimensions and strides
    N, K, E,
    stride_se, stride_sn, stride_sk,
    limit,
    # meta-parameters
    MODE: tl.constexpr, MX: tl.constexpr, HAS_LIMIT: tl.constexpr, LOG_E: tl.constexpr, B_KN: tl.constexpr,
    MMA_ORDER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_F32: tl.constexpr, HALF_TILES: tl.constexpr, PERSISTENT: tl.constexpr = False,
):
    """C [BM, BN] = A [BM, K] @ B[e]^T, bf16 or MXFP8 B (dequantized per 32-wide K block, MX).

    Operand tiles arrive by TMA (no per-element address arithmetic); a tile reaching past its
    expert's rows or columns reads the next expert's (or zeros past the tensor), which only meets
    outputs that are never stored. HALF_TILES: a tile holding at most BM / 2 of its expert's rows
    (an expert's last tile; most tiles under skewed routing) runs BM / 2-row MMAs, the same
    instructions per row, so the same bits.
    """
    if PERSISTENT:
        # one program per SM looping over the tiles, the loop nest flattened: the software pipeline
        # issues the next tile's loads while this one's epilogue runs
        for t in tl.range(tl.program_id(0), tl.load(tile_end_ptr + E - 1), tl.num_programs(0), flatten=True):
            _mm_tile_at(t, a1_desc, a2_desc, a1h_desc, a2h_desc, b1_desc, b2_desc, sb1_ptr, sb2_ptr, c1_ptr, c2_ptr,
                        c3_ptr, g_ptr, u_ptr, group_end_ptr, tile_end_ptr, N, K, E, stride_se, stride_sn, stride_sk,
                        limit, MODE, MX, HAS_LIMIT, LOG_E, B_KN, MMA_ORDER, BM, BN, BK, GROUP_M, DOT_F32, HALF_TILES,
                        PERSISTENT)
    else:
        _mm_tile_at(tl.program_id(0), a1_desc, a2_desc, a1h_desc, a2h_desc, b1_desc, b2_desc, sb1_ptr, sb2_ptr,
                    c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr, group_end_ptr, tile_end_ptr, N, K, E, stride_se, stride_sn,
                    stride_sk, limit, MODE, MX, HAS_LIMIT, LOG_E, B_KN, MMA_ORDER, BM, BN, BK, GROUP_M, DOT_F32,
                    HALF_TILES, PERSISTENT)


@triton.jit
def _mm_tile_at(t, a1_desc, a2_desc, a1h_desc, a2h_desc, b1_desc, b2_desc, sb1_ptr, sb2_ptr, c1_ptr, c2_ptr, c3_ptr,
                g_ptr, u_ptr, group_end_ptr, tile_end_ptr, N, K, E, stride_se, stride_sn, stride_sk, limit,
                MODE: tl.constexpr, MX: tl.constexpr, HAS_LIMIT: tl.constexpr, LOG_E: tl.constexpr,
                B_KN: tl.constexpr, MMA_ORDER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                GROUP_M: tl.constexpr, DOT_F32: tl.constexpr, HALF_TILES: tl.constexpr, PERSISTENT: tl.constexpr):
    """Tile t, on BM / 2-row MMAs where HALF_TILES and the tile holds at most BM / 2 of its expert's rows."""
    e, m0, row_end, n0 = _tile_of_program(t, group_end_ptr, tile_end_ptr, N, E, LOG_E, BM, BN, GROUP_M)
    if PERSISTENT:  # the loop visits real tiles only
        valid = True
    else:
        # The grid is an upper bound on the tiles: programs past the last one run no K steps and
        # store nothing (a loop bound, not an early return, keeps the K loop software-pipelined).
        valid = t < tl.load(tile_end_ptr + E - 1)
    if HALF_TILES and row_end - m0 <= BM // 2:
        _mm_tile(a1h_desc, a2h_desc, b1_desc, b2_desc, sb1_ptr, sb2_ptr, c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr,
                 e, m0, row_end, n0, valid, N, K, stride_se, stride_sn, stride_sk, limit,
                 MODE, MX, HAS_LIMIT, B_KN, MMA_ORDER, BM // 2, BN, BK, DOT_F32)
    else:
        _mm_tile(a1_desc, a2_desc, b1_desc, b2_desc, sb1_ptr, sb2_ptr, c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr,
                 e, m0, row_end, n0, valid, N, K, stride_se, stride_sn, stride_sk, limit,
                 MODE, MX, HAS_LIMIT, B_KN, MMA_ORDER, BM, BN, BK, DOT_F32)


@triton.jit
def _mm_tile(a1_desc, a2_desc, b1_desc, b2_desc, sb1_ptr, sb2_ptr, c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr,
             e, m0, row_end, n0, valid, N, K, stride_se, stride_sn, stride_sk, limit,
             MODE: tl.constexpr, MX: tl.constexpr, HAS_LIMIT: tl.constexpr, B_KN: tl.constexpr,
             MMA_ORDER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr):
    """One output tile [BM, BN] at (m0, n0) of expert e: the K loop (MX: the scales of block k+1
    are loaded, raw E8M0 bits carried across iterations, while block k runs, so their
    global-memory latency is off the MMA chain) and the epilogue."""
    KB: tl.constexpr = 32 if MX else BK  # K per TMA load: one scale block on the MXFP8 path
    k_end = tl.where(valid, K, 0)
    rows = m0 + tl.arange(0, BM)
    row_ok = (rows < row_end) & valid
    offs_n = n0 + tl.arange(0, BN)
    n_ok = offs_n < N
    s_off = e.to(tl.int64) * stride_se + offs_n * stride_sn  # [BN], block 0
    s_ptrs1, s_ptrs2 = sb1_ptr + s_off, sb2_ptr + s_off

    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    # SWIGLU: the second B (w_up) shares the A tile
    acc1, acc2 = _k_loop(acc1, acc2, a1_desc, b1_desc, b2_desc, s_ptrs1, s_ptrs2, e, m0, n0, n_ok, k_end, N, K,
                         stride_sk, MODE == 1, False, MX, B_KN, MMA_ORDER, BK, KB, DOT_F32)
    if MODE == 3:  # DUAL: acc1 += A2 @ B2, continuing the same fixed K order
        acc1, acc2 = _k_loop(acc1, acc2, a2_desc, b2_desc, b2_desc, s_ptrs2, s_ptrs2, e, m0, n0, n_ok, k_end, N, K,
                             stride_sk, False, True, MX, B_KN, MMA_ORDER, BK, KB, DOT_F32)

    c_off = rows[:, None].to(tl.int64) * N + offs_n[None, :]
    _epilogue(acc1, acc2, c_off, row_ok[:, None] & n_ok[None, :], c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr, limit, MODE,
              HAS_LIMIT)


@triton.jit
def _k_loop(acc1, acc2, a_desc, b1_desc, b2_desc, s_ptrs1, s_ptrs2, e, m0, n0, n_ok, k_end, N, K, stride_sk,
            TWO_B: tl.constexpr, B_FIRST: tl.constexpr, MX: tl.constexpr, B_KN: tl.constexpr,
            MMA_ORDER: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, DOT_F32: tl.constexpr):
    """acc1 += A @ B1[e]^T (TWO_B: and acc2 += A @ B2[e]^T, from the same A tiles) over K in ascending KB-wide
    steps; MX: the scales of each block loaded one step ahead. B_FIRST: each step asks for B's tile before A's
    (DUAL's second loop always has; the compiled code follows the order of the loads)."""
    s1_next = _scale_bits(s_ptrs1, 0, n_ok, k_end, stride_sk, MX)
    if TWO_B:
        s2_next = _scale_bits(s_ptrs2, 0, n_ok, k_end, stride_sk, MX)
    for k0 in range(0, k_end, BK):
        for j in tl.static_range(BK // KB):
            k = k0 + j * KB
            s1 = s1_next
            s1_next = _scale_bits(s_ptrs1, k + KB, n_ok, K, stride_sk, MX)
            if B_FIRST:
                b = _b_tile(b1_desc, e, n0, k, N, K, s1, B_KN, MMA_ORDER, MX)
                a = a_desc.load([m0, k])
            else:
                a = a_desc.load([m0, k])
                b = _b_tile(b1_desc, e, n0, k, N, K, s1, B_KN, MMA_ORDER, MX)
            acc1 = _dot(a, b, acc1, DOT_F32)
            if TWO_B:
                s2 = s2_next
                s2_next = _scale_bits(s_ptrs2, k + KB, n_ok, K, stride_sk, MX)
                acc2 = _dot(a, _b_tile(b2_desc, e, n0, k, N, K, s2, B_KN, MMA_ORDER, MX), acc2, DOT_F32)
    return acc1, acc2


@triton.jit
def _scale_bits(s_ptrs, k, n_ok, k_limit, stride_sk, MX: tl.constexpr):
    """Raw E8M0 bits [BN] of the 32-wide K block starting at k (127, i.e. 2^0, past k_limit); MX only."""
    if MX:
        bits = tl.load(s_ptrs + (k // 32) * stride_sk, mask=n_ok & (k < k_limit), other=127)
    else:
        bits = tl.zeros_like(n_ok).to(tl.uint8)
    return bits


@triton.jit
def _b_tile(b_desc, e, n0, k, N, K, s_bits, B_KN: tl.constexpr, MMA_ORDER: tl.constexpr, MX: tl.constexpr):
    """B[e]'s tile [KB, BN] at (k, n0) as the MMA's bf16 operand; MXFP8 dequantized, exactly (MMA_ORDER: its
    32 K elements back in index order)."""
    if B_KN:  # stored [E, K, N]: the block is [KB, BN]
        b = b_desc.load([e * K + k, n0])
        if MX:
            b = mx_dequantize_bits(b, s_bits, 0)
    else:  # stored [E, N, K]: the block is [BN, KB]
        b = b_desc.load([e * N + n0, k])
        if MX:
            b = mx_dequantize_bits(b, s_bits, 1)
        if MMA_ORDER:
            b = mx_from_mma_order(b, b.shape[0])
        b = tl.trans(b)
    return b


@triton.jit
def _mx_fake_quant_groups_kernel(
    x_ptr, y_ptr,  # x [R, N] row-major (any float), y [R, N] bf16
    group_end_ptr, block_end_ptr,
    N, E,
    LOG_E: tl.constexpr, BQ: tl.constexpr,
):
    """MXFP8 values (bf16) of x, blocks of 32 rows starting at each group's first row."""
    t = tl.program_id(0)
    _expert, r0, row_end, _col = _tile_of_program(t, group_end_ptr, block_end_ptr, 1, E, LOG_E, 32, 1, 1)
    rows = r0 + tl.arange(0, 32)
    offs_q = tl.program_id(1) * BQ + tl.arange(0, BQ)
    ok = ((rows < row_end) & (t < tl.load(block_end_ptr + E - 1)))[:, None] & (offs_q < N)[None, :]
    off = rows[:, None].to(tl.int64) * N + offs_q[None, :]
    x = tl.load(x_ptr + off, mask=ok, other=0.0).to(tl.float32)  # the last block's tail reads as zeros
    q, e, bad = mx_quantize_block(tl.reshape(x, (1, 32, BQ)), 1)
    tl.store(y_ptr + off, tl.reshape(mx_dequantize_bf16(q, e, bad), (32, BQ)), mask=ok)


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr, b_ptr, c_ptr,  # a [R, N], b [R, K] row-major bf16; c [E, N, K] contiguous bf16
    group_end_ptr,
    prog_end_ptr, k_tiles_per_prog_ptr,  # [E]: cumulative programs per expert (per BN features); K tiles each
    N, K, E,
    LOG_E: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FLAT: tl.constexpr,
    DOT_F32: tl.constexpr, PERSISTENT: tl.constexpr = False,
):
    """c[e, BN features, the program's K tiles], rows summed in ascending BR-row blocks.

    Program (n, p): expert e = the first with prog_end[e] > p, its K tiles from (p - prog_end[e - 1])
    * k_tiles_per_prog[e] (the launcher gives experts with many rows fewer K tiles per program, so
    the heaviest expert's programs are no longer the tail). The operand tiles come by TMA through
    descriptors made here over the expert's own rows, so rows past its end read as zeros. FLAT
    (few rows per expert): one loop over (K tile, row block), each tile stored after its last row
    block, so the next tile's loads overlap the store instead of restarting the load pipeline per
    tile. Otherwise (many rows) one K tile per program and the row loop alone, whose pipeline then
    has no store-and-reset to wait on. PERSISTENT: one program per SM, each looping over the (n, p)
    pairs in the 2-D grid's launch order (n fastest). (Triton 3.6 does not fuse this loop with the row
    loop, as it does the bf16 grouped_mm's tile loop: the pipeline still drains per pair.) Same blocks,
    same order, whichever program: same bits.
    """
    if PERSISTENT:
        n_tiles = tl.cdiv(N, BN)
        for t in range(tl.program_id(0), n_tiles * tl.load(prog_end_ptr + E - 1), tl.num_programs(0)):
            _wgrad_program(t % n_tiles, t // n_tiles, a_ptr, b_ptr, c_ptr, group_end_ptr, prog_end_ptr,
                           k_tiles_per_prog_ptr, N, K, E, LOG_E, BR, BN, BK, FLAT, DOT_F32)
    else:
        p = tl.program_id(1)
        if p >= tl.load(prog_end_ptr + E - 1):  # the grid is an upper bound: return before any other load
            return
        _wgrad_program(tl.program_id(0), p, a_ptr, b_ptr, c_ptr, group_end_ptr, prog_end_ptr, k_tiles_per_prog_ptr,
                       N, K, E, LOG_E, BR, BN, BK, FLAT, DOT_F32)


@triton.jit
def _wgrad_program(n_tile, p, a_ptr, b_ptr, c_ptr, group_end_ptr, prog_end_ptr, k_tiles_per_prog_ptr, N, K, E,
                   LOG_E: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FLAT: tl.constexpr,
                   DOT_F32: tl.constexpr):
    """The weight gradient's program (n_tile, p): its expert's K tiles for BN features."""
    e, first_k_tile, k_tiles, row_start, rows = _wgrad_job(p, group_end_ptr, prog_end_ptr, k_tiles_per_prog_ptr, K,
                                                           E, LOG_E, BK)
    n0 = n_tile * BN
    offs_n = n0 + tl.arange(0, BN)
    n_ok = offs_n < N
    # A TMA box needs at least one row: an expert without rows gets a one-row descriptor at the operands'
    # first row (_wgrad_job) and its single row block starts past it (skip), so it too reads zeros and
    # stores a zero gradient.
    skip = tl.where(rows == 0, BR, 0)
    a_desc = tl.make_tensor_descriptor(a_ptr + row_start.to(tl.int64) * N, shape=[tl.maximum(rows, 1), N],
                                       strides=[N, 1], block_shape=[BR, BN])
    b_desc = tl.make_tensor_descriptor(b_ptr + row_start.to(tl.int64) * K, shape=[tl.maximum(rows, 1), K],
                                       strides=[K, 1], block_shape=[BR, BK])
    c_rows = c_ptr + e.to(tl.int64) * N * K + offs_n[:, None] * K  # [BN, 1]
    row_blocks = tl.maximum(tl.cdiv(rows, BR), 1)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    if FLAT:
        for i in range(0, row_blocks * k_tiles):
            k0 = (first_k_tile + i // row_blocks) * BK
            block = i % row_blocks
            acc = _wgrad_block(acc, a_desc, b_desc, block * BR + skip, n0, k0, DOT_F32)
            if block == row_blocks - 1:
                # c is written once, never read here: evicted first, L2 is left to a's and b's re-reads (faster in
                # 16 of 18 MoE lines at EP=1, by up to 4.6%; in the row loop, 8 x 4096 rows, 0.99-1.02x: not there)
                offs_k = k0 + tl.arange(0, BK)
                tl.store(c_rows + offs_k[None, :], _bf16_rne(acc), mask=n_ok[:, None] & (offs_k < K)[None, :],
                         eviction_policy="evict_first")
                acc = tl.zeros((BN, BK), dtype=tl.float32)
    else:  # one K tile per program
        k0 = first_k_tile * BK
        for block in range(row_blocks):
            acc = _wgrad_block(acc, a_desc, b_desc, block * BR + skip, n0, k0, DOT_F32)
        offs_k = k0 + tl.arange(0, BK)
        tl.store(c_rows + offs_k[None, :], _bf16_rne(acc), mask=n_ok[:, None] & (offs_k < K)[None, :])


@triton.jit
def _wgrad_block(acc, a_desc, b_desc, r, n0, k0, DOT_F32: tl.constexpr):
    """acc [BN, BK] += a[r:r+BR, n0:n0+BN]^T @ b[r:r+BR, k0:k0+BK] (rows of the expert's descriptors)."""
    return _dot(tl.trans(a_desc.load([r, n0])), b_desc.load([r, k0]), acc, DOT_F32)


# ----------------------------------------------------------------------------- launchers


def _b_operand(b, name: str):
    """(data tensor [E, N, K] view, E8M0 bits [E, N, K/32] view or None, whether the data is in MMA order) of a
    bf16 or MXFP8 B."""
    if isinstance(b, MXTensor):
        if b.dim != 2:
            raise ValueError(f"{name}: an MXFP8 B operand must be blocked along K (dim 2 of [E, N, K]), got dim {b.dim}")
        return b.data, b.scale.view(torch.uint8), b.mma_order
    if b.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bfloat16 or an MXTensor on the Triton path, got {b.dtype}")
    return b, None, False


def _a_operand(a, mx: bool, name: str):
    """A [R, K] as the kernels read it: bf16 as is, for MXFP8 its MXFP8 values (quantized along K once)."""
    if a.dtype != torch.bfloat16 or a.dim() != 2:
        raise ValueError(f"{name} must be bfloat16 [R, K], got {a.dtype} {tuple(a.shape)}")
    return mxfp8_fake_quantize(a, name) if mx else a.contiguous()


def _tma_descriptor(t2d: torch.Tensor, block: list[int], name: str, gluon: bool = False):
    """TMA descriptor of a row-major 2D view (Triton's, or Gluon's with the default swizzled layout);
    TMA needs a 16-byte aligned start and row stride."""
    row_bytes = t2d.stride(0) * t2d.element_size()
    if t2d.stride(1) != 1 or row_bytes % 16 or t2d.data_ptr() % 16:
        raise ValueError(f"{name}: the TMA loads need a row-major view with a 16-byte aligned start and row stride "
                         f"(a multiple of {16 // t2d.element_size()} elements of {t2d.dtype}); got shape "
                         f"{tuple(t2d.shape)}, strides {t2d.stride()}")
    if gluon:
        return grouped_mm_ws.tma_descriptor(t2d, block)
    return TensorDescriptor.from_tensor(t2d, block)


def _weight_descriptors(b1_data: torch.Tensor, b2_data: torch.Tensor, block_n: int, block_k: int, gluon: bool):
    """(B_KN, TMA descriptors of both weights [E, N, K]): each a contiguous [E, N, K] (blocks
    [block_n, block_k] of [E*N, K]) or the transposed view of a contiguous [E, K, N] (B_KN;
    blocks [block_k, block_n] of [E*K, N]), both in the same layout."""
    num_experts, n, k = b1_data.shape
    descs, kn = [], []
    for name, b in (("b1", b1_data), ("b2", b2_data)):
        if b.shape != b1_data.shape:
            raise ValueError(f"{name}: shape {tuple(b.shape)} differs from b1's {tuple(b1_data.shape)}")
        if b.is_contiguous():
            descs.append(_tma_descriptor(b.view(num_experts * n, k), [block_n, block_k], name, gluon))
        elif b.transpose(1, 2).is_contiguous():
            descs.append(_tma_descriptor(b.transpose(1, 2).reshape(num_experts * k, n), [block_k, block_n], name, gluon))
        else:
            raise ValueError(f"{name}: a weight must be a contiguous [E, N, K] or the transposed view of a "
                             f"contiguous [E, K, N], got strides {b.stride()}")
        kn.append(not b.is_contiguous())
    if kn[0] != kn[1]:
        raise ValueError("b1 and b2 must have the same layout (both [E, N, K] or both transposed [E, K, N])")
    return kn[0], descs


def _set_triton_allocator():
    """Device-made TMA descriptors need global scratch from Triton's allocator, a per-thread setting
    (autograd runs the backward on its own threads): torch memory, unless the caller set one."""
    if isinstance(triton_allocation._allocator.get(), triton_allocation.NullAllocator):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


@triton.jit
def _tile_ends_kernel(group_end_ptr, tile_end_ptr, num_groups, rows_per_tile, tiles_per_rows, BLOCK: tl.constexpr):
    carry = tl.zeros((), dtype=tl.int32)
    for start in range(0, num_groups, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < num_groups
        end = tl.load(group_end_ptr + offs, mask=ok, other=0).to(tl.int32)
        begin = tl.load(group_end_ptr + offs - 1, mask=ok & (offs > 0), other=0).to(tl.int32)
        tiles = tl.where(ok, (end - begin + rows_per_tile - 1) // rows_per_tile * tiles_per_rows, 0)
        tl.store(tile_end_ptr + offs, tl.cumsum(tiles, 0) + carry, mask=ok)
        carry += tl.sum(tiles, 0)


def _tile_ends(group_end_E: torch.Tensor, rows_per_tile: int, tiles_per_rows: int) -> torch.Tensor:
    """Cumulative tile counts per expert (int32, on the device: no host sync), in one launch: the torch
    expression ``(ceil(diff(group_end) / rows_per_tile) * tiles_per_rows).cumsum()`` is six, and every grouped
    GEMM call needs one, on the layer's host path."""
    tile_end_E = torch.empty(group_end_E.shape[0], dtype=torch.int32, device=group_end_E.device)
    if group_end_E.shape[0]:
        block = min(1024, triton.next_power_of_2(group_end_E.shape[0]))
        _tile_ends_kernel[(1,)](group_end_E, tile_end_E, group_end_E.shape[0], rows_per_tile, tiles_per_rows,
                                BLOCK=block)
    return tile_end_E


def _padded(items: list, count: int) -> list:
    """items, then its first item repeated up to count: a kernel's unused operand slots (never read)."""
    return (list(items) + [items[0]] * count)[:count]


def _kernel_args(cfg, *drop: str) -> dict:
    """A tile config's fields as a launch's keyword arguments, but drop's and those left None."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name not in drop and getattr(cfg, f.name) is not None}


def _launch_mm(mode, a1, a2, b1, b2, group_end_E, outs, gu=(None, None), swiglu_limit=None, table=None):
    """The grouped_mm kind ``mode`` into outs, on the kernel and config tile_configs.select picks for the operands
    (table: the configs to read; None: those of the chip b1 is on)."""
    b1_data, b1_s, mma_order = _b_operand(b1, "b1")
    b2_data, b2_s, mma_order2 = _b_operand(b2, "b2") if b2 is not None else (b1_data, b1_s, mma_order)
    mx = b1_s is not None
    if mma_order != mma_order2:
        raise ValueError("b1 and b2 must both be in MMA order (MXTensor.mma_order) or both not")
    num_experts, n, k = b1_data.shape
    if a1.shape[1] != k:
        raise ValueError(f"A operand has K = {a1.shape[1]}, B has K = {k}")
    if group_end_E.shape != (num_experts,):
        raise ValueError(f"group_end_E must be [{num_experts}], got {tuple(group_end_E.shape)}")
    if num_experts == 0 or a1.shape[0] == 0:
        return
    chip = tile_configs.chip_of(b1_data)
    kernel, cfg, _ = tile_configs.select(tile_configs.MM_KINDS[mode], "mxfp8" if mx else "bf16",
                                         a1.shape[0] / num_experts, chip, n=n, k=k, table=table,
                                         contiguous=b1_data.is_contiguous() and b2_data.is_contiguous())
    a1 = _a_operand(a1, mx, "a1")
    a2 = _a_operand(a2, mx, "a2") if a2 is not None else a1
    bm, bn = cfg.BM, cfg.BN
    n_tiles = triton.cdiv(n, bn * getattr(cfg, "ROW_BLOCKS", 1))  # ROW_BLOCKS: BN-row weight blocks per tile
    tile_end_E = _tile_ends(group_end_E, bm, n_tiles)
    max_tiles = (triton.cdiv(a1.shape[0], bm) + num_experts) * n_tiles  # upper bound, no host sync
    c1, c2, c3 = _padded(outs, 3)
    if kernel == "cooperative":
        weights = (("b1", b1_data), ("b2", b2_data))[:1 + (mode == SWIGLU)]
        b_descs = [_tma_descriptor(b.view(num_experts * n, k), [bn, cfg.BK], name, True) for name, b in weights]
        c_descs = [_tma_descriptor(c, [bm // 2, bn], f"c{i + 1}", True) for i, c in enumerate(outs)]
        grouped_mm_coop.launch(_tma_descriptor(a1, [bm, cfg.BK], "a1", True), _padded(b_descs, 2),
                               _padded(c_descs, 3), (c1, c2, c3), group_end_E, tile_end_E, max_tiles, swiglu_limit,
                               mode == SWIGLU, cfg)
        return
    ws = kernel == "warp_specialized"
    g, u = gu if gu[0] is not None else (c1, c1)
    common = dict(HAS_LIMIT=swiglu_limit is not None, LOG_E=num_experts.bit_length(), MODE=mode)
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
    # MXFP8 and the Gluon kernel load activations one 32-wide (scale) block at a time...
    block_k = 32 if mx or ws else cfg.BK
    block_kw = 32 * grouped_mm_ws.KB if ws else block_k  # ...the Gluon kernel's weights KB blocks at a time
    a_descs = [_tma_descriptor(a, [bm, block_k], name, ws) for name, a in (("a1", a1), ("a2", a2))]
    b_kn, b_descs = _weight_descriptors(b1_data, b2_data, bn, block_kw, ws)
    if b_kn and mma_order:
        raise ValueError("a weight in MMA order (MXTensor.mma_order) must be a contiguous [E, N, K], not a transposed "
                         "view")
    outs_and_groups = (c1, c2, c3, g, u, group_end_E, tile_end_E, n, k, num_experts)
    if ws:
        if mx:
            wide_E = _wide_scale_experts(b1_s, *([] if b2_s is b1_s else [b2_s]))
            s1 = _scales_by_row(b1_s)
            s2 = s1 if b2_s is b1_s else _scales_by_row(b2_s)
        else:  # bf16: no scales (never read)
            wide_E = s1 = s2 = a1
        grouped_mm_ws.launch(max_tiles, cfg.PERSISTENT, *a_descs, *b_descs, s1, s2, wide_E, *outs_and_groups,
                             *s1.stride()[:2], limit, B_KN=b_kn, MMA_ORDER=mma_order, KB=grouped_mm_ws.KB, MX=mx,
                             **common, **_kernel_args(cfg, "PERSISTENT"))
    else:
        a_half = ([_tma_descriptor(a, [bm // 2, block_k], name) for name, a in (("a1", a1), ("a2", a2))]
                  if cfg.HALF_TILES else a_descs)
        sb1, sb2, s_strides = (b1_s, b2_s, b1_s.stride()) if mx else (a1, a1, (0, 0, 0))  # bf16: never read
        grid = (_persistent_programs(a1, max_tiles) if cfg.PERSISTENT else max_tiles,)
        _grouped_mm_tma_kernel[grid](*a_descs, *a_half, *b_descs, sb1, sb2, *outs_and_groups, *s_strides, limit,
                                     MX=mx, B_KN=b_kn, MMA_ORDER=mma_order, DOT_F32=_DOT_F32, **common,
                                     **_kernel_args(cfg))


def _scales_by_row(bits_ENB: torch.Tensor) -> torch.Tensor:
    """E8M0 bits [E, N, K/32] contiguous (a copy, 1/32 of the weight bytes, only where they are not): the
    warp-specialized kernel loads a row's four K blocks as one aligned 4-byte word."""
    return bits_ENB if bits_ENB.is_contiguous() and bits_ENB.data_ptr() % 4 == 0 else bits_ENB.contiguous()


def _wide_scale_experts(*bits_ENB: torch.Tensor) -> torch.Tensor:
    """int32 [E]: 1 where an expert's E8M0 bits in any of these B operands exceed WIDE_SCALE_BITS (scales
    above 2^7, or NaN): the warp-specialized kernel dequantizes those experts with a second multiply
    (mx_dequantize_bits_sm90). One read of the scales, 1/32 of the E4M3 weight bytes."""
    return (torch.stack([b.amax(dim=(1, 2)) for b in bits_ENB]).amax(0) > WIDE_SCALE_BITS.value).to(torch.int32)


def _persistent_programs(t: torch.Tensor, work_items: int) -> int:
    """A PERSISTENT config's grid for t's launch: one program per SM (none past the work items); under
    Triton's interpreter _INTERPRETED_PROGRAMS, one program looping over every item."""
    gpu = tile_configs.chip_of(t) is not None
    return min(work_items, grouped_mm_ws.sm_count(t.device.index) if gpu else _INTERPRETED_PROGRAMS)


def _new_rows(like: torch.Tensor, n: int) -> torch.Tensor:
    """[R, n] output in like's dtype, uninitialized (the tiles write every grouped row)."""
    return torch.empty(like.shape[0], n, dtype=like.dtype, device=like.device)


@triton.jit
def _zero_padding_rows_kernel(c_ptr, group_end_ptr, R, N, E, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    first_padding = tl.load(group_end_ptr + E - 1).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(0) * BLOCK_R + BLOCK_R > first_padding:  # the other programs hold grouped rows only
        row_mask = (rows >= first_padding) & (rows < R)
        for n in range(0, N, BLOCK_N):
            cols = n + tl.arange(0, BLOCK_N)
            tl.store(c_ptr + rows[:, None] * N + cols[None, :], tl.zeros([BLOCK_R, BLOCK_N], c_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & (cols < N)[None, :])


def _zero_padding_rows(c_RN: torch.Tensor, group_end_E: torch.Tensor) -> torch.Tensor:
    """c_RN with its padding rows (from group_end_E[-1] on, which no tile writes) zeroed, for callers that see
    them; without a host sync. Zeroing the whole output first costs a pass over it: at 8 x 4096 rows 0.085-0.147 ms
    on an H100, beside the down projection's 0.43-2.1."""
    if group_end_E.numel() == 0:
        return c_RN.zero_()
    if c_RN.numel():
        grid = (triton.cdiv(c_RN.shape[0], 32),)
        _zero_padding_rows_kernel[grid](c_RN, group_end_E, c_RN.shape[0], c_RN.shape[1], group_end_E.shape[0],
                                        BLOCK_R=32, BLOCK_N=256)
    return c_RN


def grouped_mm(a_RK, group_end_E, b_ENK, *, table=None) -> torch.Tensor:
    """c_RN[r] = a_RK[r] @ b_ENK[e(r)].T in bf16 (fp32 accumulation), padding rows zero; b bf16 or MXTensor
    (dim 2). table (here and below): the tile configs to read (tile_configs.ChipTable); None: the chip's."""
    c_RN = _new_rows(a_RK, _b_operand(b_ENK, "b_ENK")[0].shape[1])
    _launch_mm(PLAIN, a_RK, None, b_ENK, None, group_end_E, [c_RN], table=table)
    return _zero_padding_rows(c_RN, group_end_E)


def grouped_mm_sum(a1_RK, a2_RK, group_end_E, b1_ENK, b2_ENK, *, table=None) -> torch.Tensor:
    """c_RN = a1 @ b1[e].T + a2 @ b2[e].T in one fp32 accumulator (the input gradient of gate/up), padding rows
    zero."""
    c_RN = _new_rows(a1_RK, _b_operand(b1_ENK, "b1_ENK")[0].shape[1])
    _launch_mm(DUAL, a1_RK, a2_RK, b1_ENK, b2_ENK, group_end_E, [c_RN], table=table)
    return _zero_padding_rows(c_RN, group_end_E)


def grouped_gate_up_swiglu(x_RH, group_end_E, w_gate_EIH, w_up_EIH, swiglu_limit, *, table=None):
    """(gate_RI, up_RI, h_RI): gate/up GEMMs sharing x, h = silu(clamp gate) * clamp up, all bf16."""
    dim_i = _b_operand(w_gate_EIH, "w_gate_EIH")[0].shape[1]
    gate_RI, up_RI, h_RI = (_new_rows(x_RH, dim_i) for _ in range(3))
    _launch_mm(SWIGLU, x_RH, None, w_gate_EIH, w_up_EIH, group_end_E, [gate_RI, up_RI, h_RI],
               swiglu_limit=swiglu_limit, table=table)
    return gate_RI, up_RI, h_RI


def grouped_down_dgrad_swiglu(dy_RH, group_end_E, w_down_EIH, gate_RI, up_RI, swiglu_limit, *, table=None):
    """(dgate_RI, dup_RI): dh = dy @ w_down[e] (w_down viewed [E, I, H]) through the SwiGLU backward."""
    dim_i = gate_RI.shape[1]
    dgate_RI, dup_RI = (_new_rows(dy_RH, dim_i) for _ in range(2))
    _launch_mm(SWIGLU_BWD, dy_RH, None, w_down_EIH, None, group_end_E, [dgate_RI, dup_RI], gu=(gate_RI, up_RI),
               swiglu_limit=swiglu_limit, table=table)
    return dgate_RI, dup_RI


def mxfp8_fake_quantize_groups(x_RN: torch.Tensor, group_end_E: torch.Tensor) -> torch.Tensor:
    """bf16 MXFP8 values of x, blocked along the token axis in 32-row blocks from each group's start."""
    num_experts, (num_rows, n) = group_end_E.shape[0], x_RN.shape
    y_RN = torch.empty(num_rows, n, dtype=torch.bfloat16, device=x_RN.device)
    if num_experts and num_rows:
        block_end_E = _tile_ends(group_end_E, 32, 1)
        # column blocks like mxfp8_quantize's columns kernel: the block reduction runs across rows
        grid = (triton.cdiv(num_rows, 32) + num_experts, triton.cdiv(n, _COLS_BQ))
        _mx_fake_quant_groups_kernel[grid](x_RN.contiguous(), y_RN, group_end_E, block_end_E, n, num_experts,
                                           LOG_E=num_experts.bit_length(), BQ=_COLS_BQ, num_warps=_COLS_WARPS)
    return y_RN


def grouped_wgrad(a_RN, b_RK, group_end_E, precision: str, *, table=None) -> torch.Tensor:
    """bf16 c_ENK[e] = a_RN[rows of e].T @ b_RK[rows of e], each tile written once (fp32 accumulation).

    MXFP8: both operands quantized along the token axis per group first (one pass each)."""
    (c_ENK,) = grouped_wgrads([(a_RN, b_RK)], group_end_E, precision, table=table)
    return c_ENK


def grouped_wgrads(pairs, group_end_E, precision: str, *, table=None):
    """grouped_wgrad of each (a_RN, b_RK) pair, yielded in turn (a caller that drops each gradient
    holds one at a time). MXFP8: each distinct operand tensor is quantized once, up front, however
    many pairs it serves (the expert FFN's x serves w_gate's and w_up's gradients)."""
    pairs = list(pairs)
    for a_RN, b_RK in pairs:
        for name, t in (("a_RN", a_RN), ("b_RK", b_RK)):
            if t.dtype != torch.bfloat16 or t.dim() != 2:
                raise ValueError(f"grouped_wgrad: {name} must be bfloat16 [R, *], got {t.dtype} {tuple(t.shape)}")
    if precision == "mxfp8":
        values = {}  # id(operand) -> its MXFP8 values (the operands stay alive in pairs meanwhile)
        for t in (t for pair in pairs for t in pair):
            if id(t) not in values:
                values[id(t)] = mxfp8_fake_quantize_groups(t, group_end_E)
        pairs = [(values[id(a_RN)], values[id(b_RK)]) for a_RN, b_RK in pairs]
    for a_RN, b_RK in pairs:
        yield _grouped_wgrad_values(a_RN, b_RK, group_end_E, precision, table)


def _grouped_wgrad_values(a_RN, b_RK, group_end_E, precision: str, table) -> torch.Tensor:
    """grouped_wgrad on the operands' values as they are (bf16, already MXFP8 values for MXFP8)."""
    a_RN, b_RK = a_RN.contiguous(), b_RK.contiguous()
    for name, t in (("a_RN", a_RN), ("b_RK", b_RK)):
        if t.shape[1] % 8 or t.data_ptr() % 16:  # each expert's rows are a TMA descriptor's rows
            raise ValueError(f"grouped_wgrad: {name}'s rows must be 16-byte aligned (a multiple of 8 features, "
                             f"a 16-byte aligned start), got {tuple(t.shape)} at {t.data_ptr() % 16} bytes past 16")
    num_experts, n, k = group_end_E.shape[0], a_RN.shape[1], b_RK.shape[1]
    c_ENK = torch.empty(num_experts, n, k, dtype=torch.bfloat16, device=a_RN.device)
    if not a_RN.shape[0]:  # no rows: no row for the kernels' TMA descriptors to start at
        return c_ENK.zero_()
    if num_experts:
        kernel, cfg, _ = tile_configs.select("wgrad", precision, a_RN.shape[0] / num_experts,
                                             tile_configs.chip_of(a_RN), n=n, k=k, table=table)
        flat = cfg.loop == "flat"
        n_tiles, k_tiles = triton.cdiv(n, cfg.BN), triton.cdiv(k, cfg.BK)
        prog_end_E, k_tiles_per_prog_E, max_programs = _wgrad_programs(group_end_E, a_RN.shape[0], cfg.BR, n_tiles,
                                                                       k_tiles, flat)
        args = (a_RN, b_RK, c_ENK, group_end_E, prog_end_E, k_tiles_per_prog_E, n, k, num_experts)
        _set_triton_allocator()  # the kernels make each program's TMA descriptors
        if kernel == "warp_specialized":  # one program per SM looping over the loop's programs: the same bits
            grouped_wgrad_ws._grouped_wgrad_ws_kernel[(_persistent_programs(a_RN, n_tiles * max_programs),)](
                *args, LOG_E=num_experts.bit_length(), **_kernel_args(cfg, "loop"))
        else:
            grid = (n_tiles, max_programs)
            if cfg.PERSISTENT:
                grid = (_persistent_programs(a_RN, n_tiles * max_programs),)
            _grouped_wgrad_kernel[grid](*args, LOG_E=num_experts.bit_length(), FLAT=flat, DOT_F32=_DOT_F32,
                                        **_kernel_args(cfg, "loop"))
    return c_ENK


def _wgrad_programs(group_end_E, num_rows: int, block_rows: int, n_tiles: int, k_tiles: int, flat: bool):
    """(cumulative programs per expert [E], K tiles per program [E], an upper bound of the programs)
    for one column of BN features, on the device (no host sync).

    Row loop: one K tile per program. Flat loop: each expert's K tiles in chunks of P, split further
    (fewer than _WGRAD_MIN_PROGRAMS programs otherwise), and an expert with more row blocks b than
    the average A gets max(1, P * A // b) K tiles per program: no program walks much more than
    P * A (row block, K tile) steps, where a heavy expert's programs made the tail under skewed
    routing. Which program computes a tile never changes its bits."""
    num_experts = group_end_E.shape[0]
    if not flat:
        k_tiles_per_prog_E = torch.ones(num_experts, dtype=torch.int32, device=group_end_E.device)
        prog_end_E = torch.arange(1, num_experts + 1, dtype=torch.int32, device=group_end_E.device) * k_tiles
        return prog_end_E, k_tiles_per_prog_E, num_experts * k_tiles
    splits = min(k_tiles, triton.cdiv(_WGRAD_MIN_PROGRAMS, n_tiles * num_experts))
    per_program = triton.cdiv(k_tiles, splits)
    avg_blocks = max(1, triton.cdiv(num_rows, block_rows * num_experts))
    counts_E = torch.diff(group_end_E, prepend=group_end_E.new_zeros(1))
    blocks_E = torch.clamp(torch.div(counts_E + block_rows - 1, block_rows, rounding_mode="floor"), min=1)
    k_tiles_per_prog_E = torch.clamp(torch.div(per_program * avg_blocks, blocks_E, rounding_mode="floor"), 1, per_program)
    programs_E = torch.div(k_tiles + k_tiles_per_prog_E - 1, k_tiles_per_prog_E, rounding_mode="floor")
    # Bound: an average expert has cdiv(k_tiles, P) programs; one with b > A blocks at most
    # k_tiles / (P * A // b) + 1 <= 2 * k_tiles * b / (P * A) + 1, and the blocks sum to at most R / BR + E.
    heavy = triton.cdiv(2 * k_tiles * (triton.cdiv(num_rows, block_rows) + num_experts), per_program * avg_blocks)
    max_programs = min(num_experts * (triton.cdiv(k_tiles, per_program) + 1) + heavy, num_experts * k_tiles)
    return programs_E.cumsum(0).to(torch.int32), k_tiles_per_prog_E.to(torch.int32), max_programs
