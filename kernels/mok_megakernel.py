"""The MoK forward megakernel: one persistent launch in which communication programs pull token rows
into a fixed ring of row tiles while compute programs run the expert FFN on the tiles already there
and push each result row to its source's combine slot (docs/design.md §5).

Legend: P ep degree, V ranks hosted by this launch (P under virtual EP: all ranks on one device; 1 for
a real rank of a multi-GPU group), T tokens per rank, K top-k, N = T·K slots per rank, H hidden,
I expert FFN size, L local experts per rank, Q ring tiles per rank, M rows per tile (BLOCK_M),
C compute programs per rank.

Programs: rank v of this launch owns program ids [v·(COMM + C), (v + 1)·(COMM + C)); the first COMM
are communication programs, the other C compute programs. A rank's tiles are its schedule's rows
(``kernels/mok_schedule.py``: per local expert, (source rank, token, slot) order) cut into M-row tiles
per expert, numbered i = 0, 1, ... expert by expert; tile i lives in ring slot i mod Q during round
n = i div Q. Communication program c moves tiles i ≡ c (mod COMM), compute program m computes tiles
i ≡ m (mod C), each in ascending i.

Buffers. Symmetric (each rank's own, peers reach them through int64 [P] address tables, exactly as
``torch.distributed._symmetric_memory`` peer pointers; under virtual EP the "peers" are the other
virtual ranks' allocations on the same device): ``x_TH`` (token rows), ``slots_NH`` (combine slots
(token, slot)), ``arrivals_T`` int32 (rows pushed per token), ``x_ready`` int64 [1] (x_TH published).
Local to a rank: ``ring_VQMH`` (row tiles), ``ready_VQ`` / ``consumed_VQ`` int64 (ring flags),
``h_VCMI`` (one SwiGLU tile per compute program: the down projection's input), ``errors`` int64 [6].

Protocol of one call (epoch e, counted by the host from 1, passed as an argument: no flag is reset
between calls, a flag is compared with the value this call writes):
- publish: communication program 0 of each rank stores x_ready = e (release); its x_TH was written
  before the launch, in stream order.
- pull: a communication program first acquires every source rank's x_ready = e, then per tile i
  (round n, slot q) waits until consumed[q] = stamp(e, n - 1) (the tile that held the slot last has
  been read; round 0 finds the slot free: the previous call's launch has ended), copies the tile's
  rows from the source ranks' x_TH (row j of expert rows: token (s mod N) div K of rank s div N for
  s = row_slot[j]; rows past the expert's end are zeros) and stores ready[q] = stamp(e, n) (release).
- compute: per tile, acquire ready[q] = stamp(e, n); gate/up GEMMs → SwiGLU → h (this program's
  scratch tile); store consumed[q] = stamp(e, n) (release: the slot is free once h is written, before
  the down projection); down GEMM, each result row stored into its source rank's slots_NH at
  s mod N; then arrivals[token] += 1 on the source rank (release), once per row.
- finish (a second, small launch, ``megakernel_finish``): each rank's token t waits until
  arrivals[t] = e·K (acquire), then out[t] = cast(Σ_j w[t,j]·slots[t,j] + shared[t]) in fp32, ascending j.
stamp(e, n) = e·2^32 + n: flags only grow, so a flag left by an earlier call or round never matches.
The arrival counters grow by K per call; the host zeroes every flag and counter and restarts at
epoch 1 before e·K would leave int32 (``MAX_EPOCH``): one memset every ~2^31 / K calls.
Across calls no barrier is needed: a rank rewrites x_TH for call e + 1 only after its finish of call
e saw every one of its rows pushed (so pulled), and peers push into its slots for call e + 1 only
after acquiring its x_ready = e + 1, which it stores after that finish.

Deadlock freedom: every program waits only on tiles of lower index or on published inputs, so the
lowest unfinished tile can always proceed, provided every program is running: the launcher checks
that the grid fits the device at once (programs per SM from the compiled kernel's registers, shared
memory and warps) and raises otherwise. Every wait is bounded (``timeout_ms``): on timeout, or when
another program already recorded an error, a program records (code, waiting rank, index, seen,
expected) in ``errors`` (first error wins) and stops; ``megakernel_finish`` then stops the device
with an assertion naming the wait (``trap=True``) or leaves the record to ``read_error`` (``trap=False``).

Serialized mode (``serialized=True``; Triton's interpreter runs programs one after another, so a spin
there never ends): a launch publishes, then per round n a launch of the communication programs
moves the round's tiles and a launch of the compute programs computes them; waits become
assertions (the flag must already hold its value, else the same error record).

Bits: the FFN of a tile is the Triton grouped FFN's arithmetic (``kernels/grouped_gemm.py``, bf16):
fp32 accumulation over K in 64-wide steps (BLOCK_K: the interpreter's rounding follows the step, the
GPU's MMA chain does not), g and u rounded to bf16, h = silu(g)·u from them rounded to bf16, y
rounded to bf16 (RNE); the reduction is ``mok_combine.slot_reduce``'s (no FMA contraction). Each row
is computed alone (no split-K, no atomics on values), so a token's output does not depend on the
tile, the program, the ring size, the batch or P.

Not here: MXFP8 (bf16 only), the shared expert (an input of the finish), the backward.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from titan_mok.kernels.grouped_gemm import _DOT_F32, _dot
from titan_mok.kernels.grouped_tiles import _bf16_rne, _group_of, _swiglu_out
from titan_mok.kernels.mok_combine import _round_to, _slot_term

# Launch phases (the PHASE constexpr; the kernels compare it with these literals): one concurrent launch, or the
# serialized mode's three kinds.
PHASE_ALL, PHASE_PUBLISH, PHASE_COMM, PHASE_COMPUTE = 0, 1, 2, 3

# Error codes (errors[0]): which wait ran out.
WAIT_X_READY = tl.constexpr(1)
WAIT_RING_READY = tl.constexpr(2)
WAIT_RING_FREE = tl.constexpr(3)
WAIT_ARRIVALS = tl.constexpr(4)
WAIT_NAMES = {
    1: "x_ready: rank {rank}'s communication program waited for rank {index} to publish its token rows",
    2: "ring ready: rank {rank}'s compute program waited for ring tile {index} to be pulled",
    3: "ring free: rank {rank}'s communication program waited for the ring slot of tile {index} to be consumed",
    4: "arrivals: rank {rank} waited for all K expert rows of its token {index}",
}

BLOCK_K = 64
"""K step of every GEMM: the Triton grouped FFN's bf16 step (the interpreter rounds to fp32 once per step)."""
MAX_EPOCH = 2**31 // 64 - 1
"""Largest epoch before the host resets the flags: e·K stays inside int32 for K <= 64."""


