"""The MoK forward megakernel: one persistent launch in which communication programs pull token rows
into a fixed ring of row tiles while compute programs run the expert FFN on the tiles already there,
in work items of one tile by one column block, and push each result row to its source's combine slot
(docs/design.md §5.9).

Legend: P ep degree, V ranks hosted by this launch (P under virtual EP: all ranks on one device; 1 for
a real rank of a multi-GPU group), T tokens per rank, K top-k, N = T·K slots per rank, H hidden,
I expert FFN size, L local experts per rank, Q ring tiles per rank, M rows per tile (BLOCK_M),
C compute programs per rank, G tiles per group (a step of the item order), NB_I = cdiv(I, BLOCK_N) and
NB_H = cdiv(H, BLOCK_N) column blocks, S = G·(NB_I + NB_H) items per step.

Programs: rank v of this launch owns program ids [v·(COMM + C), (v + 1)·(COMM + C)); the first COMM
are communication programs, the other C compute programs. A rank's tiles are its schedule's rows
(``kernels/mok_schedule.py``: per local expert, (source rank, token, slot) order) cut into M-row tiles
per expert, numbered i = 0, 1, ... expert by expert; tile i lives in ring slot q = i mod Q during round
n = i div Q. Communication program c moves tiles i ≡ c (mod COMM) in ascending i.

Work items of tile i (all of a tile's rows at once, so a weight block is read once per tile):
- A(i, b), b < NB_I: h[:, cols b] = swiglu(x_tile @ w_gate[cols b].T, x_tile @ w_up[cols b].T) over all of H,
  into the h tile of slot q (``h_VQMI``);
- B(i, c), c < NB_H: y[:, cols c] = h_tile @ w_down[cols c].T over all of I; real row r's y stored into its
  source rank's combine slot.
Item order (per rank, j = 0, 1, ...): step s = j div S holds first the A items of the tiles of group s
(tiles [s·G, s·G + G)), column block major (A(s·G, 0), A(s·G + 1, 0), ..., A(s·G, 1), ...: the tiles of
one expert read each weight block side by side, so from L2 after the first), then the B items of group
s - LAG, likewise; items of tiles past the last (or before the first) are skipped. So A items run LAG groups
ahead of the B items that need them, and a program taking a B item rarely finds its A items still running.
Compute programs claim items one at a time, in ascending j, from a per-rank counter (``next_item``, an
atomic add): a free program takes the lowest unclaimed item, so the work balances itself. The last program
to find the items exhausted (``programs_done`` counts them) zeroes both counters, so every launch starts at
item 0 without a host reset, also after an error (every program gets there).

Buffers. Symmetric (each rank's own, peers reach them through int64 [P] address tables, exactly as
``torch.distributed._symmetric_memory`` peer pointers; under virtual EP the "peers" are the other
virtual ranks' allocations on the same device): ``x_TH`` (token rows), ``slots_NH`` (combine slots
(token, slot)), ``arrivals_T`` int32 (rows pushed per token), ``x_ready`` int64 [1] (x_TH published).
Local to a rank: ``ring_VQMH`` (row tiles), ``h_VQMI`` (the SwiGLU rows of each slot's tile), int64
``ready_VQ`` / ``h_ready_VQ`` / ``consumed_VQ`` (per slot: tile pulled / h complete / slot free), int32
``gate_up_done_VQ`` / ``down_done_VQ`` (per slot: A / B items of its tile done), int32 ``next_item_V`` /
``programs_done_V`` (the item counter), ``errors`` int64 [6]. Ring memory per rank: Q·M·(H + I)·2 bytes
(Kimi K2.7, H 7168, I 2048, the default Q = 32, M = 64: 37.7 MB; 302 MB for 8 virtual ranks).

Protocol of one call (epoch e, counted by the host from 1, passed as an argument: no flag is reset
between calls, a flag is compared with the value this call writes; stamp(e, n) = e·2^32 + n):
- publish: communication program 0 of each rank stores x_ready = e (release); its x_TH was written
  before the launch, in stream order.
- pull: a communication program first acquires every source rank's x_ready = e, then per tile i
  (round n, slot q) waits until consumed[q] = stamp(e, n - 1) (the tile that held the slot last is
  done with: its rows and its h; round 0 finds the slot free: the previous call's launch has ended),
  copies the tile's rows from the source ranks' x_TH (row j of expert rows: token (s mod N) div K of
  rank s div N for s = row_slot[j]; rows past the expert's end are zeros) and stores ready[q] =
  stamp(e, n) (release).
- A(i, b): acquire ready[q] = stamp(e, n); compute and store h columns b; then old = gate_up_done[q]++
  (acq_rel: this item's h stores are ordered before, and the last arriver sees every other's). The item
  that sees old = NB_I - 1 rearms gate_up_done[q] = 0 and stores h_ready[q] = stamp(e, n) (release).
- B(i, c): acquire h_ready[q] = stamp(e, n); compute columns c of y and store each real row's into its
  combine slot; then old = down_done[q]++ (acq_rel). The item that sees NB_H - 1 rearms down_done[q] = 0,
  stores consumed[q] = stamp(e, n) (release: every read of the slot's row tile and h tile is done), then
  adds 1 to arrivals[token] on each real row's source rank (release; the other B items' slot stores are
  ordered before through the counter), once per row.
- finish (a second, small launch, ``megakernel_finish``): each rank's token t waits until
  arrivals[t] = e·K (acquire), then out[t] = cast(Σ_j w[t,j]·slots[t,j] + shared[t]) in fp32, ascending j.
Stamps only grow, so a flag left by an earlier call or round never matches. The per-slot item counts go
back to 0 when a tile is done, the item counter when a launch ends; the host zeroes them with the flags
(``reset``, also after an error, which can leave a count short). The arrival counters grow by K per call;
the host zeroes every flag and counter and restarts at epoch 1 before e·K would leave int32
(``MAX_EPOCH``): one memset every ~2^31 / K calls.
Across calls no barrier is needed: a rank rewrites x_TH for call e + 1 only after its finish of call
e saw every one of its rows pushed (so pulled), and peers push into its slots for call e + 1 only
after acquiring its x_ready = e + 1, which it stores after that finish.

Deadlock freedom: rank a rank's work by item index j, with pull(i) just before the first item of tile i's
group (step i div G). Every wait is on lower-ranked work: A(i, ·) on pull(i); B(i, ·) on A(i, ·), LAG >= 0
steps earlier; pull(i) on the B items of tile i - Q, in step (i - Q) div G + LAG, which is below i div G
for every i exactly when (LAG + 1)·G <= Q (checked on the host); x_ready is stored before any wait of its
program. A communication program pulls in ascending i; a compute program holds one item at a time, and
claims are ascending. Take the lowest unfinished piece of work: a pull's program has finished its earlier
pulls and its wait is met, so it runs; an item either is held, by a program that can only be at it and
whose waits are met, or is unclaimed, and then nothing above it is claimed, every claimed item is
finished, and a free compute program takes it. So the launch always progresses, provided every program
is running: the launcher checks that the grid fits the device at once (programs per SM from the compiled
kernel's registers, shared memory and warps) and raises otherwise.
Every wait is bounded (``timeout_ms``): on timeout, or when another program already recorded an error, a
program records (code, waiting rank, index, seen, expected) in ``errors`` (first error wins) and stops
taking work; ``megakernel_finish`` then stops the device with an assertion naming the wait
(``trap=True``) or leaves the record to ``read_error`` (``trap=False``).

Serialized mode (``serialized=True``; Triton's interpreter runs programs one after another, so a spin
there never ends): a launch publishes, then per window of Q tiles (one round) a launch of the
communication programs pulls the window's tiles, a launch of the compute programs runs their A items,
and one their B items, each claiming from the item counter as above; waits become assertions (the
flag must already hold its value, else the same error record).

Bits: the FFN of a row is the Triton grouped FFN's arithmetic (``kernels/grouped_gemm.py``, bf16):
fp32 accumulation over K in 64-wide steps (BLOCK_K: the interpreter's rounding follows the step, the
GPU's MMA chain does not), g and u rounded to bf16, h = silu(g)·u from them rounded to bf16, y
rounded to bf16 (RNE); the reduction is ``mok_combine.slot_reduce``'s (no FMA contraction). Each output
element is computed by one item (no split-K, no atomics on values), so a token's output does not depend
on the tile, the item order, the program, the ring size, the group, the lag, the batch or P.

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
# serialized mode's four kinds.
PHASE_ALL, PHASE_PUBLISH, PHASE_COMM, PHASE_GATE_UP, PHASE_DOWN = 0, 1, 2, 3, 4

# Error codes (errors[0]): which wait ran out.
WAIT_X_READY = tl.constexpr(1)
WAIT_RING_READY = tl.constexpr(2)
WAIT_RING_FREE = tl.constexpr(3)
WAIT_ARRIVALS = tl.constexpr(4)
WAIT_H_READY = tl.constexpr(5)
WAIT_NAMES = {
    1: "x_ready: rank {rank}'s communication program waited for rank {index} to publish its token rows",
    2: "ring ready: rank {rank}'s compute program waited for ring tile {index} to be pulled",
    3: "ring free: rank {rank}'s communication program waited for the ring slot of tile {index} to be consumed",
    4: "arrivals: rank {rank} waited for all K expert rows of its token {index}",
    5: "h ready: rank {rank}'s compute program waited for the gate/up items of ring tile {index}",
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
def _gate_up_block(a_ptr, wg_ptr, wu_ptr, h_ptr, n0, H, I, limit, HAS_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """h[:, n0:n0 + BLOCK_N] = swiglu(a @ w_gate[n0:n0 + BLOCK_N].T, a @ w_up[...].T) for one ring tile a [M, H]
    (bf16, row-major; h [M, I])."""
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    w_rows = offs_n[:, None].to(tl.int64) * H  # [N, 1] rows of w [I, H]
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        # .cg: another SM wrote the tile; read it from L2, never from a line this SM cached in an earlier round
        a = tl.load(a_ptr + offs_m[:, None] * H + offs_k[None, :], mask=k_ok[None, :], other=0.0,
                    cache_modifier=".cg")
        w_ok = n_ok[:, None] & k_ok[None, :]
        acc1 = _dot(a, tl.trans(tl.load(wg_ptr + w_rows + offs_k[None, :], mask=w_ok, other=0.0)), acc1, DOT_F32)
        acc2 = _dot(a, tl.trans(tl.load(wu_ptr + w_rows + offs_k[None, :], mask=w_ok, other=0.0)), acc2, DOT_F32)
    _, _, h = _swiglu_out(acc1, acc2, limit, HAS_LIMIT)
    tl.store(h_ptr + offs_m[:, None] * I + offs_n[None, :], h, mask=n_ok[None, :])


@triton.jit
def _down_block(h_ptr, wd_ptr, dst_ptrs, ok, n0, H, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """y[:, n0:n0 + BLOCK_N] = h @ w_down[n0:n0 + BLOCK_N].T (h [M, I], w_down [H, I]); real row r's columns
    stored at dst_ptrs[r] (its combine slot's row)."""
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    w_rows = offs_n[:, None].to(tl.int64) * I  # [N, 1] rows of w_down [H, I]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < I
        # .cg: other SMs wrote h, and this slot's h is rewritten every round
        a = tl.load(h_ptr + offs_m[:, None] * I + offs_k[None, :], mask=k_ok[None, :], other=0.0,
                    cache_modifier=".cg")
        b = tl.load(wd_ptr + w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
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
def _item(j, G, LAG, NB_I, NB_H):
    """Item j -> (an A item?, its tile, its column block): step j div S holds the A items of group s's tiles
    [s·G, s·G + G), column block major, then the B items of group s - LAG's (a tile < 0 before step LAG)."""
    per_step_a = G * NB_I
    step = j // (per_step_a + G * NB_H)
    r = j % (per_step_a + G * NB_H)
    is_a = r < per_step_a
    r_b = r - per_step_a
    tile = tl.where(is_a, step * G + r % G, (step - LAG) * G + r_b % G)
    block = tl.where(is_a, r // G, r_b // G)
    return is_a, tile, block


@triton.jit
def _gate_up_item(i, b, rank, ring_ptr, h_ptr, ready_ptr, h_ready_ptr, gate_up_done_ptr, group_end_ptr, tile_end_ptr,
                  wg_ptr, wu_ptr, err_ptr, epoch, timeout_us, limit, L, H, I, Q, NB_I, SERIAL: tl.constexpr,
                  HAS_LIMIT: tl.constexpr, LOG_L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """A(i, b) (module docstring); False when its wait ran out."""
    q = i % Q
    n = i // Q
    ok = _wait(ready_ptr + q, _stamp(epoch, n), err_ptr, WAIT_RING_READY, rank, i, timeout_us, SERIAL)
    if ok:
        e = _group_of(i, tile_end_ptr, L, LOG_L)
        w_off = e.to(tl.int64) * I * H
        q64 = q.to(tl.int64)
        _gate_up_block(ring_ptr + q64 * BLOCK_M * H, wg_ptr + w_off, wu_ptr + w_off, h_ptr + q64 * BLOCK_M * I,
                       b * BLOCK_N, H, I, limit, HAS_LIMIT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
        tl.debug_barrier()  # every thread's h columns stored, and its reads of the ring tile done, before the count
        if tl.atomic_add(gate_up_done_ptr + q, 1, sem="acq_rel", scope="sys") == NB_I - 1:
            # the tile's last A item: every other's h columns are ordered before this (acq_rel); rearm the count for
            # the slot's next round (ordered before it by the release below)
            tl.atomic_xchg(gate_up_done_ptr + q, 0, sem="relaxed", scope="sys")
            tl.atomic_xchg(h_ready_ptr + q, _stamp(epoch, n), sem="release", scope="sys")
    return ok


@triton.jit
def _down_item(i, c, rank, h_ptr, h_ready_ptr, consumed_ptr, down_done_ptr, slots_table, arrivals_table,
               group_end_ptr, tile_end_ptr, row_slot_ptr, wd_ptr, err_ptr, epoch, timeout_us, L, N, K, H, I, Q, NB_H,
               SERIAL: tl.constexpr, LOG_L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """B(i, c) (module docstring); False when its wait ran out."""
    q = i % Q
    n = i // Q
    ok = _wait(h_ready_ptr + q, _stamp(epoch, n), err_ptr, WAIT_H_READY, rank, i, timeout_us, SERIAL)
    if ok:
        e, rows, real = _tile_rows(i, group_end_ptr, tile_end_ptr, L, LOG_L, BLOCK_M)
        s = tl.load(row_slot_ptr + rows, mask=real, other=0)  # gathered slot p·N + t·K + j
        src = s // N
        slot_ptrs = tl.load(slots_table + src, mask=real, other=0).to(tl.pointer_type(tl.bfloat16))
        _down_block(h_ptr + q.to(tl.int64) * BLOCK_M * I, wd_ptr + e.to(tl.int64) * H * I,
                    slot_ptrs + (s % N).to(tl.int64) * H, real, c * BLOCK_N, H, I, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
        tl.debug_barrier()  # every thread's slot stores and h reads done before the count
        if tl.atomic_add(down_done_ptr + q, 1, sem="acq_rel", scope="sys") == NB_H - 1:
            # the tile's last B item: every other's slot stores and reads are ordered before this (acq_rel)
            tl.atomic_xchg(down_done_ptr + q, 0, sem="relaxed", scope="sys")
            tl.atomic_xchg(consumed_ptr + q, _stamp(epoch, n), sem="release", scope="sys")
            tl.debug_barrier()  # the count's acquire before every thread's arrival increments
            arrivals = tl.load(arrivals_table + src, mask=real, other=0).to(tl.pointer_type(tl.int32))
            tl.atomic_add(arrivals + (s % N) // K, 1, mask=real, sem="release", scope="sys")
    return ok


@triton.jit
def _compute_program(rank, ring_ptr, h_ptr, ready_ptr, consumed_ptr, h_ready_ptr, gate_up_done_ptr, down_done_ptr,
                     next_item_ptr, programs_done_ptr, slots_table, arrivals_table, group_end_ptr, tile_end_ptr,
                     row_slot_ptr, wg_ptr, wu_ptr, wd_ptr, err_ptr, epoch, timeout_us, tile_lo, tile_hi, item_lo,
                     item_hi, limit, L, N, K, H, I, Q, COMPUTE, G, LAG, PHASE: tl.constexpr, HAS_LIMIT: tl.constexpr,
                     LOG_L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_F32: tl.constexpr):
    SERIAL: tl.constexpr = PHASE != 0
    NB_I = tl.cdiv(I, BLOCK_N)
    NB_H = tl.cdiv(H, BLOCK_N)
    tiles = tl.load(tile_end_ptr + L - 1)
    end = tl.minimum((tl.cdiv(tiles, G) + LAG) * G * (NB_I + NB_H), item_hi)
    tile_lo = tl.maximum(tile_lo, 0)
    tile_hi = tl.minimum(tile_hi, tiles)
    alive = tl.full((), 1, tl.int1)
    j = item_lo + tl.atomic_add(next_item_ptr, 1, sem="relaxed", scope="gpu")
    while alive & (j < end):
        is_a, i, block = _item(j, G, LAG, NB_I, NB_H)
        mine = (i >= tile_lo) & (i < tile_hi)  # a tile of this launch's window (every tile but in serialized mode)
        if PHASE != 4:
            if is_a & mine:
                alive = _gate_up_item(i, block, rank, ring_ptr, h_ptr, ready_ptr, h_ready_ptr, gate_up_done_ptr,
                                      group_end_ptr, tile_end_ptr, wg_ptr, wu_ptr, err_ptr, epoch, timeout_us, limit,
                                      L, H, I, Q, NB_I, SERIAL, HAS_LIMIT, LOG_L, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)
        if PHASE != 3:
            if (is_a == 0) & mine:
                alive = _down_item(i, block, rank, h_ptr, h_ready_ptr, consumed_ptr, down_done_ptr, slots_table,
                                   arrivals_table, group_end_ptr, tile_end_ptr, row_slot_ptr, wd_ptr, err_ptr, epoch,
                                   timeout_us, L, N, K, H, I, Q, NB_H, SERIAL, LOG_L, BLOCK_M, BLOCK_N, BLOCK_K,
                                   DOT_F32)
        j = item_lo + tl.atomic_add(next_item_ptr, 1, sem="relaxed", scope="gpu")
    # this program claims nothing more; the last of the rank's programs to get here rearms the counter for the next
    # launch (stream order puts that launch after every claim of this one)
    # (acq_rel: the others' claims are ordered before the reset)
    if tl.atomic_add(programs_done_ptr, 1, sem="acq_rel", scope="gpu") == COMPUTE - 1:
        tl.atomic_xchg(next_item_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(programs_done_ptr, 0, sem="relaxed", scope="gpu")


# not specialized: the integers that vary per call or per configuration (one compiled kernel per H, I and tiles)
@triton.jit(do_not_specialize=["first_rank", "epoch", "stall_rank", "timeout_us", "tile_lo", "tile_hi", "item_lo",
                               "item_hi", "P", "L", "T", "K", "Q", "COMM", "COMPUTE", "G", "LAG"])
def _megakernel(
    # local to the hosted ranks: ring [V, Q, M, H] bf16, h [V, Q, M, I] bf16
    ring_ptr, h_ptr,
    # ... int64 [V, Q]: ready, h_ready, consumed; int32 [V, Q]: gate_up_done, down_done; int32 [V]: next_item,
    # programs_done
    ready_ptr, h_ready_ptr, consumed_ptr, gate_up_done_ptr, down_done_ptr, next_item_ptr, programs_done_ptr,
    # int64 [P] addresses of every rank's symmetric buffers
    x_table, slots_table, arrivals_table, x_ready_table,
    # the hosted ranks' schedules: group_end, tile_end int32 [V, L], row_slot int32 [V, P·N]
    group_end_ptr, tile_end_ptr, row_slot_ptr,
    # the hosted ranks' expert weights: w_gate, w_up [V·L, I, H], w_down [V·L, H, I] bf16
    wg_ptr, wu_ptr, wd_ptr,
    err_ptr,
    first_rank, epoch, stall_rank, timeout_us, tile_lo, tile_hi, item_lo, item_hi, limit,
    P, L, T, K, H, I, Q, COMM, COMPUTE, G, LAG,
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
        if PHASE <= 2:
            _comm_program(role, rank, ring_ptr, ready_ptr, consumed_ptr, x_table, x_ready_table, group_end_ptr,
                          tile_end_ptr, row_slot_ptr, err_ptr, epoch, stall_rank, timeout_us, tile_lo, tile_hi, P, L,
                          N, K, H, Q, COMM, PHASE, LOG_L, BLOCK_M, BLOCK_H)
    else:
        if PHASE == 0 or PHASE >= 3:
            w_off = local64 * L * I * H  # the hosted rank's first expert
            _compute_program(rank, ring_ptr, h_ptr + local64 * Q * BLOCK_M * I, ready_ptr, consumed_ptr,
                             h_ready_ptr + local64 * Q, gate_up_done_ptr + local64 * Q, down_done_ptr + local64 * Q,
                             next_item_ptr + local, programs_done_ptr + local, slots_table, arrivals_table,
                             group_end_ptr, tile_end_ptr, row_slot_ptr, wg_ptr + w_off, wu_ptr + w_off, wd_ptr + w_off,
                             err_ptr, epoch, timeout_us, tile_lo, tile_hi, item_lo, item_hi, limit, L, N, K, H, I, Q,
                             COMPUTE, G, LAG, PHASE, HAS_LIMIT, LOG_L, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)


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
        tl.device_assert(code != WAIT_H_READY, "mok megakernel: timed out waiting for a ring tile's gate/up items")
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
    h_VQMI: torch.Tensor
    ready_VQ: torch.Tensor
    h_ready_VQ: torch.Tensor
    consumed_VQ: torch.Tensor
    gate_up_done_VQ: torch.Tensor
    down_done_VQ: torch.Tensor
    next_item_V: torch.Tensor
    programs_done_V: torch.Tensor
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

    @property
    def flags(self) -> list[torch.Tensor]:
        """The launch's own flags and counters (the symmetric ones are the caller's)."""
        return [self.ready_VQ, self.h_ready_VQ, self.consumed_VQ, self.gate_up_done_VQ, self.down_done_VQ,
                self.next_item_V, self.programs_done_V]


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
    group_tiles: int
    lag: int
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 4

    @property
    def programs(self) -> int:
        return self.hosted_ranks * (self.comm_programs + self.compute_programs)

    def items_per_step(self, dim_h: int, dim_i: int) -> int:
        """S = G·(NB_I + NB_H): the A items of a group of tiles and the B items of another (module docstring)."""
        return self.group_tiles * (triton.cdiv(dim_i, self.block_n) + triton.cdiv(dim_h, self.block_n))


def read_error(errors: torch.Tensor) -> str | None:
    """The recorded wait that ran out, in words (None: none). NOTE: host sync (reads the error buffer)."""
    code, rank, index, seen, expected, _ = errors.tolist()
    if code == 0:
        return None
    what = WAIT_NAMES.get(code, "unknown wait code {code}").format(rank=rank, index=index, code=code)
    return f"mok megakernel: timed out: {what} (flag held {seen}, expected {expected})"


def _megakernel_args(bufs, schedule, weights, shape: LaunchShape, epoch, stall_rank, timeout_us, tiles, items, limit):
    group_end_VL, tile_end_VL, row_slot_VR = schedule
    w_gate_XIH, w_up_XIH, w_down_XHI = weights
    _, dim_i, dim_h = w_gate_XIH.shape
    t = bufs.tables
    return (bufs.ring_VQMH, bufs.h_VQMI, *bufs.flags, t["x_TH"], t["slots_NH"], t["arrivals_T"], t["x_ready"],
            group_end_VL, tile_end_VL, row_slot_VR, w_gate_XIH, w_up_XIH, w_down_XHI, bufs.errors, shape.first_rank,
            epoch, stall_rank, timeout_us, *tiles, *items, limit, shape.ep_degree, shape.num_local, shape.num_tokens,
            shape.top_k, dim_h, dim_i, bufs.ring_tiles, shape.comm_programs, shape.compute_programs,
            shape.group_tiles, shape.lag)


def _constexprs(phase: int, has_limit: bool, num_local: int, block_m: int, block_n: int, dim_h: int,
                num_warps: int, num_stages: int) -> dict:
    return dict(PHASE=phase, HAS_LIMIT=has_limit, LOG_L=num_local.bit_length(), BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_K=BLOCK_K, BLOCK_H=min(256, triton.next_power_of_2(dim_h)), DOT_F32=_DOT_F32,
                num_warps=num_warps, num_stages=num_stages)


def compile_megakernel(dim_h: int, dim_i: int, num_local: int, block_m: int, block_n: int, num_warps: int,
                       num_stages: int, has_limit: bool):
    """The concurrent launch's kernel compiled for these sizes (its other integers are not specialized), launching
    nothing: the current driver's target (``benchmarks/tools/sass.py`` compiles it for sm_90 without a GPU)."""
    ptrs = [torch.bfloat16] * 2 + [torch.int64] * 3 + [torch.int32] * 4 + [torch.int64] * 4 + [torch.int32] * 3 + [
        torch.bfloat16] * 3 + [torch.int64]  # pointer arguments as their dtypes (Triton's warmup takes those)
    ints = [2] * 8 + [0.0] + [2] * 4 + [dim_h, dim_i] + [2] * 5  # first_rank ... item_hi, limit, P ... LAG
    constexprs = _constexprs(PHASE_ALL, has_limit, num_local, block_m, block_n, dim_h, num_warps, num_stages)
    return _megakernel.warmup(*ptrs, *ints, grid=(1,), **constexprs)


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
                         num_warps: int, num_stages: int, has_limit: bool) -> int:
    """How many programs of a concurrent launch the device runs at once: the kernel compiled for these sizes, its
    programs per SM times the SMs."""
    compiled = compile_megakernel(dim_h, dim_i, num_local, block_m, block_n, num_warps, num_stages, has_limit)
    compiled._init_handles()
    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    per_sm = programs_per_sm(compiled.n_regs, compiled.metadata.shared, compiled.metadata.num_warps, props)
    return per_sm * props["multiprocessor_count"]


def megakernel_phase(bufs: MegakernelBuffers, schedule, weights, shape: LaunchShape, phase: int, *, epoch: int,
                     swiglu_limit: float | None, stall_rank: int | None = None, timeout_ms: float = 10_000.0,
                     tiles: tuple[int, int] = (0, 2**31 - 1), items: tuple[int, int] = (0, 2**31 - 1)) -> None:
    """One launch of the grid in ``phase`` (PHASE_*): its communication programs move the tiles in ``tiles`` (a
    half-open range), its compute programs run the items in ``items`` whose tile is in ``tiles``. PHASE_ALL is the
    concurrent launch: refused when the device cannot hold every program at once. ``megakernel_launch`` makes the
    calls; tests call the serialized phases one by one."""
    dim_i, dim_h = weights[0].shape[1:]
    has_limit = swiglu_limit is not None
    if phase == PHASE_ALL:
        max_programs = co_resident_programs(weights[0].device.index, dim_h, dim_i, shape.num_local, bufs.block_m,
                                            shape.block_n, shape.num_warps, shape.num_stages, has_limit)
        if shape.programs > max_programs:
            raise RuntimeError(
                f"mok megakernel: {shape.programs} programs ({shape.hosted_ranks} ranks x ({shape.comm_programs} "
                f"communication + {shape.compute_programs} compute)) exceed the {max_programs} this device runs "
                "at once, so its spin-waits could deadlock: use fewer programs per rank")
    args = _megakernel_args(bufs, schedule, weights, shape, epoch, -1 if stall_rank is None else stall_rank,
                            int(timeout_ms * 1000), tiles, items, float(swiglu_limit) if has_limit else 0.0)
    constexprs = _constexprs(phase, has_limit, shape.num_local, bufs.block_m, shape.block_n, dim_h, shape.num_warps,
                             shape.num_stages)
    _megakernel[(shape.programs,)](*args, **constexprs)


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
    ring, group = bufs.ring_tiles, shape.group_tiles
    if (shape.lag + 1) * group > ring:
        raise ValueError(f"megakernel_launch: (lag + 1) x group_tiles = ({shape.lag} + 1) x {group} must be <= the "
                         f"{ring} ring tiles (module docstring: deadlock freedom)")
    run = functools.partial(megakernel_phase, bufs, schedule, weights, shape, epoch=epoch, swiglu_limit=swiglu_limit,
                            stall_rank=stall_rank, timeout_ms=timeout_ms)
    if not serialized:
        run(PHASE_ALL)
        return
    run(PHASE_PUBLISH)
    # the host knows an upper bound of the tiles (no sync): every row in its own expert's tiles
    max_tiles = triton.cdiv(shape.ep_degree * shape.num_tokens * shape.top_k, bufs.block_m) + shape.num_local
    per_step = shape.items_per_step(weights[0].shape[2], weights[0].shape[1])
    for n in range(triton.cdiv(max_tiles, ring)):  # a round: the ring's tiles pulled, their A items, their B items
        lo, hi = n * ring, (n + 1) * ring
        steps = (lo // group, triton.cdiv(hi, group))  # the steps holding the window's A items
        run(PHASE_COMM, tiles=(lo, hi))
        run(PHASE_GATE_UP, tiles=(lo, hi), items=(steps[0] * per_step, steps[1] * per_step))
        run(PHASE_DOWN, tiles=(lo, hi), items=((steps[0] + shape.lag) * per_step, (steps[1] + shape.lag) * per_step))


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
