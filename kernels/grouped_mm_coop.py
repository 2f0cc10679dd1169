"""Cooperative warp-specialized bf16 grouped GEMM for Hopper (Gluon): ``grouped_mm``'s bf16 plain kind, and SwiGLU
gate/up (``SWIGLU``: two weights against the same A, three outputs), on CUDA where ``tile_configs`` picks it (the
H100's many-rows tier: the forward's GEMMs in the compute regime). C [R, N] = A [R, K] @ B[e]^T; SWIGLU:
g = A @ B1[e]^T, u = A @ B2[e]^T, h = silu(g) * u.

Same tiles, tile order (``grouped_tiles._tile_of_program``), K order and epilogue rounding as
``grouped_gemm._grouped_mm_tma_kernel`` on the same BM x BN config, which stays the definition it must match bit for
bit (GPU test); what differs is who waits for whom. The Triton kernel's warps load, multiply and store in turn, so
each tile's stores hold up the next tile's MMAs. Here, as in CUTLASS's cooperative kernels (``torch._grouped_mm``'s
at these sizes):

- loader (1 warp): the program's tiles in turn, each tile's K steps, TMA [BM, BK] and [BN, BK] (SWIGLU: two
  weights' [BN, BK]) into a ring;
- two consumer warpgroups, each the 64-row half of every tile: wgmmas from the ring, one step in flight; then
  its half's outputs to shared memory and each out by one TMA store, the last left in flight while the next
  tile's MMAs run (waited only before the buffer is written again). A half that reaches past its expert's last row
  takes masked stores instead: a TMA store would write the next expert's rows.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from titan_mok.kernels import grouped_mm_ws
from titan_mok.kernels.grouped_tiles import _bf16_rne, _swiglu_out, _tile_of_program


@gluon.jit
def _loader(a_desc, b1_desc, b2_desc, a_bufs, b1_bufs, b2_bufs, full, empty, group_end_ptr, tile_end_ptr, N, K, E,
            LOG_E: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
            STAGES: gl.constexpr, SWIGLU: gl.constexpr):
    c = 0  # ring position, carried across the program's tiles
    for t in range(gl.program_id(0), gl.load(tile_end_ptr + E - 1), gl.num_programs(0)):
        e, m0, row_end, n0 = _tile_of_program(t, group_end_ptr, tile_end_ptr, N, E, LOG_E, BM, BN, GROUP_M)
        for k in range(0, K, BK):
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
            mbarrier.expect(full.index(s), a_desc.block_type.nbytes + (1 + SWIGLU) * b1_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [m0, k], full.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b1_desc, [e * N + n0, k], full.index(s), b1_bufs.index(s))
            if SWIGLU:
                tma.async_copy_global_to_shared(b2_desc, [e * N + n0, k], full.index(s), b2_bufs.index(s))
            c += 1


@gluon.jit
def _store_half(desc, buf, x, h0, n0):
    """One [BM / 2, BN] output by TMA through buf, once buf's previous store has read it."""
    tma.store_wait(0)
    buf.store(x)
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [h0, n0], buf)  # clipped at N by the descriptor


@gluon.jit
def _masked_store(c_ptr, x, h0, n0, row_end, N):
    """x [BM / 2, BN] into c's rows from h0 and columns from n0, those before row_end and N only."""
    rows = h0 + gl.arange(0, x.shape[0], layout=gl.SliceLayout(1, x.type.layout))
    cols = n0 + gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, x.type.layout))
    off = gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
    gl.store(c_ptr + off, x, mask=gl.expand_dims(rows < row_end, 1) & gl.expand_dims(cols < N, 0))