@triton.jit
def _stamp(epoch, n):
    """A ring flag's value for round n of call ``epoch``: unique across calls, increasing, never reset."""
    return epoch.to(tl.int64) * 4294967296 + n


@triton.jit
def _record_error(err_ptr, code: tl.constexpr, rank, index, seen, expected):
    """The first error of the launch wins; the others leave it as it is."""
    if tl.atomic_cas(err_ptr, tl.full((), 0, tl.int64), tl.full((), code, tl.int64)) == 0:
        tl.store(err_ptr + 1, rank.to(tl.int64))
        tl.store(err_ptr + 2, index.to(tl.int64))
        tl.store(err_ptr + 3, seen.to(tl.int64))
        tl.store(err_ptr + 4, expected.to(tl.int64))


@triton.jit
def _wait(flag_ptr, expected, err_ptr, code: tl.constexpr, rank, index, timeout_us, SERIAL: tl.constexpr):
    """Whether *flag_ptr reached ``expected`` (acquire), spinning at most timeout_us microseconds (SERIAL: no spin,
    an assertion); on failure, or once another program recorded an error, records this wait and returns False."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if not SERIAL:
        timeout_ns = timeout_us.to(tl.int64) * 1000
        start = globaltimer()
        waiting = seen != expected
        while waiting:
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            calm = tl.load(err_ptr, volatile=True) == 0
            waiting = (seen != expected) & calm & (globaltimer() - start < timeout_ns)
    ok = seen == expected
    if not ok:
        _record_error(err_ptr, code, rank, index, seen, expected)
    tl.debug_barrier()  # the other threads' reads of what the flag guards come after the acquire
    return ok


@triton.jit
def _tile_rows(i, group_end_ptr, tile_end_ptr, L, LOG_L: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tile i -> (local expert, its rows [M] in the schedule, which of them are real)."""
    e = _group_of(i, tile_end_ptr, L, LOG_L)
    first_tile = tl.load(tile_end_ptr + e - 1, mask=e > 0, other=0)
    first_row = tl.load(group_end_ptr + e - 1, mask=e > 0, other=0) + (i - first_tile) * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    return e, rows, rows < tl.load(group_end_ptr + e)


