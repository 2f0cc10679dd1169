"""Warp-specialized grouped GEMM for Hopper (Gluon): ``grouped_mm``'s kinds on CUDA where ``tile_configs`` picks it
(every MXFP8 kind for K a multiple of 32 * KB; the bf16 SwiGLU backward, ``MX = False``: the wgmmas read the bf16
weights from shared memory, nothing to dequantize).

Same contract and K order as ``grouped_gemm._grouped_mm_tma_kernel`` (same MX), which stays the
definition it must match bit for bit (GPU test) and the path Triton's CPU interpreter runs (Gluon has
no interpreter). The product is computed transposed, C^T [BN weight rows, BM tokens] = W @ A^T, so
the dequantized weights are the MMA's register operand and never go back to shared memory:

- loader (1 warp): per load, TMA copies of KB activation tiles [BM, 32] (bf16) and of the E4M3 weight
  tile(s) [BN, 32 * KB] (128-byte rows: the HBM streams those far better than 32-byte ones);
- two consumer warpgroups, each owning 64 of the tile's weight rows: dequantize the load's KB blocks
  (E4M3 * 2^e -> bf16, exact; ``mxfp8_quant.mx_dequantize_bits_sm90``: bit placement and one bf16x2
  multiply, a second one for experts whose scales pass 2^7, chosen per tile) in registers, issue their
  wgmmas, wait, hand the slot back, and at the end store their half of the tile, rounded as
  ``grouped_tiles._epilogue`` rounds (shared with the Triton kernel), 16 bytes per store. Weights in MMA order
  (``MXTensor.mma_order``, as the MoE layer quantizes them) reach the registers by one 8-byte shared
  load per row and block, in index order by four 2-byte ones; a row's four scales by one 4-byte load.

A consumer defines all of a load's register operands before its first wgmma: a register operand
redefined while a wgmma is in flight makes ptxas serialize every wgmma of the kernel. So a warpgroup
never overlaps its own dequantization with its MMAs; the two warpgroups (separate partitions, so no
barrier ties them) fill the tensor cores for each other (making them take turns measured slower:
ptxas interleaves a load's HGMMA issue with the dequantization of its later blocks). DUAL runs its
two (A, B) pairs as consecutive loads into one accumulator; SWIGLU dequantizes two weights per block;
ROW_BLOCKS = 2 (the one-weight kinds) two 128-row blocks of their weight, the same way, so that one
activation tile serves 256 weight rows (committed for plain; offline, the SwiGLU backward spills 1 KB with it).
Every partition walks the program's tiles t, t + grid, ... (one tile each unless launched
persistent), its ring position carried across tiles. HALF_TILES: the consumers run a tile that holds
at most BM / 2 of its expert's rows on BM / 2-token MMAs against the first half of the loaded
activation tiles (the loader is unchanged), with the same instructions per token: the same bits.
"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from titan_mok.kernels.grouped_tiles import _bf16_rne, _epilogue, _swiglu_out, _tile_of_program
from titan_mok.kernels.mxfp8_quant import mx_dequantize_bits_sm90

KB = 4  # 32-wide K blocks per load: [BN, 128] E4M3 weight tiles
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}


def tma_descriptor(t2d: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """Gluon TMA descriptor of a checked row-major 2D view (grouped_gemm._tma_descriptor), with the
    default swizzled shared layout for its block."""
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t2d.dtype])
    return TensorDescriptor.from_tensor(t2d, block, layout)


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """The barriers of a ring of STAGES load slots: full[s] (the loader's copies into slot s arrived) and empty[s]
    (both consumer warpgroups are done with it)."""
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    return full, empty


@gluon.jit
def ring_mma(a, b, acc, full, empty, c, STAGES: gl.constexpr, FIRST, b2=None, acc2=None):
    """A consumer's MMA step at ring position c (operands a, b in slot c % STAGES), for the bf16 kernels whose loads
    are one step each (grouped_mm_coop, grouped_wgrad_ws): wait for the load, start the MMA, and once the previous
    step's MMA is done (one left in flight) hand that step's slot back, unless this is the first step (FIRST).
    b2, acc2 (SwiGLU gate/up's up weight): a second MMA on the same a, both in flight; then (acc, acc2) returns."""
    mbarrier.wait(full.index(c % STAGES), (c // STAGES) & 1)
    acc = warpgroup_mma(a, b, acc, is_async=True)
    if acc2 is None:
        acc = warpgroup_mma_wait(1, deps=(acc,))
    else:
        acc2 = warpgroup_mma(a, b2, acc2, is_async=True)
        acc, acc2 = warpgroup_mma_wait(2, deps=(acc, acc2))
    if not FIRST:
        mbarrier.arrive(empty.index((c - 1) % STAGES), count=1)
    if acc2 is None:
        return acc
    else:
        return acc, acc2


@gluon.jit
def ring_mma_done(acc, empty, c, STAGES: gl.constexpr, acc2=None):
    """After ring_mma's last step (ring position c - 1): its MMAs done, its slot handed back."""
    if acc2 is None:
        acc = warpgroup_mma_wait(0, deps=(acc,))
    else:
        acc, acc2 = warpgroup_mma_wait(0, deps=(acc, acc2))
    mbarrier.arrive(empty.index((c - 1) % STAGES), count=1)
    if acc2 is None:
        return acc
    else:
        return acc, acc2


def launch(max_tiles: int, persistent: bool, *args, **kwargs):
    """The kernel on max_tiles programs (an upper bound of the tiles, one each), or persistent: one
    program per SM, each looping over tiles t, t + grid, ... up to the device-side tile count, its
    loader prefetching the next tile's loads while the consumers store the last one's results. Which
    is faster depends on the kind; the bits are the same."""
    grid = (min(max_tiles, sm_count(torch.cuda.current_device())) if persistent else max_tiles,)
    _grouped_mm_mx_ws_kernel[grid](*args, **kwargs)


@gluon.jit
def _load_a(a_desc, a_bufs, bar, s, m0, kb0, KB: gl.constexpr):
    """A load's KB bf16 activation tiles [BM, 32] into slot s."""
    for q in gl.static_range(KB):
        tma.async_copy_global_to_shared(a_desc, [m0, (kb0 + q) * 32], bar, a_bufs.index(s * KB + q))


@gluon.jit
def _load_w(b_desc, w_at, bar, w_bufs, s, next_row, kb0, NB: gl.constexpr, ROW_BLOCKS: gl.constexpr):
    """A load's weight tile from b_desc at w_at into slot s; ROW_BLOCKS = 2: also the same weight's next BN rows,
    from row next_row of [E*N, K] (past the expert's N: never stored)."""
    tma.async_copy_global_to_shared(b_desc, w_at, bar, w_bufs.index(s * NB))
    if ROW_BLOCKS == 2:
        tma.async_copy_global_to_shared(b_desc, [next_row, kb0 * 32], bar, w_bufs.index(s * NB + 1))


@gluon.jit
def _loader(a1_desc, a2_desc, b1_desc, b2_desc, a_bufs, w_bufs, full, empty, group_end_ptr, tile_end_ptr, N, K, E,
            loads_per_pair, n_loads, MODE: gl.constexpr, B_KN: gl.constexpr, NB: gl.constexpr, KB: gl.constexpr,
            STAGES: gl.constexpr, LOG_E: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr,
            ROW_BLOCKS: gl.constexpr):
    load_bytes: gl.constexpr = KB * a1_desc.block_type.nbytes + NB * b1_desc.block_type.nbytes
    c = 0  # loads issued by this program, over all its tiles: the ring position
    for t in range(gl.program_id(0), gl.load(tile_end_ptr + E - 1), gl.num_programs(0)):
        e, m0, _, n0 = _tile_of_program(t, group_end_ptr, tile_end_ptr, N, E, LOG_E, BM, BN * ROW_BLOCKS, GROUP_M)
        for l in range(n_loads):
            s = c % STAGES
            second = l >= loads_per_pair  # DUAL: the (A2, B2) pair follows (A1, B1) in the same accumulator
            kb0 = (l - gl.where(second, loads_per_pair, 0)) * KB
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
            mbarrier.expect(full.index(s), load_bytes)
            if B_KN:
                w_at = [e * K + kb0 * 32, n0]
            else:
                w_at = [e * N + n0, kb0 * 32]
            if MODE == 3:
                if second:
                    _load_a(a2_desc, a_bufs, full.index(s), s, m0, kb0, KB)
                    _load_w(b2_desc, w_at, full.index(s), w_bufs, s, e * N + n0 + BN, kb0, NB, ROW_BLOCKS)
                else:
                    _load_a(a1_desc, a_bufs, full.index(s), s, m0, kb0, KB)
                    _load_w(b1_desc, w_at, full.index(s), w_bufs, s, e * N + n0 + BN, kb0, NB, ROW_BLOCKS)
            else:
                _load_a(a1_desc, a_bufs, full.index(s), s, m0, kb0, KB)
                _load_w(b1_desc, w_at, full.index(s), w_bufs, s, e * N + n0 + BN, kb0, NB, ROW_BLOCKS)
                if NB == 2 and ROW_BLOCKS == 1:  # SWIGLU's second weight
                    tma.async_copy_global_to_shared(b2_desc, w_at, full.index(s), w_bufs.index(s * NB + 1))
            c += 1


@gluon.jit
def _first_step(l, loads_per_pair, k_steps, KB: gl.constexpr):
    """The scale step of load l's first K block (DUAL: the second pair's steps follow the first's)."""
    second = l >= loads_per_pair
    return (l - gl.where(second, loads_per_pair, 0)) * KB + gl.where(second, k_steps, 0)


@gluon.constexpr_function
def _mma_order_layout():
    """A [64, 32] block of a warpgroup's weight rows stored in MMA order (titan_mok.kernels.mxfp8.to_mma_order) as each
    thread reads it: 8 adjacent bytes (t, c, h, l) of rows g and g + 8 of its warp's 16, lane 4g + t. Read back in
    index order (_index_order) it is the wgmma's register operand layout (DotOperandLayout, k_width 2)."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
                                      lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32])


@gluon.jit
def _index_order(w, W_OP: gl.constexpr):
    """Block w [64, 32] read in _mma_order_layout, its elements relabelled from (t, c, h, l) to index order
    (c, h, t, l): the same registers, now the MMA's operand (assert_trivial: no data moves)."""
    w = w.reshape(64, 4, 2, 2, 2).permute(0, 2, 3, 1, 4).reshape(64, 32)
    return gl.convert_layout(w, W_OP, assert_trivial=True)


@gluon.jit
def _w_operand(w_buf, q: gl.constexpr, half: gl.constexpr, bits, WIDE: gl.constexpr, B_KN: gl.constexpr,
               MMA_ORDER: gl.constexpr, W_OP: gl.constexpr, MX: gl.constexpr):
    """This warpgroup's 64 weight rows of K block q of a loaded E4M3 tile, as the MMA's register
    operand [64, 32] bf16: E4M3 * 2^(bits - 127), exact. MMA_ORDER: a thread's bytes of a row are
    adjacent, one 8-byte shared-memory load per row and block (else one 2-byte load per pair). A bf16
    tile (not MX): the block's shared-memory view, the MMA's operand as it is."""
    if B_KN:  # the tile is [32 * KB, BN]
        blk = w_buf.slice(q * 32, 32, dim=0).slice(half * 64, 64, dim=1).permute((1, 0))
    else:  # the tile is [BN, 32 * KB]
        blk = w_buf.slice(half * 64, 64, dim=0).slice(q * 32, 32, dim=1)
    if not MX:  # bf16 weights: the wgmma reads them from shared memory
        w = blk
    elif MMA_ORDER:
        w = _index_order(mx_dequantize_bits_sm90(blk.load(_mma_order_layout()), bits, 1, WIDE, True), W_OP)
    else:
        w = mx_dequantize_bits_sm90(blk.load(W_OP), gl.convert_layout(bits, gl.SliceLayout(1, W_OP)), 1, WIDE, False)
    return w


@gluon.jit
def _w_operands(w_bufs, s, q: gl.constexpr, half: gl.constexpr, bits, WIDE: gl.constexpr, B_KN: gl.constexpr,
                MMA_ORDER: gl.constexpr, NB: gl.constexpr, W_OP: gl.constexpr, MX: gl.constexpr):
    """K block q's operand(s) from slot s, with that block's scale bits (b1, b2; MX only)."""
    w1 = _w_operand(w_bufs.index(s * NB), q, half, bits[0], WIDE, B_KN, MMA_ORDER, W_OP, MX)
    if NB == 2:
        w2 = _w_operand(w_bufs.index(s * NB + 1), q, half, bits[1], WIDE, B_KN, MMA_ORDER, W_OP, MX)
    else:
        w2 = w1
    return w1, w2


@gluon.jit
def _mma_block(a_bufs, slot, w1, w2, acc1, acc2, NB: gl.constexpr, BMT: gl.constexpr, T0: gl.constexpr = 0):
    # the activation tile's tokens [T0, T0 + BMT) [BMT, 32] as the MMA's B [32, BMT]
    x = a_bufs.index(slot).slice(T0, BMT, dim=0).permute((1, 0))
    acc1 = warpgroup_mma(w1, x, acc1, is_async=True)
    if NB == 2:
        acc2 = warpgroup_mma(w2, x, acc2, is_async=True)
    return acc1, acc2


@gluon.jit
def _mma_load(a_bufs, s, w1a, w2a, w1b, w2b, w1c, w2c, w1d, w2d, acc1, acc2, NB: gl.constexpr, BMT: gl.constexpr,
              KB: gl.constexpr, T0: gl.constexpr = 0):
    """The MMAs of one load's four K blocks (ring slot s) against tokens [T0, T0 + BMT), issued, not waited on."""
    acc1, acc2 = _mma_block(a_bufs, s * KB + 0, w1a, w2a, acc1, acc2, NB, BMT, T0)
    acc1, acc2 = _mma_block(a_bufs, s * KB + 1, w1b, w2b, acc1, acc2, NB, BMT, T0)
    acc1, acc2 = _mma_block(a_bufs, s * KB + 2, w1c, w2c, acc1, acc2, NB, BMT, T0)
    acc1, acc2 = _mma_block(a_bufs, s * KB + 3, w1d, w2d, acc1, acc2, NB, BMT, T0)
    return acc1, acc2


@gluon.jit
def _consumer(a_bufs, w_bufs, full, empty, sb1_ptr, sb2_ptr, wide_ptr, c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr,
              group_end_ptr, tile_end_ptr, N, E, k_steps, n_steps, loads_per_pair, n_loads, stride_se, stride_sn, limit,
              MODE: gl.constexpr, HAS_LIMIT: gl.constexpr, B_KN: gl.constexpr, MMA_ORDER: gl.constexpr,
              NB: gl.constexpr, LOG_E: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr,
              KB: gl.constexpr, STAGES: gl.constexpr, HALF_TILES: gl.constexpr, SPLIT_TILES: gl.constexpr,
              half: gl.constexpr, ROW_BLOCKS: gl.constexpr, MX: gl.constexpr):
    """One warpgroup: for each of the program's tiles, weight rows [n0 + 64 * half, +64) against its
    BM tokens (HALF_TILES: against the first BM / 2 where the tile holds no more of its expert's
    rows: half the MMA work, the same instructions per token; SPLIT_TILES: against the first
    BM / 2 + BM / 4 as two MMAs on each dequantized block, where the tile holds no more: 3/4 of the
    MMA work), then their epilogue."""
    c = 0  # loads consumed by this program, over all its tiles: the ring position
    for t in range(gl.program_id(0), gl.load(tile_end_ptr + E - 1), gl.num_programs(0)):
        e, m0, row_end, n0 = _tile_of_program(t, group_end_ptr, tile_end_ptr, N, E, LOG_E, BM, BN * ROW_BLOCKS,
                                              GROUP_M)
        if HALF_TILES and row_end - m0 <= BM // 2:
            c = _consume_tile(a_bufs, w_bufs, full, empty, sb1_ptr, sb2_ptr, wide_ptr, c1_ptr, c2_ptr, c3_ptr,
                              g_ptr, u_ptr, e, m0, row_end, n0, c, N, k_steps, n_steps, loads_per_pair, n_loads,
                              stride_se, stride_sn, limit, MODE, HAS_LIMIT, B_KN, MMA_ORDER, NB, BM // 2, 0, KB, STAGES,
                              half, ROW_BLOCKS, MX)
        elif SPLIT_TILES and row_end - m0 <= BM // 2 + BM // 4:
            c = _consume_tile(a_bufs, w_bufs, full, empty, sb1_ptr, sb2_ptr, wide_ptr, c1_ptr, c2_ptr, c3_ptr,
                              g_ptr, u_ptr, e, m0, row_end, n0, c, N, k_steps, n_steps, loads_per_pair, n_loads,
                              stride_se, stride_sn, limit, MODE, HAS_LIMIT, B_KN, MMA_ORDER, NB, BM // 2, BM // 4, KB,
                              STAGES, half, ROW_BLOCKS, MX)
        else:
            c = _consume_tile(a_bufs, w_bufs, full, empty, sb1_ptr, sb2_ptr, wide_ptr, c1_ptr, c2_ptr, c3_ptr,
                              g_ptr, u_ptr, e, m0, row_end, n0, c, N, k_steps, n_steps, loads_per_pair, n_loads,
                              stride_se, stride_sn, limit, MODE, HAS_LIMIT, B_KN, MMA_ORDER, NB, BM, 0, KB, STAGES,
                              half, ROW_BLOCKS, MX)


@gluon.jit
def _consume_tile(a_bufs, w_bufs, full, empty, sb1_ptr, sb2_ptr, wide_ptr, c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr, e,
                  m0, row_end, n0, c, N, k_steps, n_steps, loads_per_pair, n_loads, stride_se, stride_sn, limit,
                  MODE: gl.constexpr, HAS_LIMIT: gl.constexpr, B_KN: gl.constexpr, MMA_ORDER: gl.constexpr,
                  NB: gl.constexpr, BMT: gl.constexpr, BMT2: gl.constexpr, KB: gl.constexpr, STAGES: gl.constexpr,
                  half: gl.constexpr, ROW_BLOCKS: gl.constexpr, MX: gl.constexpr):
    """One tile's loads (ring positions c, c + 1, ...) against its first BMT tokens (and, BMT2 > 0, the next
    BMT2 in a second set of accumulators), and its epilogue; returns the ring position after them."""
    offs_n = n0 + half * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, _acc_layout(BMT)))
    # one branch per tile around two copies of the loop: a branch per block keeps ptxas from interleaving
    # the HGMMA issue with the dequantization; bf16 weights (not MX): one copy
    if MX:
        wide = gl.load(wide_ptr + e) != 0
    else:
        wide = False
    if wide:
        acc1, acc2, acc1b, acc2b, c = _dequant_tile(a_bufs, w_bufs, full, empty, sb1_ptr, sb2_ptr, e, n0, c, N,
                                                    k_steps, n_steps, loads_per_pair, n_loads, stride_se, stride_sn,
                                                    MODE, B_KN, MMA_ORDER, NB, BMT, BMT2, KB, STAGES, True, half,
                                                    ROW_BLOCKS, MX)
    else:
        acc1, acc2, acc1b, acc2b, c = _dequant_tile(a_bufs, w_bufs, full, empty, sb1_ptr, sb2_ptr, e, n0, c, N,
                                                    k_steps, n_steps, loads_per_pair, n_loads, stride_se, stride_sn,
                                                    MODE, B_KN, MMA_ORDER, NB, BMT, BMT2, KB, STAGES, False, half,
                                                    ROW_BLOCKS, MX)
    if BMT2 > 0:
        _tile_epilogue(acc1b, acc2b, m0 + BMT, row_end, offs_n, N, c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr, limit,
                       MODE, HAS_LIMIT, BMT2)
        if ROW_BLOCKS == 2:  # acc2b: the second row block's (BN = 128 rows on), stored as plain's acc1b
            _tile_epilogue(acc2b, acc2b, m0 + BMT, row_end, offs_n + 128, N, c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr,
                           limit, MODE, HAS_LIMIT, BMT2)
    _tile_epilogue(acc1, acc2, m0, row_end, offs_n, N, c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr, limit, MODE, HAS_LIMIT,
                   BMT)
    if ROW_BLOCKS == 2:
        _tile_epilogue(acc2, acc2, m0, row_end, offs_n + 128, N, c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr, limit, MODE,
                       HAS_LIMIT, BMT)
    return c


@gluon.jit
def _tile_epilogue(acc1, acc2, r0, row_end, offs_n, N, c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr, limit,
                   MODE: gl.constexpr, HAS_LIMIT: gl.constexpr, BMT: gl.constexpr):
    """Stores of the accumulators [64 weight rows, BMT tokens from r0]: rounded to bf16 in the accumulator's
    layout, then turned through shared memory so that each thread stores 8 adjacent features of a token (a
    token's features are contiguous in the output): 16-byte stores instead of the accumulator layout's 2-byte
    ones, level to 34% faster per kind. SwiGLU backward turns its fp32 dh instead, so
    that g and u are loaded 16 bytes at a time too."""
    ST: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
    feats = gl.convert_layout(offs_n, gl.SliceLayout(1, ST))
    toks = r0 + gl.arange(0, BMT, layout=gl.SliceLayout(0, ST))
    off = gl.expand_dims(toks.to(gl.int64) * N, 0) + gl.expand_dims(feats, 1)
    ok = gl.expand_dims(toks < row_end, 0) & gl.expand_dims(feats < N, 1)
    if MODE == 1:
        g, u, h = _swiglu_out(acc1, acc2, limit, HAS_LIMIT)
        gl.store(c1_ptr + off, gl.convert_layout(g, ST), mask=ok)
        gl.store(c2_ptr + off, gl.convert_layout(u, ST), mask=ok)
        gl.store(c3_ptr + off, gl.convert_layout(h, ST), mask=ok)
    elif MODE == 2:
        _epilogue(gl.convert_layout(acc1, ST), acc1, off, ok, c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr, limit, MODE,
                  HAS_LIMIT)
    else:
        gl.store(c1_ptr + off, gl.convert_layout(_bf16_rne(acc1), ST), mask=ok)


@gluon.constexpr_function
def _acc_layout(BMT):
    """The accumulator [64 weight rows, BMT tokens] of a warpgroup's bf16 wgmmas (K 16 per instruction)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BMT, 16])


@gluon.jit
def _dequant_tile(a_bufs, w_bufs, full, empty, sb1_ptr, sb2_ptr, e, n0, c, N, k_steps, n_steps, loads_per_pair,
                  n_loads, stride_se, stride_sn, MODE: gl.constexpr, B_KN: gl.constexpr, MMA_ORDER: gl.constexpr,
                  NB: gl.constexpr, BMT: gl.constexpr, BMT2: gl.constexpr, KB: gl.constexpr, STAGES: gl.constexpr,
                  WIDE: gl.constexpr, half: gl.constexpr, ROW_BLOCKS: gl.constexpr, MX: gl.constexpr):
    """The tile's accumulators (acc1, acc2 over the first BMT tokens; acc1b, acc2b over the next BMT2 where
    BMT2 > 0, else aliases) by bf16 MMAs on dequantized weights (not MX: on the bf16 weights in shared memory),
    and the ring position. WIDE: the expert has scales above 2^7 (mx_dequantize_bits_sm90's second multiply)."""
    gl.static_assert(KB == 4, "_dequant_tile unrolls four K blocks per load")
    ACC: gl.constexpr = _acc_layout(BMT)
    W_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    offs_w = n0 + half * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, _mma_order_layout()))
    n_ok = offs_w < N
    s_off = e.to(gl.int64) * stride_se + offs_w * stride_sn
    if ROW_BLOCKS == 2:  # the second weight tile holds the same weight's next 128 rows (BN): their scales
        s_off2 = s_off + 128 * stride_sn
        n_ok2 = offs_w + 128 < N
    else:
        s_off2 = s_off
        n_ok2 = n_ok
    if MX:
        bits = _load_bits(sb1_ptr, sb2_ptr, s_off, s_off2, n_ok, n_ok2, 0, loads_per_pair, k_steps, n_steps, MODE, NB,
                          KB, ROW_BLOCKS)
    else:  # no scales
        bits = ((0, 0), (0, 0), (0, 0), (0, 0))
    acc1 = gl.zeros([64, BMT], gl.float32, ACC)
    if NB == 2:
        acc2 = gl.zeros([64, BMT], gl.float32, ACC)
    if BMT2 > 0:
        acc1b = gl.zeros([64, BMT2], gl.float32, _acc_layout(BMT2))
        if NB == 2:
            acc2b = gl.zeros([64, BMT2], gl.float32, _acc_layout(BMT2))
    for l in range(n_loads):
        s = c % STAGES
        if MX:  # the next load's scale bits: their global-load latency overlaps this load's conversions and MMAs
            nxt = _load_bits(sb1_ptr, sb2_ptr, s_off, s_off2, n_ok, n_ok2, l + 1, loads_per_pair, k_steps, n_steps,
                             MODE, NB, KB, ROW_BLOCKS)
        mbarrier.wait(full.index(s), (c // STAGES) & 1)
        w1a, w2a = _w_operands(w_bufs, s, 0, half, bits[0], WIDE, B_KN, MMA_ORDER, NB, W_OP, MX)
        w1b, w2b = _w_operands(w_bufs, s, 1, half, bits[1], WIDE, B_KN, MMA_ORDER, NB, W_OP, MX)
        w1c, w2c = _w_operands(w_bufs, s, 2, half, bits[2], WIDE, B_KN, MMA_ORDER, NB, W_OP, MX)
        w1d, w2d = _w_operands(w_bufs, s, 3, half, bits[3], WIDE, B_KN, MMA_ORDER, NB, W_OP, MX)
        if NB == 2:
            acc1, acc2 = _mma_load(a_bufs, s, w1a, w2a, w1b, w2b, w1c, w2c, w1d, w2d, acc1, acc2, NB, BMT, KB)
            if BMT2 > 0:  # the same registers against the next BMT2 tokens
                acc1b, acc2b = _mma_load(a_bufs, s, w1a, w2a, w1b, w2b, w1c, w2c, w1d, w2d, acc1b, acc2b, NB, BMT2,
                                         KB, BMT)
                acc1, acc2, acc1b, acc2b = warpgroup_mma_wait(0, deps=(acc1, acc2, acc1b, acc2b))
            else:
                acc1, acc2 = warpgroup_mma_wait(0, deps=(acc1, acc2))
        else:  # no second accumulator carried through the loop
            acc1, _ = _mma_load(a_bufs, s, w1a, w1a, w1b, w1b, w1c, w1c, w1d, w1d, acc1, acc1, NB, BMT, KB)
            if BMT2 > 0:
                acc1b, _ = _mma_load(a_bufs, s, w1a, w1a, w1b, w1b, w1c, w1c, w1d, w1d, acc1b, acc1b, NB, BMT2, KB,
                                     BMT)
                acc1, acc1b = warpgroup_mma_wait(0, deps=(acc1, acc1b))
            else:
                acc1 = warpgroup_mma_wait(0, deps=(acc1,))
        mbarrier.arrive(empty.index(s), count=1)
        c += 1
        if MX:
            bits = nxt
    if NB == 1:
        acc2 = acc1  # unused outside SWIGLU
        if BMT2 > 0:
            acc2b = acc1b
    if BMT2 == 0:  # no second set: aliases, never stored
        acc1b = acc1
        acc2b = acc2
    return acc1, acc2, acc1b, acc2b, c


@gluon.jit
def _load_bits(sb1_ptr, sb2_ptr, s_off, s_off2, n_ok, n_ok2, l, loads_per_pair, k_steps, n_steps, MODE: gl.constexpr,
               NB: gl.constexpr, KB: gl.constexpr, ROW_BLOCKS: gl.constexpr):
    """Raw E8M0 bits of the weight rows' four K blocks of load l, ((b1, b2) per block; 127, i.e. 2^0, past the
    last load). The scales are contiguous along K and a load's first step is a multiple of 4: one 4-byte load per
    row and weight (DUAL: the second pair's steps follow the first's, B2's scales). The second word: SWIGLU's
    second weight (sb2_ptr) at the same rows; ROW_BLOCKS = 2, the same weight's rows 128 on (s_off2, n_ok2)."""
    i0 = _first_step(l, loads_per_pair, k_steps, KB)
    second = i0 >= k_steps
    kb = i0 - gl.where(second, k_steps, 0)
    ok = n_ok & (i0 < n_steps)
    if MODE == 3:
        sb_ptr = gl.where(second, sb2_ptr, sb1_ptr)
    else:
        sb_ptr = sb1_ptr
    word1 = gl.load((sb_ptr + s_off + kb).to(gl.pointer_type(gl.int32)), mask=ok, other=0x7F7F7F7F)
    if NB == 2:
        if ROW_BLOCKS == 2:
            sb_ptr2 = sb_ptr
        else:
            sb_ptr2 = sb2_ptr
        word2 = gl.load((sb_ptr2 + s_off2 + kb).to(gl.pointer_type(gl.int32)), mask=n_ok2 & (i0 < n_steps),
                        other=0x7F7F7F7F)
    else:
        word2 = word1
    return ((word1 & 0xFF, word2 & 0xFF), ((word1 >> 8) & 0xFF, (word2 >> 8) & 0xFF),
            ((word1 >> 16) & 0xFF, (word2 >> 16) & 0xFF), ((word1 >> 24) & 0xFF, (word2 >> 24) & 0xFF))


@gluon.jit
def _grouped_mm_mx_ws_kernel(
    # TMA: A [R, K] bf16 blocks [BM, 32]; B E4M3 (not MX: bf16) blocks [BN, 32 * KB] (or [32 * KB, BN], B_KN)
    a1_desc, a2_desc, b1_desc, b2_desc,
    sb1_ptr, sb2_ptr,  # E8M0 bits of the B operands, contiguous [E, N, K/32] (grouped_gemm._scales_by_row); not MX: unused
    wide_ptr,  # int32 [E]: 1 where an expert's B scales pass 2^7 (grouped_gemm._wide_scale_experts); not MX: unused
    c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr,
    group_end_ptr, tile_end_ptr,
    N, K, E,
    stride_se, stride_sn,
    limit,
    MODE: gl.constexpr, HAS_LIMIT: gl.constexpr, LOG_E: gl.constexpr, B_KN: gl.constexpr, MMA_ORDER: gl.constexpr,
    BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, KB: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, HALF_TILES: gl.constexpr, num_warps: gl.constexpr,
    SPLIT_TILES: gl.constexpr = False, ROW_BLOCKS: gl.constexpr = 1, MX: gl.constexpr = True,
):
    gl.static_assert(BN == 128 and num_warps == 4, "two consumer warpgroups of 64 weight rows each")
    gl.static_assert(MX or not MMA_ORDER, "bf16 weights (not MX) are bf16 MMAs' operands in index order")
    gl.static_assert(ROW_BLOCKS == 1 or (ROW_BLOCKS == 2 and MODE != 1 and not B_KN),
                     "ROW_BLOCKS = 2: the one-weight kinds, weights [E, N, K]")
    NB: gl.constexpr = 2 if MODE == 1 or ROW_BLOCKS == 2 else 1  # weight tiles per load (SWIGLU: gate and up)
    k_steps = K // 32
    pairs = 2 if MODE == 3 else 1
    n_steps = k_steps * pairs
    loads_per_pair = k_steps // KB  # the launcher checks K % (32 * KB) == 0
    n_loads = loads_per_pair * pairs

    a_bufs = gl.allocate_shared_memory(a1_desc.dtype, [STAGES * KB] + a1_desc.block_type.shape, a1_desc.layout)
    w_bufs = gl.allocate_shared_memory(b1_desc.dtype, [STAGES * NB] + b1_desc.block_type.shape, b1_desc.layout)
    # ring_barriers, written out: called, it changes how ptxas schedules this kernel (the measured code is this one)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumer warpgroups

    gl.warp_specialize([
        (_consumer, (a_bufs, w_bufs, full, empty, sb1_ptr, sb2_ptr, wide_ptr, c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr,
                     group_end_ptr, tile_end_ptr, N, E, k_steps, n_steps, loads_per_pair, n_loads, stride_se,
                     stride_sn, limit, MODE, HAS_LIMIT, B_KN, MMA_ORDER, NB, LOG_E, BM, BN, GROUP_M, KB, STAGES,
                     HALF_TILES, SPLIT_TILES, 0, ROW_BLOCKS, MX)),
        (_consumer, (a_bufs, w_bufs, full, empty, sb1_ptr, sb2_ptr, wide_ptr, c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr,
                     group_end_ptr, tile_end_ptr, N, E, k_steps, n_steps, loads_per_pair, n_loads, stride_se,
                     stride_sn, limit, MODE, HAS_LIMIT, B_KN, MMA_ORDER, NB, LOG_E, BM, BN, GROUP_M, KB, STAGES,
                     HALF_TILES, SPLIT_TILES, 1, ROW_BLOCKS, MX)),
        (_loader, (a1_desc, a2_desc, b1_desc, b2_desc, a_bufs, w_bufs, full, empty, group_end_ptr, tile_end_ptr, N, K,
                   E, loads_per_pair, n_loads, MODE, B_KN, NB, KB, STAGES, LOG_E, BM, BN, GROUP_M, ROW_BLOCKS)),
    ], [4, 1], [CONSUMER_REGS, 24])