@gluon.jit
def _consumer(a_bufs, b1_bufs, b2_bufs, full, empty, c1_desc, c2_desc, c3_desc, c_smem, c1_ptr, c2_ptr, c3_ptr,
              group_end_ptr, tile_end_ptr, N, K, E, limit, HAS_LIMIT: gl.constexpr, LOG_E: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              SWIGLU: gl.constexpr, HALF: gl.constexpr):
    HM: gl.constexpr = BM // 2
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    c = 0
    for t in range(gl.program_id(0), gl.load(tile_end_ptr + E - 1), gl.num_programs(0)):
        e, m0, row_end, n0 = _tile_of_program(t, group_end_ptr, tile_end_ptr, N, E, LOG_E, BM, BN, GROUP_M)
        acc1 = gl.zeros([HM, BN], gl.float32, ACC)
        if SWIGLU:
            acc2 = gl.zeros([HM, BN], gl.float32, ACC)
        for k in range(0, K, BK):
            s = c % STAGES
            a = a_bufs.index(s).slice(HALF * HM, HM)
            if SWIGLU:
                acc1, acc2 = grouped_mm_ws.ring_mma(a, b1_bufs.index(s).permute((1, 0)), acc1, full, empty, c, STAGES,
                                                    k == 0, b2_bufs.index(s).permute((1, 0)), acc2)
            else:
                acc1 = grouped_mm_ws.ring_mma(a, b1_bufs.index(s).permute((1, 0)), acc1, full, empty, c, STAGES,
                                              k == 0)
            c += 1
        h0 = m0 + HALF * HM
        whole = h0 + HM <= row_end  # TMA stores; else masked ones
        if SWIGLU:
            acc1, acc2 = grouped_mm_ws.ring_mma_done(acc1, empty, c, STAGES, acc2)
            g, u, h = _swiglu_out(acc1, acc2, limit, HAS_LIMIT)
            if whole:
                _store_half(c1_desc, c_smem, g, h0, n0)
                _store_half(c2_desc, c_smem, u, h0, n0)
                _store_half(c3_desc, c_smem, h, h0, n0)
            else:
                _masked_store(c1_ptr, g, h0, n0, row_end, N)
                _masked_store(c2_ptr, u, h0, n0, row_end, N)
                _masked_store(c3_ptr, h, h0, n0, row_end, N)
        else:
            acc1 = grouped_mm_ws.ring_mma_done(acc1, empty, c, STAGES)
            out = _bf16_rne(acc1)
            if whole:
                _store_half(c1_desc, c_smem, out, h0, n0)
            else:
                _masked_store(c1_ptr, out, h0, n0, row_end, N)
    tma.store_wait(0)


@gluon.jit
def _grouped_mm_coop_kernel(a_desc, b1_desc, b2_desc, c1_desc, c2_desc, c3_desc, c1_ptr, c2_ptr, c3_ptr, group_end_ptr,
                            tile_end_ptr, N, K, E, limit, HAS_LIMIT: gl.constexpr, LOG_E: gl.constexpr,
                            BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                            STAGES: gl.constexpr, SWIGLU: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            num_warps: gl.constexpr):
    gl.static_assert(num_warps == 4, "a consumer warpgroup per partition")
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_desc.layout)
    b1_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], b1_desc.layout)
    if SWIGLU:
        b2_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], b2_desc.layout)
    else:
        b2_bufs = b1_bufs  # never read
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BM // 2, BN], c1_desc.layout)  # one per warpgroup
    full, empty = grouped_mm_ws.ring_barriers(STAGES)
    gl.warp_specialize([
        (_consumer, (a_bufs, b1_bufs, b2_bufs, full, empty, c1_desc, c2_desc, c3_desc, c_smem.index(0), c1_ptr, c2_ptr,
                     c3_ptr, group_end_ptr, tile_end_ptr, N, K, E, limit, HAS_LIMIT, LOG_E, BM, BN, BK, GROUP_M, STAGES,
                     SWIGLU, 0)),
        (_consumer, (a_bufs, b1_bufs, b2_bufs, full, empty, c1_desc, c2_desc, c3_desc, c_smem.index(1), c1_ptr, c2_ptr,
                     c3_ptr, group_end_ptr, tile_end_ptr, N, K, E, limit, HAS_LIMIT, LOG_E, BM, BN, BK, GROUP_M, STAGES,
                     SWIGLU, 1)),
        (_loader, (a_desc, b1_desc, b2_desc, a_bufs, b1_bufs, b2_bufs, full, empty, group_end_ptr, tile_end_ptr, N, K,
                   E, LOG_E, BM, BN, BK, GROUP_M, STAGES, SWIGLU)),
    ], [4, 1], [CONSUMER_REGS, 40])


def launch(a_desc, b_descs, c_descs, outs, group_end_E: torch.Tensor, tile_end_E: torch.Tensor, max_tiles: int,
           swiglu_limit, swiglu: bool, cfg):
    """outs = A @ B[e]^T per expert's rows (swiglu: two weights, outs (g, u, h)), one program per SM (none past
    max_tiles) looping over the tiles; cfg: a tile_configs.CoopMM. TMA descriptors (grouped_gemm makes and checks
    them): a_desc A [R, K] in [BM, BK] blocks; b_descs two weights as [E * N, K] in [BN, BK] (plain: the one twice);
    c_descs and outs three outputs [R, N], descriptors in [BM / 2, BN] blocks (plain: the one thrice)."""
    c1, c2, c3 = outs
    num_experts = group_end_E.shape[0]
    grid = (min(max_tiles, grouped_mm_ws.sm_count(c1.device.index)),)
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
    _grouped_mm_coop_kernel[grid](a_desc, *b_descs, *c_descs, c1, c2, c3, group_end_E, tile_end_E, c1.shape[1],
                                  a_desc.shape[1], num_experts, limit, HAS_LIMIT=swiglu_limit is not None, LOG_E=num_experts.bit_length(), BM=cfg.BM,
                                  BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M, STAGES=cfg.STAGES, SWIGLU=swiglu,
                                  CONSUMER_REGS=cfg.CONSUMER_REGS, num_warps=cfg.num_warps)