@triton.jit
def _pull_tile(tile_ptr, x_table, row_slot_ptr, rows, ok, N, K, H, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """tile [M, H] = the rows' token rows from their source ranks' x_TH; rows past the expert's end zero."""
    s = tl.load(row_slot_ptr + rows, mask=ok, other=0)  # gathered slot p·N + t·K + j
    src_base = tl.load(x_table + s // N, mask=ok, other=0).to(tl.pointer_type(tl.bfloat16))
    src_ptrs = src_base + ((s % N) // K).to(tl.int64) * H  # [M] token rows on the source ranks
    dst_ptrs = tile_ptr + tl.arange(0, BLOCK_M).to(tl.int64) * H
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        col_ok = (cols < H)[None, :]
        v = tl.load(src_ptrs[:, None] + cols[None, :], mask=ok[:, None] & col_ok, other=0.0)
        tl.store(dst_ptrs[:, None] + cols[None, :], v, mask=col_ok)


@triton.jit
def _gate_up_tile(a_ptr, wg_ptr, wu_ptr, h_ptr, H, I, limit, HAS_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """h [M, I] = swiglu(a @ w_gate.T, a @ w_up.T) for one ring tile a [M, H] (bf16, row-major)."""
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)
    for n0 in range(0, I, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < H
            # .cg: another SM wrote the tile; read it from L2, never from a line this SM cached in an earlier round
            a = tl.load(a_ptr + offs_m[:, None] * H + offs_k[None, :], mask=k_ok[None, :], other=0.0,
                        cache_modifier=".cg")
            w_off = offs_n[:, None].to(tl.int64) * H + offs_k[None, :]  # [N, K] block of w [I, H]
            w_ok = n_ok[:, None] & k_ok[None, :]
            acc1 = _dot(a, tl.trans(tl.load(wg_ptr + w_off, mask=w_ok, other=0.0)), acc1, DOT_F32)
            acc2 = _dot(a, tl.trans(tl.load(wu_ptr + w_off, mask=w_ok, other=0.0)), acc2, DOT_F32)
        _, _, h = _swiglu_out(acc1, acc2, limit, HAS_LIMIT)
        tl.store(h_ptr + offs_m[:, None] * I + offs_n[None, :], h, mask=n_ok[None, :])


@triton.jit
def _down_push_tile(h_ptr, wd_ptr, dst_ptrs, ok, H, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """y = h @ w_down.T (h [M, I], w_down [H, I]); real row r's result stored at dst_ptrs[r] (its combine slot)."""
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)
    for n0 in range(0, H, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < I
            a = tl.load(h_ptr + offs_m[:, None] * I + offs_k[None, :], mask=k_ok[None, :], other=0.0)
            b = tl.load(wd_ptr + offs_n[:, None].to(tl.int64) * I + offs_k[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(a, tl.trans(b), acc, DOT_F32)
        tl.store(dst_ptrs[:, None] + offs_n[None, :], _bf16_rne(acc), mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _first_tile(worker, workers, tile_lo):
    """The first tile >= tile_lo that ``worker`` (of ``workers``, dealt round-robin) owns."""
    return tile_lo + ((worker - tile_lo % workers) + workers) % workers


@triton.jit
def _comm_program(c, rank, ring_ptr, ready_ptr, consumed_ptr, x_table, x_ready_table, group_end_ptr, tile_end_ptr,
                  row_slot_ptr, err_ptr, epoch, stall_rank, timeout_us, tile_lo, tile_hi, P, L, N, K, H, Q, COMM,
                  PHASE: tl.constexpr, LOG_L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    SERIAL: tl.constexpr = PHASE != 0
    alive = rank != stall_rank  # the stalled rank (a test hook) publishes nothing
    if PHASE == 0 or PHASE == 1:
        if alive & (c == 0):
            tl.atomic_xchg(tl.load(x_ready_table + rank).to(tl.pointer_type(tl.int64)), epoch.to(tl.int64),
                           sem="release", scope="sys")
    if PHASE == 0 or PHASE == 2:
        src = 0
        while alive & (src < P):
            src_ready = tl.load(x_ready_table + src).to(tl.pointer_type(tl.int64))
            alive = _wait(src_ready, epoch.to(tl.int64), err_ptr, WAIT_X_READY, rank, src, timeout_us, SERIAL)
            src += 1
        end = tl.minimum(tl.load(tile_end_ptr + L - 1), tile_hi)
        i = _first_tile(c, COMM, tile_lo)
        while alive & (i < end):
            q = i % Q
            n = i // Q
            if n > 0:
                alive = _wait(consumed_ptr + q, _stamp(epoch, n - 1), err_ptr, WAIT_RING_FREE, rank, i, timeout_us,
                              SERIAL)
            if alive:
                _e, rows, ok = _tile_rows(i, group_end_ptr, tile_end_ptr, L, LOG_L, BLOCK_M)
                _pull_tile(ring_ptr + q.to(tl.int64) * BLOCK_M * H, x_table, row_slot_ptr, rows, ok, N, K, H, BLOCK_M,
                           BLOCK_H)
                tl.debug_barrier()  # every thread's rows stored before the release
                tl.atomic_xchg(ready_ptr + q, _stamp(epoch, n), sem="release", scope="sys")
            i += COMM


@triton.jit
def _compute_program(m, rank, ring_ptr, ready_ptr, consumed_ptr, h_ptr, slots_table, arrivals_table, group_end_ptr,
                     tile_end_ptr, row_slot_ptr, wg_ptr, wu_ptr, wd_ptr, err_ptr, epoch, timeout_us, tile_lo, tile_hi,
                     limit, L, N, K, H, I, Q, COMPUTE, PHASE: tl.constexpr, HAS_LIMIT: tl.constexpr,
                     LOG_L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_F32: tl.constexpr):
    alive = tl.full((), 1, tl.int1)
    end = tl.minimum(tl.load(tile_end_ptr + L - 1), tile_hi)
    i = _first_tile(m, COMPUTE, tile_lo)
    while alive & (i < end):
        q = i % Q
        n = i // Q
        alive = _wait(ready_ptr + q, _stamp(epoch, n), err_ptr, WAIT_RING_READY, rank, i, timeout_us, PHASE != 0)
        if alive:
            e, rows, ok = _tile_rows(i, group_end_ptr, tile_end_ptr, L, LOG_L, BLOCK_M)
            w_up_off = e.to(tl.int64) * I * H
            _gate_up_tile(ring_ptr + q.to(tl.int64) * BLOCK_M * H, wg_ptr + w_up_off, wu_ptr + w_up_off, h_ptr, H, I,
                          limit, HAS_LIMIT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
            tl.debug_barrier()  # h complete, and every read of the ring tile done
            tl.atomic_xchg(consumed_ptr + q, _stamp(epoch, n), sem="release", scope="sys")
            s = tl.load(row_slot_ptr + rows, mask=ok, other=0)  # gathered slot p·N + t·K + j
            src = s // N
            slot_ptrs = tl.load(slots_table + src, mask=ok, other=0).to(tl.pointer_type(tl.bfloat16))
            _down_push_tile(h_ptr, wd_ptr + e.to(tl.int64) * H * I, slot_ptrs + (s % N).to(tl.int64) * H, ok, H, I,
                            BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
            tl.debug_barrier()  # every thread's slot rows stored (and h read) before the arrivals
            arrivals = tl.load(arrivals_table + src, mask=ok, other=0).to(tl.pointer_type(tl.int32))
            tl.atomic_add(arrivals + (s % N) // K, 1, mask=ok, sem="release", scope="sys")
        i += COMPUTE


# not specialized: the integers that vary per call or per configuration (one compiled kernel per H, I and tiles)
@triton.jit(do_not_specialize=["first_rank", "epoch", "stall_rank", "timeout_us", "tile_lo", "tile_hi", "P", "L", "T",
                               "K", "Q", "COMM", "COMPUTE"])
def _megakernel(
    # local to the hosted ranks: ring [V, Q, M, H] bf16, ready/consumed [V, Q] int64, h [V, C, M, I] bf16
    ring_ptr, ready_ptr, consumed_ptr, h_ptr,
    # int64 [P] addresses of every rank's symmetric buffers
    x_table, slots_table, arrivals_table, x_ready_table,
    # the hosted ranks' schedules: group_end, tile_end int32 [V, L], row_slot int32 [V, P·N]
    group_end_ptr, tile_end_ptr, row_slot_ptr,
    # the hosted ranks' expert weights: w_gate, w_up [V·L, I, H], w_down [V·L, H, I] bf16
    wg_ptr, wu_ptr, wd_ptr,
    err_ptr,
    first_rank, epoch, stall_rank, timeout_us, tile_lo, tile_hi, limit,
    P, L, T, K, H, I, Q, COMM, COMPUTE,
    PHASE: tl.constexpr, HAS_LIMIT: tl.constexpr, LOG_L: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    local = pid // (COMM + COMPUTE)  # this program's rank, within the launch
    role = pid % (COMM + COMPUTE)
    rank = first_rank + local
    N = T * K
    local64 = local.to(tl.int64)
    ring_ptr += local64 * Q * BLOCK_M * H
    ready_ptr += local64 * Q
    consumed_ptr += local64 * Q
    group_end_ptr += local * L
    tile_end_ptr += local * L
    row_slot_ptr += local64 * P * N
    if role < COMM:
        if PHASE != 3:
            _comm_program(role, rank, ring_ptr, ready_ptr, consumed_ptr, x_table, x_ready_table, group_end_ptr,
                          tile_end_ptr, row_slot_ptr, err_ptr, epoch, stall_rank, timeout_us, tile_lo, tile_hi, P, L,
                          N, K, H, Q, COMM, PHASE, LOG_L, BLOCK_M, BLOCK_H)
    else:
        if PHASE == 0 or PHASE == 3:
            m = role - COMM
            h_ptr += (local64 * COMPUTE + m) * BLOCK_M * I
            w_off = local64 * L * I * H  # the hosted rank's first expert
            _compute_program(m, rank, ring_ptr, ready_ptr, consumed_ptr, h_ptr, slots_table, arrivals_table,
                             group_end_ptr, tile_end_ptr, row_slot_ptr, wg_ptr + w_off, wu_ptr + w_off, wd_ptr + w_off,
                             err_ptr, epoch, timeout_us, tile_lo, tile_hi, limit, L, N, K, H, I, Q, COMPUTE, PHASE,
                             HAS_LIMIT, LOG_L, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)


# debug: the device assertions below are compiled in
@triton.jit(debug=True, do_not_specialize=["first_rank", "arrivals_expected", "timeout_us"])
def _finish_kernel(slots_table, arrivals_table, w_ptr, shared_ptr, out_ptr, err_ptr, first_rank, arrivals_expected,
                   timeout_us, T, H, K: tl.constexpr, HAS_SHARED: tl.constexpr, SERIAL: tl.constexpr,
                   TRAP: tl.constexpr, BLOCK_H: tl.constexpr):
    local = tl.program_id(0) // T
    t = (tl.program_id(0) % T).to(tl.int64)
    rank = first_rank + local
    arrivals = tl.load(arrivals_table + rank).to(tl.pointer_type(tl.int32))
    _wait(arrivals + t, arrivals_expected, err_ptr, WAIT_ARRIVALS, rank, t, timeout_us, SERIAL)
    if TRAP:
        code = tl.load(err_ptr, volatile=True)
        tl.device_assert(code != WAIT_X_READY, "mok megakernel: timed out waiting for a source rank's x_ready")
        tl.device_assert(code != WAIT_RING_READY, "mok megakernel: timed out waiting for a ring tile to be pulled")
        tl.device_assert(code != WAIT_RING_FREE, "mok megakernel: timed out waiting for a ring slot to be consumed")
        tl.device_assert(code != WAIT_ARRIVALS, "mok megakernel: timed out waiting for a token's K rows to arrive")
    slots_ptr = tl.load(slots_table + rank).to(tl.pointer_type(tl.bfloat16))
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    w_ptr += local.to(tl.int64) * T * K
    acc = _slot_term(slots_ptr, w_ptr, slots_ptr, t, 0, cols, ok, H, K, True, False)
    for j in tl.static_range(1, K):  # ascending slot order, fp32 adds (no FMA: enable_fp_fusion=False)
        acc = acc + _slot_term(slots_ptr, w_ptr, slots_ptr, t, j, cols, ok, H, K, True, False)
    row = (local.to(tl.int64) * T + t) * H
    if HAS_SHARED:
        acc = acc + tl.load(shared_ptr + row + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row + cols, _round_to(acc, out_ptr), mask=ok)


# ----------------------------------------------------------------------------- host side


@dataclass
class MegakernelBuffers:
    """What a launch reads and writes besides the schedule and the weights (module docstring)."""

    ring_VQMH: torch.Tensor
    ready_VQ: torch.Tensor
    consumed_VQ: torch.Tensor
    h_VCMI: torch.Tensor
    tables: dict[str, torch.Tensor]
    """"x_TH", "slots_NH", "arrivals_T", "x_ready": int64 [P] addresses of every rank's buffer."""
    errors: torch.Tensor
    """int64 [6]: code, waiting rank, index, seen, expected (0: no error)."""

    @property
    def ring_tiles(self) -> int:
        return self.ring_VQMH.shape[1]

    @property
    def block_m(self) -> int:
        return self.ring_VQMH.shape[2]


@dataclass(frozen=True)
class LaunchShape:
    """The launch's fixed sizes."""

    ep_degree: int
    first_rank: int
    hosted_ranks: int
    num_tokens: int
    top_k: int
    num_local: int
    comm_programs: int
    compute_programs: int
    block_n: int = 128
    num_warps: int = 4

    @property
    def programs(self) -> int:
        return self.hosted_ranks * (self.comm_programs + self.compute_programs)


def read_error(errors: torch.Tensor) -> str | None:
    """The recorded wait that ran out, in words (None: none). NOTE: host sync (reads the error buffer)."""
    code, rank, index, seen, expected, _ = errors.tolist()
    if code == 0:
        return None
    what = WAIT_NAMES.get(code, "unknown wait code {code}").format(rank=rank, index=index, code=code)
    return f"mok megakernel: timed out: {what} (flag held {seen}, expected {expected})"


def _megakernel_args(bufs, schedule, weights, shape: LaunchShape, epoch, stall_rank, timeout_us, tile_lo, tile_hi,
                     limit):
    group_end_VL, tile_end_VL, row_slot_VR = schedule
    w_gate_XIH, w_up_XIH, w_down_XHI = weights
    _, dim_i, dim_h = w_gate_XIH.shape
    t = bufs.tables
    return (bufs.ring_VQMH, bufs.ready_VQ, bufs.consumed_VQ, bufs.h_VCMI, t["x_TH"], t["slots_NH"], t["arrivals_T"],
            t["x_ready"], group_end_VL, tile_end_VL, row_slot_VR, w_gate_XIH, w_up_XIH, w_down_XHI, bufs.errors,
            shape.first_rank, epoch, stall_rank, timeout_us, tile_lo, tile_hi, limit, shape.ep_degree,
            shape.num_local, shape.num_tokens, shape.top_k, dim_h, dim_i, bufs.ring_tiles, shape.comm_programs,
            shape.compute_programs)


def _constexprs(phase: int, has_limit: bool, num_local: int, block_m: int, block_n: int, dim_h: int,
                num_warps: int) -> dict:
    return dict(PHASE=phase, HAS_LIMIT=has_limit, LOG_L=num_local.bit_length(), BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_K=BLOCK_K, BLOCK_H=min(256, triton.next_power_of_2(dim_h)), DOT_F32=_DOT_F32,
                num_warps=num_warps)


def programs_per_sm(n_regs: int, shared_bytes: int, num_warps: int, props: dict) -> int:
    """Programs of a compiled kernel that fit on one SM at once: by registers (allocated per warp in units of
    256), shared memory (1 KB reserved per program; the SM has the per-program opt-in maximum + 1 KB), threads
    (2048) and blocks (32)."""
    regs_per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = props["max_num_regs"] // (regs_per_warp * num_warps)
    by_shared = (props["max_shared_mem"] + 1024) // (shared_bytes + 1024)
    return max(0, min(by_regs, by_shared, 2048 // (32 * num_warps), 32))


@functools.cache
def co_resident_programs(device_index: int, dim_h: int, dim_i: int, num_local: int, block_m: int, block_n: int,
                         num_warps: int, has_limit: bool) -> int:
    """How many programs of a concurrent launch the device runs at once: the kernel compiled for these sizes (its
    other integers are not specialized), its programs per SM times the SMs."""
    ptrs = [torch.bfloat16, torch.int64, torch.int64, torch.bfloat16, *[torch.int64] * 4, *[torch.int32] * 3,
            *[torch.bfloat16] * 3, torch.int64]  # pointer arguments as their dtypes (Triton's warmup takes those)
    ints = [2] * 6 + [0.0] + [2] * 4 + [dim_h, dim_i] + [2] * 3  # first_rank ... limit, P ... COMPUTE
    constexprs = _constexprs(PHASE_ALL, has_limit, num_local, block_m, block_n, dim_h, num_warps)
    compiled = _megakernel.warmup(*ptrs, *ints, grid=(1,), **constexprs)
    compiled._init_handles()
    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    per_sm = programs_per_sm(compiled.n_regs, compiled.metadata.shared, compiled.metadata.num_warps, props)
    return per_sm * props["multiprocessor_count"]


def megakernel_launch(bufs: MegakernelBuffers, schedule, weights, shape: LaunchShape, *, epoch: int,
                      swiglu_limit: float | None, serialized: bool, stall_rank: int | None = None,
                      timeout_ms: float = 10_000.0) -> None:
    """The forward's one launch (``serialized``: its phases one after another, see the module docstring).

    schedule: (group_end_VL, tile_end_VL, row_slot_VR) int32 of the hosted ranks; weights: (w_gate [V·L, I, H],
    w_up [V·L, I, H], w_down [V·L, H, I]) bf16 contiguous. A concurrent launch with more programs than the device
    runs at once raises instead of risking a deadlock. ``stall_rank``: a rank whose communication programs
    publish nothing (tests of the bounded waits)."""
    if not 1 <= epoch <= MAX_EPOCH:
        raise ValueError(f"megakernel_launch: epoch = {epoch} must be in [1, {MAX_EPOCH}]")
    timeout_us = int(timeout_ms * 1000)
    stall = -1 if stall_rank is None else stall_rank
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
    dim_h = weights[0].shape[2]
    grid = (shape.programs,)

    def launch(phase, tile_lo=0, tile_hi=2**31 - 1):
        args = _megakernel_args(bufs, schedule, weights, shape, epoch, stall, timeout_us, tile_lo, tile_hi, limit)
        constexprs = _constexprs(phase, swiglu_limit is not None, shape.num_local, bufs.block_m, shape.block_n, dim_h,
                                 shape.num_warps)
        if phase == PHASE_ALL:
            max_programs = co_resident_programs(weights[0].device.index, dim_h, weights[0].shape[1], shape.num_local,
                                                bufs.block_m, shape.block_n, shape.num_warps, swiglu_limit is not None)
            if shape.programs > max_programs:
                raise RuntimeError(
                    f"mok megakernel: {shape.programs} programs ({shape.hosted_ranks} ranks x ({shape.comm_programs} "
                    f"communication + {shape.compute_programs} compute)) exceed the {max_programs} this device runs "
                    "at once, so its spin-waits could deadlock: use fewer programs per rank")
        _megakernel[grid](*args, **constexprs)

    if not serialized:
        launch(PHASE_ALL)
        return
    launch(PHASE_PUBLISH)
    # the host knows an upper bound of the tiles (no sync): every row in its own expert's tiles
    max_tiles = triton.cdiv(shape.ep_degree * shape.num_tokens * shape.top_k, bufs.block_m) + shape.num_local
    for n in range(triton.cdiv(max_tiles, bufs.ring_tiles)):  # a round: the ring's tiles, pulled, then computed
        window = (n * bufs.ring_tiles, (n + 1) * bufs.ring_tiles)
        launch(PHASE_COMM, *window)
        launch(PHASE_COMPUTE, *window)


def megakernel_finish(bufs: MegakernelBuffers, weights_VTK: torch.Tensor, shared_VTH: torch.Tensor | None,
                      out_VTH: torch.Tensor, shape: LaunchShape, *, epoch: int, serialized: bool, trap: bool,
                      timeout_ms: float = 10_000.0) -> None:
    """out[v, t] = cast(Σ_j w[v,t,j]·slots_v[t,j] + shared[v,t]) in fp32, ascending j, once token t's K rows have
    arrived (``trap``: a recorded error stops the device with an assertion naming the wait)."""
    num_tokens, dim_h = out_VTH.shape[1:]
    if num_tokens == 0:
        return
    block_h = 1024
    grid = (shape.hosted_ranks * num_tokens, triton.cdiv(dim_h, block_h))
    _finish_kernel[grid](bufs.tables["slots_NH"], bufs.tables["arrivals_T"], weights_VTK,
                         shared_VTH if shared_VTH is not None else out_VTH, out_VTH, bufs.errors, shape.first_rank,
                         epoch * shape.top_k, int(timeout_ms * 1000), num_tokens, dim_h, K=shape.top_k,
                         HAS_SHARED=shared_VTH is not None, SERIAL=serialized, TRAP=trap, BLOCK_H=block_h,
                         enable_fp_fusion=False)
