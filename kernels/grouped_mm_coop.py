"""Cooperative warp-specialized bf16 grouped GEMM for Hopper (Gluon), the plain kind only: ``grouped_mm``'s bf16
plain kind on CUDA where ``"bf16_ws/plain<@tier>"``'s config says ``COOPERATIVE`` (the H100's many-rows tier: the
forward's down projection in the compute regime; NOTES.md, session 37). C [R, N] = A [R, K] @ B[e]^T.

Same tiles, tile order (``grouped_tiles._tile_of_program``) and K order as ``grouped_gemm._grouped_mm_tma_kernel``
on a 128 x 256 config, which stays the definition it must match bit for bit (GPU test); what differs is who waits
for whom. The Triton kernel's warps load, multiply and store in turn, so each tile's stores hold up the next
tile's MMAs. Here, as in CUTLASS's cooperative kernels (``torch._grouped_mm``'s at these sizes):

- loader (1 warp): the program's tiles in turn, each tile's K steps, TMA [BM, BK] and [BN, BK] into a ring;
- two consumer warpgroups, each the 64-row half of every tile: wgmmas from the ring, one step in flight; then
  its half to shared memory and one TMA store, left in flight while the next tile's MMAs run (waited only
  before the buffer is written again). A half that reaches past its expert's last row takes masked stores
  instead: a TMA store would write the next expert's rows.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from titan_mok.kernels import grouped_mm_ws
from titan_mok.kernels.grouped_tiles import _bf16_rne, _tile_of_program


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, full, empty, group_end_ptr, tile_end_ptr, N, K, E,
            LOG_E: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
            STAGES: gl.constexpr):
    c = 0  # ring position, carried across the program's tiles
    for t in range(gl.program_id(0), gl.load(tile_end_ptr + E - 1), gl.num_programs(0)):
        e, m0, row_end, n0 = _tile_of_program(t, group_end_ptr, tile_end_ptr, N, E, LOG_E, BM, BN, GROUP_M)
        for k in range(0, K, BK):
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
            mbarrier.expect(full.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [m0, k], full.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [e * N + n0, k], full.index(s), b_bufs.index(s))
            c += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, full, empty, c_desc, c_smem, c_ptr, group_end_ptr, tile_end_ptr, N, K, E,
              LOG_E: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, HALF: gl.constexpr):
    HM: gl.constexpr = BM // 2
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    c = 0
    for t in range(gl.program_id(0), gl.load(tile_end_ptr + E - 1), gl.num_programs(0)):
        e, m0, row_end, n0 = _tile_of_program(t, group_end_ptr, tile_end_ptr, N, E, LOG_E, BM, BN, GROUP_M)
        acc = gl.zeros([HM, BN], gl.float32, ACC)
        for k in range(0, K, BK):
            s = c % STAGES
            acc = grouped_mm_ws.ring_mma(a_bufs.index(s).slice(HALF * HM, HM), b_bufs.index(s).permute((1, 0)), acc,
                                         full, empty, c, STAGES, k == 0)
            c += 1
        acc = grouped_mm_ws.ring_mma_done(acc, empty, c, STAGES)
        h0 = m0 + HALF * HM
        out = _bf16_rne(acc)
        if h0 + HM <= row_end:
            tma.store_wait(0)  # the previous tile's store has read the buffer
            c_smem.store(out)
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [h0, n0], c_smem)  # clipped at N by the descriptor
        else:
            rows = h0 + gl.arange(0, HM, layout=gl.SliceLayout(1, ACC))
            cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, ACC))
            off = gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
            gl.store(c_ptr + off, out, mask=gl.expand_dims(rows < row_end, 1) & gl.expand_dims(cols < N, 0))
    tma.store_wait(0)


@gluon.jit
def _grouped_mm_coop_kernel(a_desc, b_desc, c_desc, c_ptr, group_end_ptr, tile_end_ptr, N, K, E,
                            LOG_E: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                            GROUP_M: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            num_warps: gl.constexpr):
    gl.static_assert(num_warps == 4, "a consumer warpgroup per partition")
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], b_desc.layout)
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BM // 2, BN], c_desc.layout)  # one per warpgroup
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumer warpgroups
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, full, empty, c_desc, c_smem.index(0), c_ptr, group_end_ptr, tile_end_ptr, N, K,
                     E, LOG_E, BM, BN, BK, GROUP_M, STAGES, 0)),
        (_consumer, (a_bufs, b_bufs, full, empty, c_desc, c_smem.index(1), c_ptr, group_end_ptr, tile_end_ptr, N, K,
                     E, LOG_E, BM, BN, BK, GROUP_M, STAGES, 1)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, full, empty, group_end_ptr, tile_end_ptr, N, K, E, LOG_E, BM,
                   BN, BK, GROUP_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 40])


def launch(a_desc, b_desc, c_desc, c_RN: torch.Tensor, group_end_E: torch.Tensor, tile_end_E: torch.Tensor,
           max_tiles: int, BM: int, BN: int, BK: int, GROUP_M: int, STAGES: int, CONSUMER_REGS: int, num_warps: int,
           COOPERATIVE: bool):
    """c_RN = A @ B[e]^T per expert's rows, one program per SM (none past max_tiles) looping over the tiles. The
    TMA descriptors (grouped_gemm makes and checks them): A [R, K] in [BM, BK] blocks, B [E * N, K] in [BN, BK],
    c_RN [R, N] in [BM / 2, BN]. The arguments after max_tiles are the config's (COOPERATIVE: the key that chose
    this kernel)."""
    if BM != 128:
        raise ValueError(f"the cooperative kernel's BM must be 128 (two warpgroups of 64 rows), got {BM}")
    num_experts = group_end_E.shape[0]
    grid = (min(max_tiles, grouped_mm_ws.sm_count(c_RN.device.index)),)
    _grouped_mm_coop_kernel[grid](a_desc, b_desc, c_desc, c_RN, group_end_E, tile_end_E, c_RN.shape[1],
                                  a_desc.shape[1], num_experts, LOG_E=num_experts.bit_length(), BM=BM, BN=BN, BK=BK,
                                  GROUP_M=GROUP_M, STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS, num_warps=num_warps)
