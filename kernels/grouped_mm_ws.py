"""Warp-specialized MXFP8 grouped GEMM for Hopper (Gluon): ``grouped_mm``'s MXFP8 kinds on CUDA where
``_MM_CONFIGS["mxfp8_ws/<kind>"]`` gives it a config (SwiGLU gate/up and the SwiGLU-backward dgrad,
measured faster there; NOTES.md, "Warp-specialized MXFP8 GEMM, session 6").

Same contract, tiles and K order as ``grouped_gemm._grouped_mm_tma_kernel`` (MX=True), which stays
the definition it must match bit for bit (GPU test) and the path Triton's CPU interpreter runs
(Gluon has no interpreter). What differs is who does what. In the one-warpgroup kernel each 32-wide
K step runs TMA wait -> dequantize the weight tile -> store it to shared memory -> MMA -> wait, one
after the other. Here three partitions of one CTA overlap those steps through mbarrier rings:

- loader (1 warp): TMA loads of the activation tile [BM, 32] and the E4M3 weight tile(s) [BN, 32];
- dequantizer (a warpgroup): E4M3 * 2^e -> bf16 (exact), into a ring of bf16 weight tiles;
- MMA (the default partition, num_warps warps): async wgmma on the bf16 tiles, one step in
  flight, then the epilogue (``grouped_tiles._epilogue``, shared with the Triton kernel).

One step = one 32-wide K block (one E8M0 scale per weight row). DUAL runs its two (A, B) pairs as
consecutive steps into one accumulator, SWIGLU dequantizes two weights per step.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from titan_mok.kernels.grouped_tiles import _epilogue, _tile_of_program
from titan_mok.kernels.mxfp8_quant import mx_scale_of_bits

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}


def tma_descriptor(t2d: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """Gluon TMA descriptor of a checked row-major 2D view (grouped_gemm._tma_descriptor), with the
    default swizzled shared layout for its block."""
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t2d.dtype])
    return TensorDescriptor.from_tensor(t2d, block, layout)


@gluon.jit
def _loader(a1_desc, a2_desc, b1_desc, b2_desc, a_bufs, w_bufs, full, empty, e, m0, n0, N, K, k_steps, n_steps,
            MODE: gl.constexpr, B_KN: gl.constexpr, NB: gl.constexpr, STAGES: gl.constexpr):
    step_bytes: gl.constexpr = a1_desc.block_type.nbytes + NB * b1_desc.block_type.nbytes
    for i in range(n_steps):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
        mbarrier.expect(full.index(s), step_bytes)
        second = i >= k_steps  # DUAL: the (A2, B2) pair follows (A1, B1) in the same accumulator
        k = (i - gl.where(second, k_steps, 0)) * 32
        if MODE == 3:
            if second:
                _load_step(a2_desc, b2_desc, b2_desc, a_bufs, w_bufs, full, s, e, m0, n0, N, K, k, B_KN, NB)
            else:
                _load_step(a1_desc, b1_desc, b1_desc, a_bufs, w_bufs, full, s, e, m0, n0, N, K, k, B_KN, NB)
        else:
            _load_step(a1_desc, b1_desc, b2_desc, a_bufs, w_bufs, full, s, e, m0, n0, N, K, k, B_KN, NB)


@gluon.jit
def _load_step(a_desc, b1_desc, b2_desc, a_bufs, w_bufs, full, s, e, m0, n0, N, K, k, B_KN: gl.constexpr,
               NB: gl.constexpr):
    tma.async_copy_global_to_shared(a_desc, [m0, k], full.index(s), a_bufs.index(s))
    if B_KN:
        w_at = [e * K + k, n0]
    else:
        w_at = [e * N + n0, k]
    tma.async_copy_global_to_shared(b1_desc, w_at, full.index(s), w_bufs.index(s * NB))
    if NB == 2:
        tma.async_copy_global_to_shared(b2_desc, w_at, full.index(s), w_bufs.index(s * NB + 1))


@gluon.jit
def _dequantizer(w_bufs, wbf_bufs, full, empty, wready, wempty, sb1_ptr, sb2_ptr, e, n0, N, k_steps, n_steps,
                 stride_se, stride_sn, stride_sk,
                 MODE: gl.constexpr, B_KN: gl.constexpr, NB: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                 WSTAGES: gl.constexpr):
    # one warpgroup; each thread converts 16 consecutive bytes of a weight row: one 16-byte shared
    # load, two 16-byte stores
    if B_KN:  # tiles [32, BN], scales along dim 1
        DQ: gl.constexpr = gl.BlockedLayout([1, 16], [512 // BN, BN // 16], [4, 1], [1, 0])
        S_LAYOUT: gl.constexpr = gl.SliceLayout(0, DQ)
    else:  # tiles [BN, 32], scales along dim 0
        DQ: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
        S_LAYOUT: gl.constexpr = gl.SliceLayout(1, DQ)
    offs_n = n0 + gl.arange(0, BN, layout=S_LAYOUT)
    n_ok = offs_n < N
    s_off = e.to(gl.int64) * stride_se + offs_n * stride_sn
    # E8M0 bits two steps ahead, so a step's global-load latency overlaps earlier steps' work
    sa1, sa2 = _step_scales(sb1_ptr, sb2_ptr, s_off, n_ok, 0, k_steps, n_steps, stride_sk, MODE, NB)
    sb1, sb2 = _step_scales(sb1_ptr, sb2_ptr, s_off, n_ok, 1, k_steps, n_steps, stride_sk, MODE, NB)
    for i in range(n_steps):
        s = i % STAGES
        j = i % WSTAGES
        mbarrier.wait(wempty.index(j), ((i // WSTAGES) & 1) ^ 1)  # the MMAs that read slot j are done
        s1, s2 = sa1, sa2
        sa1, sa2 = sb1, sb2
        sb1, sb2 = _step_scales(sb1_ptr, sb2_ptr, s_off, n_ok, i + 2, k_steps, n_steps, stride_sk, MODE, NB)
        mbarrier.wait(full.index(s), (i // STAGES) & 1)
        wbf_bufs.index(j * NB).store(_dequantize(w_bufs.index(s * NB).load(DQ), s1, B_KN))
        if NB == 2:
            wbf_bufs.index(j * NB + 1).store(_dequantize(w_bufs.index(s * NB + 1).load(DQ), s2, B_KN))
        # the stores above used the loaded values, so the E4M3 slot has been read: hand it back (its
        # shared reads are complete, so no proxy fence is needed before the next TMA write)
        mbarrier.arrive(empty.index(s), count=1)
        fence_async_shared()  # generic-proxy stores before the wgmma (async proxy) reads them
        mbarrier.arrive(wready.index(j), count=1)


@gluon.jit
def _step_scales(sb1_ptr, sb2_ptr, s_off, n_ok, i, k_steps, n_steps, stride_sk, MODE: gl.constexpr, NB: gl.constexpr):
    """Raw E8M0 bits of step i's weight tile(s) (127, i.e. 2^0, past the last step)."""
    second = i >= k_steps  # DUAL: B2's scales for the second (A, B) pair
    kb = i - gl.where(second, k_steps, 0)
    ok = n_ok & (i < n_steps)
    if MODE == 3:
        sb_ptr = gl.where(second, sb2_ptr, sb1_ptr)
    else:
        sb_ptr = sb1_ptr
    bits1 = gl.load(sb_ptr + s_off + kb * stride_sk, mask=ok, other=127)
    if NB == 2:
        bits2 = gl.load(sb2_ptr + s_off + kb * stride_sk, mask=ok, other=127)
    else:
        bits2 = bits1
    return bits1, bits2


