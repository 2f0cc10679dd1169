"""Warp-specialized bf16 weight gradient for Hopper (Gluon): ``grouped_wgrad``'s flat loop (few rows per
expert, the MoE regime; configs "flat_ws" and, with 64-row MMA steps, "flat_ws_long") and the row loop's programs
(many rows per expert, one K tile each; "rows_ws") on CUDA where ``tile_configs`` picks them.

Same programs, K tiles and row order as ``grouped_gemm._grouped_wgrad_kernel`` (FLAT; for "rows_ws" its row
loop), which stays the definition it must match bit for bit (GPU tests) and the path Triton's CPU interpreter runs.
That kernel's loads and MMAs, not its writes, keep it from the write floor: each row block is one short MMA step behind
its own loads, and its epilogue waits for the tile's last step. Here:

- loader (1 warp): per program (BN features, an expert, a run of its K tiles) two TMA descriptors over
  the expert's rows, made on the device (rows past its end read as zeros), then per (K tile, row block)
  TMA copies of a [BR, BN] and b [BR, BK] into a ring slot, as far ahead as the ring allows;
- two consumer warpgroups, each owning 64 of the BN features: per K tile an accumulator [64, BK] from one
  async wgmma per row block (a^T read from shared memory, MN-major), one step kept in flight while the
  previous step's slot goes back to the loader, then rounded into the warpgroup's tile buffer in shared
  memory. One accumulator lives at a time, so BK can be 256: half the tiles of 128, and a [BR, BN] block of a
  loaded once per 256 features. That was up to 8% faster at EP=2 (21 of 24 lines) than 128-wide tiles that
  stored each tile under the next one's last step (two accumulators live);
- a storer (STORER_WARPS warps): each tile buffer to global memory, 16 bytes a thread, evicted first from L2
  (written once, never read here; up to 4.6% faster), so that the consumers' next MMAs run while
  the stores drain. With the MMAs and loads alone taking 0.76-1.32x the floor's time at EP=2, stores made by
  the consumers themselves added 18-62% to them. The storer took 0.935-0.953x the time at
  EP=2 in 7 of 8 (shape, routing) cases, DeepSeek-V4-Pro balanced 1.007x.

Tried and slower: a ping-pong split, each warpgroup all 128 features of every other K
tile from its own ring (one stores while the other multiplies), 1.005-1.11x the time; stores by TMA; a's row
blocks held in shared memory for a job's K tiles (the ring then b only), 1.0-1.14x; two tile buffers per
warpgroup (with a 3-slot ring, to fit), or a one-warp storer.

Each wgmma sums a feature pair's rows 16 at a time in ascending order, whatever BR: the bits of the
Triton kernel's 32-row steps. Programs past the last get no work (a program that returned before
``warp_specialize`` would leave its partitions waiting).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from titan_mok.kernels.grouped_mm_ws import ring_barriers, ring_mma, ring_mma_done
from titan_mok.kernels.grouped_tiles import _bf16_rne, _wgrad_job


@gluon.jit
def _loader(a_ptr, b_ptr, a_bufs, b_bufs, full, empty, group_end_ptr, prog_end_ptr, k_tiles_per_prog_ptr, N, K, E,
            LOG_E: gl.constexpr, BR: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
            A_LAYOUT: gl.constexpr, B_LAYOUT: gl.constexpr):
    n_tiles = gl.cdiv(N, BN)
    c = 0  # loads issued by this program, over all its jobs: the ring position
    for t in range(gl.program_id(0), n_tiles * gl.load(prog_end_ptr + E - 1), gl.num_programs(0)):
        e, first_k_tile, k_tiles, row_start, rows = _wgrad_job(t // n_tiles, group_end_ptr, prog_end_ptr,
                                                               k_tiles_per_prog_ptr, K, E, LOG_E, BK)
        # The descriptors below are rewritten in place (one scratch slot per call site and program), where a copy
        # still in flight reads its own: first wait until the previous job's copies have landed (the last STAGES at
        # most; the earlier ones have, their slots having come back empty), else a copy may read a half-written
        # descriptor, a new base with an old shape, past the end of the rows.
        for x in range(gl.maximum(c - STAGES, 0), c):
            mbarrier.wait(full.index(x % STAGES), (x // STAGES) & 1)
        # a TMA box needs at least one row: an expert without rows gets a one-row descriptor at the operands' first
        # row (_wgrad_job) and its single row block starts past it, so it reads zeros and stores a zero gradient
        # (as the Triton kernel)
        a_desc = tma.make_tensor_descriptor(a_ptr + row_start.to(gl.int64) * N, [gl.maximum(rows, 1), N], [N, 1],
                                            [BR, BN], A_LAYOUT)
        b_desc = tma.make_tensor_descriptor(b_ptr + row_start.to(gl.int64) * K, [gl.maximum(rows, 1), K], [K, 1],
                                            [BR, BK], B_LAYOUT)
        skip = gl.where(rows == 0, BR, 0)
        row_blocks = gl.maximum(gl.cdiv(rows, BR), 1)
        n0 = (t % n_tiles) * BN
        for i in range(row_blocks * k_tiles):
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
            mbarrier.expect(full.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            r = (i % row_blocks) * BR + skip
            tma.async_copy_global_to_shared(a_desc, [r, n0], full.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [r, (first_k_tile + i // row_blocks) * BK], full.index(s),
                                            b_bufs.index(s))
            c += 1


@gluon.jit
def _storer(c_ptr, tiles, tile_full, tile_empty, group_end_ptr, prog_end_ptr, k_tiles_per_prog_ptr, N, K, E,
            LOG_E: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STORER_WARPS: gl.constexpr):
    """c[e, f0:f0+BN, k0:k0+BK] = the two consumers' tile buffers, 8 features at a time."""
    ST: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [STORER_WARPS, 1], [1, 0])
    n_tiles = gl.cdiv(N, BN)
    q = 0  # tiles stored by this program: the buffers' phase
    for t in range(gl.program_id(0), n_tiles * gl.load(prog_end_ptr + E - 1), gl.num_programs(0)):
        e, first_k_tile, k_tiles, row_start, rows = _wgrad_job(t // n_tiles, group_end_ptr, prog_end_ptr,
                                                               k_tiles_per_prog_ptr, K, E, LOG_E, BK)
        for kt in range(k_tiles):
            k = (first_k_tile + kt) * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, ST))
            for half in gl.static_range(2):
                mbarrier.wait(tile_full.index(half), q & 1)
                for r in gl.static_range(0, 64, 8):
                    f = (t % n_tiles) * BN + 64 * half + r + gl.arange(0, 8, layout=gl.SliceLayout(1, ST))
                    off = e.to(gl.int64) * N * K + gl.expand_dims(f.to(gl.int64) * K, 1) + gl.expand_dims(k, 0)
                    mask = gl.expand_dims(f < N, 1) & gl.expand_dims(k < K, 0)
                    gl.store(c_ptr + off, tiles.index(half).slice(r, 8, dim=0).load(ST), mask=mask,
                             eviction_policy="evict_first")
                gl.thread_barrier()  # every warp's loads of the buffer are done before it goes back
                mbarrier.arrive(tile_empty.index(half), count=1)
            q += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, full, empty, tiles, tile_full, tile_empty, group_end_ptr, prog_end_ptr,
              k_tiles_per_prog_ptr, N, K, E, LOG_E: gl.constexpr, BR: gl.constexpr, BN: gl.constexpr,
              BK: gl.constexpr, STAGES: gl.constexpr, half: gl.constexpr):
    """One warpgroup: features [n0 + 64 * half, +64) of each of the program's K tiles."""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16])
    n_tiles = gl.cdiv(N, BN)
    c = 0  # loads consumed by this program: the ring position
    q = 0  # tiles handed to the storer
    for t in range(gl.program_id(0), n_tiles * gl.load(prog_end_ptr + E - 1), gl.num_programs(0)):
        e, first_k_tile, k_tiles, row_start, rows = _wgrad_job(t // n_tiles, group_end_ptr, prog_end_ptr,
                                                               k_tiles_per_prog_ptr, K, E, LOG_E, BK)
        row_blocks = gl.maximum(gl.cdiv(rows, BR), 1)
        for kt in range(k_tiles):
            acc = gl.zeros([64, BK], gl.float32, ACC)
            for blk in range(row_blocks):
                s = c % STAGES
                a_t = a_bufs.index(s).slice(64 * half, 64, dim=1).permute((1, 0))  # a^T [64 features, BR rows]
                acc = ring_mma(a_t, b_bufs.index(s), acc, full, empty, c, STAGES, blk == 0)
                c += 1
            acc = ring_mma_done(acc, empty, c, STAGES)
            mbarrier.wait(tile_empty.index(half), (q & 1) ^ 1)  # the storer has read the previous tile
            tiles.index(half).store(_bf16_rne(acc))
            gl.thread_barrier()  # the whole warpgroup's tile is in the buffer before the storer reads it
            mbarrier.arrive(tile_full.index(half), count=1)
            q += 1


@gluon.jit
def _grouped_wgrad_ws_kernel(a_ptr, b_ptr, c_ptr, group_end_ptr, prog_end_ptr, k_tiles_per_prog_ptr, N, K, E,
                             LOG_E: gl.constexpr, BR: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                             STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, STORER_WARPS: gl.constexpr,
                             STORER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """The operands and programs of ``grouped_gemm._grouped_wgrad_kernel`` (the same launch arguments); the ring,
    its consumers and the storer as the module docstring says."""
    gl.static_assert(BN == 128 and num_warps == 4, "two consumer warpgroups of 64 features each")
    A_LAYOUT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BR, BN], gl.bfloat16)
    B_LAYOUT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BR, BK], gl.bfloat16)
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BR, BN], A_LAYOUT)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BR, BK], B_LAYOUT)
    full, empty = ring_barriers(STAGES)
    # one rounded [64, BK] tile per consumer warpgroup, between it and the storer
    TILE_LAYOUT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BK], gl.bfloat16)
    tiles = gl.allocate_shared_memory(gl.bfloat16, [2, 64, BK], TILE_LAYOUT)
    tile_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for h in gl.static_range(2):
        mbarrier.init(tile_full.index(h), count=1)
        mbarrier.init(tile_empty.index(h), count=1)

    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, full, empty, tiles, tile_full, tile_empty, group_end_ptr, prog_end_ptr,
                     k_tiles_per_prog_ptr, N, K, E, LOG_E, BR, BN, BK, STAGES, 0)),
        (_consumer, (a_bufs, b_bufs, full, empty, tiles, tile_full, tile_empty, group_end_ptr, prog_end_ptr,
                     k_tiles_per_prog_ptr, N, K, E, LOG_E, BR, BN, BK, STAGES, 1)),
        (_loader, (a_ptr, b_ptr, a_bufs, b_bufs, full, empty, group_end_ptr, prog_end_ptr, k_tiles_per_prog_ptr, N, K,
                   E, LOG_E, BR, BN, BK, STAGES, A_LAYOUT, B_LAYOUT)),
        (_storer, (c_ptr, tiles, tile_full, tile_empty, group_end_ptr, prog_end_ptr, k_tiles_per_prog_ptr, N, K, E,
                   LOG_E, BN, BK, STORER_WARPS)),
    ], [4, 1, STORER_WARPS], [CONSUMER_REGS, 48, STORER_REGS])