@gluon.jit
def _dequantize(w, bits, B_KN: gl.constexpr):
    """E4M3 tile * 2^(bits - 127) per weight row -> bf16, exact."""
    scale = mx_scale_of_bits(bits)
    if B_KN:
        out = (w.to(gl.float32) * gl.expand_dims(scale, 0)).to(gl.bfloat16)
    else:
        out = (w.to(gl.float32) * gl.expand_dims(scale, 1)).to(gl.bfloat16)
    return out


@gluon.jit
def _mma(a_bufs, wbf_bufs, full, empty, wready, wempty, n_steps,
         B_KN: gl.constexpr, NB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
         WSTAGES: gl.constexpr, ACC: gl.constexpr):
    acc1 = gl.zeros([BM, BN], gl.float32, ACC)
    if NB == 2:
        acc2 = gl.zeros([BM, BN], gl.float32, ACC)
    for i in range(n_steps):
        s = i % STAGES
        j = i % WSTAGES
        mbarrier.wait(wready.index(j), (i // WSTAGES) & 1)
        mbarrier.wait(full.index(s), (i // STAGES) & 1)
        a = a_bufs.index(s)
        acc1 = warpgroup_mma(a, _b_view(wbf_bufs.index(j * NB), B_KN), acc1, is_async=True)
        if NB == 2:
            acc2 = warpgroup_mma(a, _b_view(wbf_bufs.index(j * NB + 1), B_KN), acc2, is_async=True)
        # keep this step's MMAs in flight; the previous step's are done, so its buffers go back
        if NB == 2:
            acc1, acc2 = warpgroup_mma_wait(2, deps=(acc1, acc2))
        else:
            acc1 = warpgroup_mma_wait(1, deps=(acc1,))
        mbarrier.arrive(empty.index((i - 1) % STAGES), count=1, pred=i > 0)
        mbarrier.arrive(wempty.index((i - 1) % WSTAGES), count=1, pred=i > 0)
    if NB == 2:
        acc1, acc2 = warpgroup_mma_wait(0, deps=(acc1, acc2))
    else:
        acc1 = warpgroup_mma_wait(0, deps=(acc1,))
        acc2 = acc1  # unused outside SWIGLU
    return acc1, acc2


@gluon.jit
def _b_view(wbf, B_KN: gl.constexpr):
    """The MMA's B [32, BN]: the [32, BN] tile itself, or the transposed view of a [BN, 32] tile."""
    if B_KN:
        b = wbf
    else:
        b = wbf.permute((1, 0))
    return b


@gluon.jit
def _grouped_mm_mx_ws_kernel(
    a1_desc, a2_desc, b1_desc, b2_desc,  # TMA: A [R, K] bf16 blocks [BM, 32]; B E4M3 blocks [BN, 32] (or [32, BN], B_KN)
    sb1_ptr, sb2_ptr,  # E8M0 bits of the B operands [E, N, K/32]
    c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr,
    group_end_ptr, tile_end_ptr,
    N, K, E,
    stride_se, stride_sn, stride_sk,
    limit,
    MODE: gl.constexpr, HAS_LIMIT: gl.constexpr, LOG_E: gl.constexpr, B_KN: gl.constexpr,
    BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, WSTAGES: gl.constexpr,
    DQ_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    NB: gl.constexpr = 2 if MODE == 1 else 1  # weight tiles per step (SWIGLU: gate and up)
    t = gl.program_id(0)
    e, m0, row_end, n0 = _tile_of_program(t, group_end_ptr, tile_end_ptr, N, E, LOG_E, BM, BN, GROUP_M)
    valid = t < gl.load(tile_end_ptr + E - 1)  # past the last tile: no steps, nothing stored
    k_steps = gl.where(valid, gl.cdiv(K, 32), 0)
    n_steps = k_steps * (2 if MODE == 3 else 1)

    a_bufs = gl.allocate_shared_memory(a1_desc.dtype, [STAGES] + a1_desc.block_type.shape, a1_desc.layout)
    w_bufs = gl.allocate_shared_memory(b1_desc.dtype, [STAGES * NB] + b1_desc.block_type.shape, b1_desc.layout)
    wbf_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(b1_desc.block_type.shape, gl.bfloat16)
    wbf_bufs = gl.allocate_shared_memory(gl.bfloat16, [WSTAGES * NB] + b1_desc.block_type.shape, wbf_layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    wready = gl.allocate_shared_memory(gl.int64, [WSTAGES, 1], mbarrier.MBarrierLayout())
    wempty = gl.allocate_shared_memory(gl.int64, [WSTAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # the dequantizer has read B, the MMA has read A
    for j in gl.static_range(WSTAGES):
        mbarrier.init(wready.index(j), count=1)
        mbarrier.init(wempty.index(j), count=1)

    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, BN, 16])
    acc1, acc2 = gl.warp_specialize([
        (_mma, (a_bufs, wbf_bufs, full, empty, wready, wempty, n_steps, B_KN, NB, BM, BN, STAGES, WSTAGES, ACC)),
        (_dequantizer, (w_bufs, wbf_bufs, full, empty, wready, wempty, sb1_ptr, sb2_ptr, e, n0, N, k_steps, n_steps,
                        stride_se, stride_sn, stride_sk, MODE, B_KN, NB, BN, STAGES, WSTAGES)),
        (_loader, (a1_desc, a2_desc, b1_desc, b2_desc, a_bufs, w_bufs, full, empty, e, m0, n0, N, K, k_steps, n_steps,
                   MODE, B_KN, NB, STAGES)),
    ], [4, 1], [DQ_REGS, 24])

    rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))
    offs_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, ACC))
    row_ok = (rows < row_end) & valid
    c_off = gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(offs_n, 0)
    c_ok = gl.expand_dims(row_ok, 1) & gl.expand_dims(offs_n < N, 0)
    _epilogue(acc1, acc2, c_off, c_ok, c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr, limit, MODE, HAS_LIMIT)
