"""The MoK forward megakernel: one persistent launch in which communication programs pull token rows
into a fixed ring of row tiles while compute programs run the expert FFN on the tiles already there,
in work items of one tile by one column block, and push each result row to its source's combine slot;
optionally the shared expert too, as more items on each rank's own tokens (docs/design.md §5.9).

Legend: P ep degree, V ranks hosted by this launch (P under virtual EP: all ranks on one device; 1 for
a real rank of a multi-GPU group), T tokens per rank, K top-k, N = T·K slots per rank, H hidden,
I expert FFN size, I_S the shared expert's, L local experts per rank, Q ring tiles per rank, M rows per
tile (BLOCK_M), C compute programs per rank, G tiles per group (a step of the item order), SG groups of
shared-expert tiles (0: no shared expert in the launch), F = Q + SG·G flag slots, NB_I = cdiv(I, BLOCK_N),
NB_IS = cdiv(I_S, BLOCK_N) and NB_H = cdiv(H, BLOCK_N) column blocks.

Programs: rank v of this launch owns program ids [v·(COMM + C), (v + 1)·(COMM + C)); the first COMM
are communication programs, the other C compute programs. A rank's routed tiles are its schedule's rows
(``kernels/mok_schedule.py``: per local expert, (source rank, token, slot) order) cut into M-row tiles
per expert, numbered i = 0, 1, ... expert by expert; tile i lives in ring slot q = i mod Q during round
n = i div Q. Communication program c moves tiles i ≡ c (mod COMM) in ascending i. The shared expert's
tiles are the rank's own token rows [u·M, u·M + M), u < cdiv(T, M), read from its x_TH in place.

Work items of a tile (all of a tile's rows at once, so a weight block is read once per tile):
- A(·, b), b < NB_I (NB_IS): h[:, cols b] = swiglu(x_tile @ w_gate[cols b].T, x_tile @ w_up[cols b].T) over
  all of H, into the tile's h rows (``h_VQMI`` of slot q; the shared expert's ``shared_h_VRI``);
- B(·, c), c < NB_H: y[:, cols c] = h_tile @ w_down[cols c].T over all of I (I_S); each real row's y stored
  into its source rank's combine slot (the shared expert's: into ``shared_out_VTH``, which the finish adds).
Item order (per rank, j = 0, 1, ...): tiles u of the order are the shared expert's first (SG groups of G,
the last padded with tiles that are skipped), then the routed ones (u = SG·G + i). Step s holds first the
A items of group s (tiles [s·G, s·G + G)), column block major (A(s·G, 0), A(s·G + 1, 0), ..., A(s·G, 1),
...: the tiles of one expert read each weight block side by side, so from L2 after the first), then the B
items of group s - LAG, likewise; items of tiles past the last (or before the first) are skipped. So A items
run LAG groups ahead of the B items that need them, a program taking a B item rarely finds its A items still
running, and the shared expert's items, which wait on no pull, come first and fill the wait for the first
pulled tiles. Compute programs claim items one at a time, in ascending j, from a per-rank counter
(``next_item``, an atomic add): a free program takes the lowest unclaimed item, so the work balances
itself. The last program to find the items exhausted (``programs_done`` counts them) zeroes both counters,
so every launch starts at item 0 without a host reset, also after an error (every program gets there).

Buffers. Symmetric (each rank's own, peers reach them through int64 [P] address tables, exactly as
``torch.distributed._symmetric_memory`` peer pointers; under virtual EP the "peers" are the other
virtual ranks' allocations on the same device): ``x_TH`` (token rows), ``slots_NH`` (combine slots
(token, slot)), ``arrivals_T`` int32 (rows pushed per token), ``x_ready`` int64 [1] (x_TH published).
Local to a rank: ``ring_VQMH`` (row tiles), ``h_VQMI`` (the SwiGLU rows of each slot's tile), ``ready_VQ``
int64 (per slot: tile pulled); per flag slot f (the ring's Q slots, then the shared expert's tiles) int64
``h_ready_VF`` / ``consumed_VF`` (h complete / tile done) and int32 ``gate_up_done_VF`` / ``down_done_VF``
(A / B items of its tile done); int32 ``next_item_V`` / ``programs_done_V`` (the item counter); ``errors``
int64 [6]; with the shared expert ``shared_h_VRI`` (R = SG·G·M rows of I_S) and ``shared_out_VTH``. Ring
memory per rank: Q·M·(H + I)·2 bytes (Kimi K2.7, H 7168, I 2048, the default Q = 32, M = 64: 37.7 MB;
302 MB for 8 virtual ranks; M = 128: 75.5 MB, 604 MB); the shared expert adds SG·G·M·I_S·2 + T·H·2 bytes (37.7 MB
at T = 2048, M = 64).

Protocol of one call (epoch e, counted by the host from 1, passed as an argument: no flag is reset
between calls, a flag is compared with the value this call writes; stamp(e, n) = e·2^32 + n):
- publish: communication program 0 of each rank stores x_ready = e (release); its x_TH was written
  before the launch, in stream order.
- pull: a communication program first acquires every source rank's x_ready >= e (on real EP a fast source
  may already have published call e + 1: see "Across calls"), then per tile i
  (round n, slot q) waits until consumed[q] = stamp(e, n - 1) (the tile that held the slot last is
  done with: its rows and its h; round 0 finds the slot free: the previous call's launch has ended),
  copies the tile's rows from the source ranks' x_TH (row j of expert rows: token (s mod N) div K of
  rank s div N for s = row_slot[j]; rows past the expert's end are zeros) and stores ready[q] =
  stamp(e, n) (release).
- A item of routed tile i: acquire ready[q] = stamp(e, n) (a shared tile's waits for nothing: its rows
  were written before the launch); compute and store its h columns; then old = gate_up_done[f]++ (acq_rel:
  this item's h stores are ordered before, and the last arriver sees every other's). The item that sees
  old = NB_I - 1 (NB_IS) rearms gate_up_done[f] = 0 and stores h_ready[f] = stamp(e, n) (release; a shared
  tile's stamp is stamp(e, 0)).
- B item: acquire h_ready[f]; compute its columns of y and store each real row's; then old =
  down_done[f]++ (acq_rel). The item that sees NB_H - 1 rearms down_done[f] = 0, stores consumed[f] =
  stamp (release: every read of the slot's row tile and h tile is done; read by the pulls, not for a
  shared tile), then adds 1 to arrivals[token] of each real row's source rank (release; the other B
  items' stores are ordered before through the counter), once per row.
- finish (a second, small launch, ``megakernel_finish``): each rank's token t waits until arrivals[t] =
  the host's running total (K + 1 per call with the shared expert in the launch, else K; e·(K + 1) or e·K
  when one workspace's calls own the counters) (acquire), then out[t] = cast(Σ_j w[t,j]·slots[t,j]
  + shared[t]·scale[t]) in fp32, ascending j (scale: optional, per token; shared: the launch's or an input).
Stamps only grow, so a flag left by an earlier call or round never matches. The per-slot item counts go
back to 0 when a tile is done, the item counter when a launch ends; the host zeroes them with the flags
(``reset``, also after an error, which can leave a count short). The arrival counters grow by K (+ 1) per
call; the host zeroes every flag and counter and restarts at epoch 1 before they would leave int32
(``MAX_EPOCH``): one memset every ~2^31 / (K + 1) calls (on real EP between two barriers of the group).
Across calls no barrier is needed: a rank rewrites x_TH for call e + 1 only after its finish of call
e saw every one of its rows pushed (so pulled), and peers push into its slots for call e + 1 only
after acquiring its x_ready >= e + 1, which it stores after that finish. On real EP (one hosted rank per
launch, P launches on P devices) a rank can thus publish call e + 1 while a peer's communication program
of call e has yet to acquire its x_ready: that program pulls none of its rows (else the rank's finish of
call e would still wait for them), so ">= e" lets it pass without reading rows of the wrong call.

Deadlock freedom: rank a rank's work by item index j, with pull(i) just before the first item of routed
tile i's group (step SG + i div G). Every wait is on lower-ranked work: a routed A item on pull(i); a B
item on its tile's A items, LAG >= 0 steps earlier; pull(i) on the B items of tile i - Q, in step
SG + (i - Q) div G + LAG, which is below SG + i div G for every i exactly when (LAG + 1)·G <= Q (checked on
the host); x_ready is stored before any wait of its program. A communication program pulls in ascending
i; a compute program holds one item at a time, and claims are ascending. Take the lowest unfinished piece
of work: a pull's program has finished its earlier pulls and its wait is met, so it runs; an item either
is held, by a program that can only be at it and whose waits are met, or is unclaimed, and then nothing
above it is claimed, every claimed item is finished, and a free compute program takes it. So the launch
always progresses, provided every program is running: the launcher checks that the grid fits the device
at once (programs per SM from the compiled kernel's registers, shared memory and warps) and raises
otherwise.
Every wait is bounded (``timeout_ms``): on timeout, or when another program already recorded an error, a
program records (code, waiting rank, index, seen, expected) in ``errors`` (first error wins) and stops
taking work; ``megakernel_finish`` then stops the device with an assertion naming the wait
(``trap=True``) or leaves the record to ``read_error`` (``trap=False``).

GEMMs of the items (``LaunchShape.gemm``, the TMA constexpr): K loops of BLOCK_K steps, software-pipelined
(num_stages), on M-row tiles (64 or 128), their operands read by masked pointer loads ("ptr") or by TMA ("tma")
through tensor descriptors each compute program makes once, before its first claim: over the rank's ring [Q·M, H]
and h [Q·M, I], its experts' weights as [L·I, H] and [L·H, I], and the shared expert's x [T, H], h [SG·G·M, I_S]
and weights. TMA reads what other programs stored (the pulled rows, h) through the async proxy, so a proxy fence
follows the acquire that waited for them. The loads give the same operand values: where pointer loads mask (rows
past a tile's expert's end: zeros in the ring, stored so by the pull; the shared expert's rows past T; columns past
H or I) TMA reads zeros, and the weight rows of another expert that a TMA block may reach only feed output columns
that are never stored.

Serialized mode (``serialized=True``; Triton's interpreter runs programs one after another, so a spin
there never ends): a launch publishes; the shared expert's tiles: a launch of the compute programs runs
their A items, one their B items; then per window of Q routed tiles (one round) a launch of the
communication programs pulls the window's tiles, a launch of the compute programs runs their A items,
and one their B items, each claiming from the item counter as above over the steps that hold them; waits
become assertions (the flag must already hold its value, else the same error record).

Bits: the FFN of a row is the Triton grouped FFN's arithmetic (``kernels/grouped_gemm.py``, bf16):
fp32 accumulation over K in 64-wide steps (BLOCK_K: the interpreter's rounding follows the step, the
GPU's MMA chain does not), g and u rounded to bf16, h = silu(g)·u from them rounded to bf16, y
rounded to bf16 (RNE); so a shared expert row is ``SharedExpert(use_triton=True)``'s. The reduction is
``mok_combine.slot_reduce``'s (no FMA contraction; a scaled shared row rounded to fp32 before its add, as
the gated SharedExpert's fp32 output). Each output element is computed by one item (no split-K, no atomics
on values), so a token's output does not depend on the tile (or M), the item order, the program, the ring size,
the group, the lag, the batch, P or the loads.

Kept rows (the KEEP_ROWS constexpr, ``KeptRows``; training launches, bf16 or MXFP8): each routed A item also stores
the g, u and h columns of its real rows into per-call grouped rows [V, R, I] (R = P·N; tile row m at schedule row
tile_start + m, none past its expert's end), the values its h comes from, so the bits ``grouped_gate_up_swiglu``
returns on those rows (MXFP8: h before its quantization along I, as that function returns it and the Triton path's
backward reads it): the backward reads them instead of running the gate/up GEMM again. The shared expert's items
never store there; without the flag the stores are not compiled in (the inference launch is unchanged).

MXFP8 (the MX constexpr: the routed weights given as MXTensors): the routed experts' operands as the Triton
grouped FFN's MXFP8 path has them. Its A operands, the pulled rows and h, are held as the bf16 values of their MXFP8
quantization (``_mx_values``: ``mxfp8_fake_quantize``'s code): the pull quantizes each row along H on the way into
the ring, an A item its h columns along I (whole 32-blocks: BLOCK_N and I multiples of 32) before storing them; so
the items read ring and h as the bf16 path does, and nothing dequantizes them. The weights arrive as the Triton
path's MXFP8 operands (E4M3 in MMA order, E8M0 scales [rows, K/32]; quantized by the caller, never here), and the
items dequantize their blocks to bf16 in registers (exact), one 32-wide K step per MMA (the Triton path's MXFP8
step: the interpreter's rounding follows it), each step's scales loaded one step ahead. They compute the product
transposed, acc^T = w @ a^T, as the Triton path's warp-specialized kernel does: the dequantized weights are the
MMA's register operand (no trip through shared memory, no barrier), so a step's MMAs run while the next block is
dequantized; each output element is the same sum of the same products. So a row is the Triton grouped FFN's MXFP8
row bit for bit. The shared expert's items stay bf16. Ring memory per rank: the bf16 ring's,
Q·M·(H + I)·2 bytes, twice what E4M3 rows with their scales take (Q·M·(H + I)·(1 + 1/32): 37.7 MB against 19.5 MB
at Kimi K2.7's sizes, Q = 32, M = 64), the price of A operands that need no dequantization.

Trace (the TRACE constexpr, a diagnostic: ``benchmarks/tools/megakernel_bench.py --trace``): every program writes
one row of int64 [programs, 8] (TRACE_FIELDS) when it ends: its start and end (%globaltimer, ns), the time it spent in
waits, in A items (pulls, for a communication program) and in B items, and how many of each it ran; the rest of its
span is claims, schedule lookups and counts. Serialized mode records the counts and zero times (the interpreter has no
clock). Without the flag nothing of it is compiled in.

Not here: the backward.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from titan_mok.kernels.grouped_gemm import _DOT_F32, _dot, _set_triton_allocator
from titan_mok.kernels.grouped_tiles import _bf16_rne, _group_of, _swiglu_out
from titan_mok.kernels.mok_combine import _round_to, _slot_term
from titan_mok.kernels.mxfp8 import BLOCK as MX_BLOCK
from titan_mok.kernels.mxfp8 import MXTensor
from titan_mok.kernels.mxfp8_quant import mx_dequantize_bf16, mx_dequantize_bits, mx_from_mma_order, mx_quantize_block

# Launch phases (the PHASE constexpr; the kernels compare it with these literals): one concurrent launch, or the
# serialized mode's four kinds.
PHASE_ALL, PHASE_PUBLISH, PHASE_COMM, PHASE_GATE_UP, PHASE_DOWN = 0, 1, 2, 3, 4

# Error codes (errors[0]): which wait ran out.
WAIT_X_READY = tl.constexpr(1)
WAIT_RING_READY = tl.constexpr(2)
WAIT_RING_FREE = tl.constexpr(3)
WAIT_ARRIVALS = tl.constexpr(4)
WAIT_H_READY = tl.constexpr(5)
WAIT_SHARED_H_READY = tl.constexpr(6)
WAIT_NAMES = {
    1: "x_ready: rank {rank}'s communication program waited for rank {index} to publish its token rows",
    2: "ring ready: rank {rank}'s compute program waited for ring tile {index} to be pulled",
    3: "ring free: rank {rank}'s communication program waited for the ring slot of tile {index} to be consumed",
    4: "arrivals: rank {rank} waited for all K expert rows of its token {index}",
    5: "h ready: rank {rank}'s compute program waited for the gate/up items of ring tile {index}",
    6: "shared h ready: rank {rank}'s compute program waited for the shared expert's gate/up items of its token "
       "tile {index}",
}

BLOCK_K = 64
"""K step of every GEMM: the Triton grouped FFN's bf16 step (the interpreter rounds to fp32 once per step)."""
GEMM_LOADS = ("ptr", "tma")
"""How the items' GEMMs read their operands (LaunchShape.gemm): masked pointer loads, or TMA loads through tensor
descriptors each compute program makes once (H, I and I_S multiples of 8: 16-byte rows)."""
MAX_EPOCH = 2**31 // 65 - 1
"""Largest epoch before the host resets the flags: e·(K + 1) stays inside int32 for K <= 64."""
TRACE_FIELDS = ("start_ns", "end_ns", "wait_ns", "a_ns", "b_ns", "a_items", "b_items", "role")
"""A traced launch's row per program (module docstring, Trace); a communication program's A items are its pulled
tiles, role 0 for it and 1 for a compute program."""


@triton.jit
def _clock(TRACE: tl.constexpr, SERIAL: tl.constexpr):
    """%globaltimer (ns) in a traced concurrent launch; 0 otherwise (the interpreter has no clock)."""
    if TRACE and not SERIAL:
        now = globaltimer().to(tl.int64)
    else:
        now = tl.full((), 0, tl.int64)
    return now


@triton.jit
def _store_trace(trace_ptr, start, wait_ns, a_ns, b_ns, a_items, b_items, role, TRACE: tl.constexpr,
                 SERIAL: tl.constexpr):
    """This program's trace row (TRACE_FIELDS); nothing without TRACE. SERIAL: its counts are added to the row's
    (zero times), so that the phases' launches sum up."""
    if TRACE:
        tl.store(trace_ptr + 0, start)
        tl.store(trace_ptr + 1, _clock(TRACE, SERIAL))
        tl.store(trace_ptr + 2, wait_ns)
        tl.store(trace_ptr + 3, a_ns)
        tl.store(trace_ptr + 4, b_ns)
        if SERIAL:
            a_items += tl.load(trace_ptr + 5).to(tl.int32)
            b_items += tl.load(trace_ptr + 6).to(tl.int32)
        tl.store(trace_ptr + 5, a_items)  # (a store casts to int64)
        tl.store(trace_ptr + 6, b_items)
        tl.store(trace_ptr + 7, role)


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
def _wait(flag_ptr, expected, err_ptr, code: tl.constexpr, rank, index, timeout_us, SERIAL: tl.constexpr,
          AT_LEAST: tl.constexpr = False):
    """Whether *flag_ptr reached ``expected`` (acquire; AT_LEAST: any value >= expected), spinning at most timeout_us
    microseconds (SERIAL: no spin, an assertion); on failure, or once another program recorded an error, records this
    wait and returns False."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if not SERIAL:
        timeout_ns = timeout_us.to(tl.int64) * 1000
        start = globaltimer()
        waiting = (seen < expected) if AT_LEAST else (seen != expected)
        while waiting:
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            calm = tl.load(err_ptr, volatile=True) == 0
            missing = (seen < expected) if AT_LEAST else (seen != expected)
            waiting = missing & calm & (globaltimer() - start < timeout_ns)
    ok = (seen >= expected) if AT_LEAST else (seen == expected)
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
def _pull_tile(tile_ptr, x_table, row_slot_ptr, rows, ok, pulled_ptr, N, K, H, MX: tl.constexpr,
               KEEP_PULLED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """tile [M, H] = the rows' token rows from their source ranks' x_TH; rows past the expert's end zero. MX: the
    rows' MXFP8 values instead (_mx_values along H: the Triton grouped FFN's A operand, as its
    ``mxfp8_fake_quantize`` makes it; zero rows stay zero). KEEP_PULLED: the real rows also, as pulled (before any
    quantization), into the grouped rows [R, H] at pulled_ptr, row rows[m] (the dgrad launch's dy rows)."""
    s = tl.load(row_slot_ptr + rows, mask=ok, other=0)  # gathered slot p·N + t·K + j
    src_base = tl.load(x_table + s // N, mask=ok, other=0).to(tl.pointer_type(tl.bfloat16))
    src_ptrs = src_base + ((s % N) // K).to(tl.int64) * H  # [M] token rows on the source ranks
    dst_ptrs = tile_ptr + tl.arange(0, BLOCK_M).to(tl.int64) * H
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        col_ok = (cols < H)[None, :]
        v = tl.load(src_ptrs[:, None] + cols[None, :], mask=ok[:, None] & col_ok, other=0.0)
        if KEEP_PULLED:
            tl.store(pulled_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], v, mask=ok[:, None] & col_ok)
        if MX:  # H is a multiple of 32: a block lies wholly inside the row or wholly past it (zeros, not stored)
            v = _mx_values(v, BLOCK_M, BLOCK_H)
        tl.store(dst_ptrs[:, None] + cols[None, :], v, mask=col_ok)


@triton.jit
def _mx_values(v, BR: tl.constexpr, BC: tl.constexpr):
    """The bf16 values of tile v [BR, BC]'s MXFP8 quantization, blocks of 32 along its rows: ``mx_quantize_block``'s
    rule and ``mx_dequantize_bf16``'s values, the same code as ``mxfp8_fake_quantize``, so the bits of the Triton
    grouped FFN's MXFP8 A operand (NaN for a block holding NaN or Inf)."""
    q, e, bad = mx_quantize_block(tl.reshape(v.to(tl.float32), (BR, BC // 32, 32)), 2)
    return tl.reshape(mx_dequantize_bf16(q, e, bad), (BR, BC))


@triton.jit
def _async_proxy_fence(ENABLED: tl.constexpr):
    """Orders what this thread's acquire made visible (rows other programs stored, generic proxy) before the TMA
    loads it issues next (async proxy). Not needed in serialized mode: launches end between writer and reader."""
    if ENABLED:
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _own_rows(x_table, rank):
    """This rank's token rows x_TH (the shared expert's A operand)."""
    return tl.load(x_table + rank).to(tl.pointer_type(tl.bfloat16))


@triton.jit
def _descriptor(ptr, rows, width, BR: tl.constexpr, BC: tl.constexpr):
    """A TMA descriptor of the row-major [rows, width] bf16 operand at ptr, in [BR, BC] blocks."""
    return tl.make_tensor_descriptor(ptr, shape=[rows, width], strides=[width, 1], block_shape=[BR, BC])


@triton.jit
def _operand_tile(src, row, col, row_ok, width, BR: tl.constexpr, BC: tl.constexpr, TMA: tl.constexpr,
                  CACHE: tl.constexpr):
    """The [BR, BC] block at (row, col) of a row-major operand [rows, width] (bf16): by TMA through the tensor
    descriptor src (TMA; rows and columns past its shape read as zeros), or a masked load from the pointer src (rows
    where not row_ok and columns >= width read as zeros; CACHE: its cache modifier)."""
    if TMA:
        block = src.load([row, col])
    else:
        first = src + (row + tl.zeros((), tl.int64)) * width  # the block's first row (row: int32 or a literal)
        cols = col + tl.arange(0, BC)
        block = tl.load(first + tl.arange(0, BR)[:, None] * width + cols[None, :],
                        mask=row_ok[:, None] & (cols < width)[None, :], other=0.0, cache_modifier=CACHE)
    return block


@triton.jit
def _scale_bits(scale_rows, k, row_ok, width):
    """A weight block's E8M0 bits [BR] for the 32 columns from k: per row, at scale_rows[r] + k / 32 ([rows,
    width / 32] uint8); 127 (2^0) for rows where not row_ok and for k past the row."""
    return tl.load(scale_rows + k // 32, mask=row_ok & (k < width), other=127)


@triton.jit
def _mx_weight_tile(src, row, col, row_ok, width, bits, BR: tl.constexpr, TMA: tl.constexpr):
    """The [BR, 32] block at (row, col) of an MXFP8 weight operand (the Triton path's: E4M3 [rows, width] uint8,
    each 32-block's elements in MMA order, ``MXTensor.mma_order``) as the MMA's bf16 values in index order (exact:
    E4M3 · 2^e), its E8M0 bits [BR] given (_scale_bits, loaded a step ahead); the E4M3 bits as _operand_tile reads
    them."""
    q = mx_from_mma_order(_operand_tile(src, row, col, row_ok, width, BR, 32, TMA, ""), BR)
    return mx_dequantize_bits(q.to(tl.float8e4nv, bitcast=True), bits, 1)


@triton.jit
def _gate_up_block(a_src, a_row, a_ok, wg_src, wu_src, w_row, h_ptr, n0, H, I, limit, wg_scales, wu_scales,
                   kept_g_ptr, kept_u_ptr, kept_h_ptr, kept_rows, HAS_LIMIT: tl.constexpr, MX: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                   TMA: tl.constexpr, KEEP_ROWS: tl.constexpr):
    """h[:, n0:n0 + BLOCK_N] = swiglu(a @ w_gate[n0:n0 + BLOCK_N].T, a @ w_up[...].T) for the row tile a = rows
    [a_row, a_row + M) of a_src [rows, H] (rows where not a_ok read as zeros) and the expert's weights = rows
    [w_row, w_row + I) of wg_src / wu_src [rows, H] (_operand_tile: pointers or TMA descriptors); h [M, I] at h_ptr.
    TMA: a block's columns past I read the next expert's weight rows (or zeros past the last); they only feed
    output columns that the store masks. Its rows past a_ok are zeros in memory: the pull stores zeros for the rows
    past its expert's end, and the shared expert's descriptor ends at row T.

    MX: a holds MXFP8 values (bf16: the pull's _mx_values), the weights are the Triton path's MXFP8 operands (E4M3
    bits, their E8M0 bits [rows, H / 32] at wg_scales / wu_scales), dequantized per 32-wide K step (the Triton
    grouped FFN's MXFP8 step), each step's scales loaded one step ahead; h is stored as the down GEMM's operand, its
    MXFP8 values along I (_mx_values of its bf16 values).

    KEEP_ROWS: also g, u and h of the real rows (a_ok) into the grouped rows [R, I] at kept_g_ptr, kept_u_ptr,
    kept_h_ptr, tile row m at row kept_rows[m]: the bits ``grouped_gate_up_swiglu`` returns, for the backward (MX:
    h before its quantization, as that function returns it)."""
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    # .cg (the row tile): another SM wrote the tile; read it from L2, never from a line this SM cached in an earlier
    # round (TMA reads bypass L1)
    if MX:
        # transposed, acc^T [N, M] = w @ a^T (the same sums of the same products as a @ w^T): the dequantized weights
        # are the MMA's register operand, never stored to shared memory, so the MMAs run while the next block is
        # dequantized
        acc1t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc2t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        scale_off = (w_row + offs_n).to(tl.int64) * (H // 32)
        sg_rows, su_rows = wg_scales + scale_off, wu_scales + scale_off
        sg_next = _scale_bits(sg_rows, 0, n_ok, H)
        su_next = _scale_bits(su_rows, 0, n_ok, H)
        for k0 in range(0, H, 32):  # software-pipelined by the launch's num_stages
            at = tl.trans(_operand_tile(a_src, a_row, k0, a_ok, H, BLOCK_M, 32, TMA, ".cg"))
            sg = sg_next
            sg_next = _scale_bits(sg_rows, k0 + 32, n_ok, H)
            acc1t = _dot(_mx_weight_tile(wg_src, w_row + n0, k0, n_ok, H, sg, BLOCK_N, TMA), at, acc1t, DOT_F32)
            su = su_next
            su_next = _scale_bits(su_rows, k0 + 32, n_ok, H)
            acc2t = _dot(_mx_weight_tile(wu_src, w_row + n0, k0, n_ok, H, su, BLOCK_N, TMA), at, acc2t, DOT_F32)
        gt, ut, ht = _swiglu_out(acc1t, acc2t, limit, HAS_LIMIT)
        if KEEP_ROWS:  # h as the SwiGLU gave it, before its quantization (the Triton path keeps that h too)
            kept = kept_rows.to(tl.int64)[None, :] * I + offs_n[:, None]
            kept_ok = n_ok[:, None] & a_ok[None, :]
            tl.store(kept_g_ptr + kept, gt, mask=kept_ok)
            tl.store(kept_u_ptr + kept, ut, mask=kept_ok)
            tl.store(kept_h_ptr + kept, ht, mask=kept_ok)
        # BLOCK_N and I are multiples of 32: the item's blocks along I are whole
        h = _mx_values(tl.trans(ht), BLOCK_M, BLOCK_N)
    else:
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):  # software-pipelined by the launch's num_stages
            a = _operand_tile(a_src, a_row, k0, a_ok, H, BLOCK_M, BLOCK_K, TMA, ".cg")
            wg = _operand_tile(wg_src, w_row + n0, k0, n_ok, H, BLOCK_N, BLOCK_K, TMA, "")
            acc1 = _dot(a, tl.trans(wg), acc1, DOT_F32)
            wu = _operand_tile(wu_src, w_row + n0, k0, n_ok, H, BLOCK_N, BLOCK_K, TMA, "")
            acc2 = _dot(a, tl.trans(wu), acc2, DOT_F32)
        g, u, h = _swiglu_out(acc1, acc2, limit, HAS_LIMIT)
        if KEEP_ROWS:
            kept = kept_rows.to(tl.int64)[:, None] * I + offs_n[None, :]
            kept_ok = a_ok[:, None] & n_ok[None, :]
            tl.store(kept_g_ptr + kept, g, mask=kept_ok)
            tl.store(kept_u_ptr + kept, u, mask=kept_ok)
            tl.store(kept_h_ptr + kept, h, mask=kept_ok)
    tl.store(h_ptr + offs_m[:, None] * I + offs_n[None, :], h, mask=n_ok[None, :])


@triton.jit
def _down_block(h_src, h_row, wd_src, w_row, dst_ptrs, ok, n0, H, I, wd_scales, MX: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                TMA: tl.constexpr):
    """y[:, n0:n0 + BLOCK_N] = h @ w_down[n0:n0 + BLOCK_N].T for h = rows [h_row, h_row + M) of h_src [rows, I] and
    w_down = rows [w_row, w_row + H) of wd_src [rows, I] (_operand_tile: pointers or TMA descriptors); real row r's
    columns stored at dst_ptrs[r] (its output row). TMA: a block's columns past H read the next expert's rows (or
    zeros); the store masks them. MX: h holds MXFP8 values along I (bf16), w_down is the Triton path's MXFP8 operand
    (E8M0 bits [rows, I / 32] at wd_scales), dequantized per 32-wide K step, its scales loaded one step ahead."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    every_row = tl.full((BLOCK_M,), 1, tl.int1)
    # .cg (h): other SMs wrote h, and a ring slot's h is rewritten every round
    if MX:  # transposed, as in _gate_up_block: the dequantized weights are the MMA's register operand
        acct = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        scale_rows = wd_scales + (w_row + offs_n).to(tl.int64) * (I // 32)
        s_next = _scale_bits(scale_rows, 0, n_ok, I)
        for k0 in range(0, I, 32):  # software-pipelined by the launch's num_stages
            at = tl.trans(_operand_tile(h_src, h_row, k0, every_row, I, BLOCK_M, 32, TMA, ".cg"))
            s = s_next
            s_next = _scale_bits(scale_rows, k0 + 32, n_ok, I)
            acct = _dot(_mx_weight_tile(wd_src, w_row + n0, k0, n_ok, I, s, BLOCK_N, TMA), at, acct, DOT_F32)
        y = tl.trans(_bf16_rne(acct))
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):  # software-pipelined by the launch's num_stages
            a = _operand_tile(h_src, h_row, k0, every_row, I, BLOCK_M, BLOCK_K, TMA, ".cg")
            b = _operand_tile(wd_src, w_row + n0, k0, n_ok, I, BLOCK_N, BLOCK_K, TMA, "")
            acc = _dot(a, tl.trans(b), acc, DOT_F32)
        y = _bf16_rne(acc)
    tl.store(dst_ptrs[:, None] + offs_n[None, :], y, mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _first_tile(worker, workers, tile_lo):
    """The first tile >= tile_lo that ``worker`` (of ``workers``, dealt round-robin) owns."""
    return tile_lo + ((worker - tile_lo % workers) + workers) % workers


@triton.jit
def _comm_program(c, rank, ring_ptr, ready_ptr, consumed_ptr, x_table, x_ready_table, group_end_ptr,
                  tile_end_ptr, row_slot_ptr, pulled_ptr, err_ptr, trace_ptr, epoch, stall_rank, timeout_us, tile_lo,
                  tile_hi, P, L, N, K, H, Q, COMM, PHASE: tl.constexpr, MX: tl.constexpr, KEEP_PULLED: tl.constexpr,
                  LOG_L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, TRACE: tl.constexpr):
    """Publishes x_ready, then pulls the routed tiles i in [tile_lo, tile_hi) dealt to it (module docstring;
    KEEP_PULLED: _pull_tile's)."""
    SERIAL: tl.constexpr = PHASE != 0
    start = _clock(TRACE, SERIAL)
    wait_ns = tl.full((), 0, tl.int64)
    pull_ns = tl.full((), 0, tl.int64)
    pulled = tl.full((), 0, tl.int32)
    alive = rank != stall_rank  # the stalled rank (a test hook) publishes nothing
    if PHASE == 0 or PHASE == 1:
        if alive & (c == 0):
            tl.atomic_xchg(tl.load(x_ready_table + rank).to(tl.pointer_type(tl.int64)), epoch.to(tl.int64),
                           sem="release", scope="sys")
    if PHASE == 0 or PHASE == 2:
        src = 0
        while alive & (src < P):
            src_ready = tl.load(x_ready_table + src).to(tl.pointer_type(tl.int64))
            # at least: on real EP a source may already have published its next call (its rows that this launch
            # pulls are still there: it rewrites them only once every one of them was pushed back)
            alive = _wait(src_ready, epoch.to(tl.int64), err_ptr, WAIT_X_READY, rank, src, timeout_us, SERIAL, True)
            src += 1
        if TRACE:
            wait_ns = _clock(TRACE, SERIAL) - start
        tile_lo = tl.maximum(tile_lo, 0)
        end = tl.minimum(tl.load(tile_end_ptr + L - 1), tile_hi)
        i = _first_tile(c, COMM, tile_lo)
        while alive & (i < end):
            q = i % Q
            n = i // Q
            t0 = _clock(TRACE, SERIAL)
            if n > 0:
                alive = _wait(consumed_ptr + q, _stamp(epoch, n - 1), err_ptr, WAIT_RING_FREE, rank, i, timeout_us,
                              SERIAL)
            t1 = _clock(TRACE, SERIAL)
            if alive:
                _e, rows, ok = _tile_rows(i, group_end_ptr, tile_end_ptr, L, LOG_L, BLOCK_M)
                slot = q.to(tl.int64) * BLOCK_M
                _pull_tile(ring_ptr + slot * H, x_table, row_slot_ptr, rows, ok, pulled_ptr, N, K, H, MX,
                           KEEP_PULLED, BLOCK_M, BLOCK_H)
                tl.debug_barrier()  # every thread's rows stored before the release
                tl.atomic_xchg(ready_ptr + q, _stamp(epoch, n), sem="release", scope="sys")
            if TRACE:
                wait_ns += t1 - t0
                pull_ns += _clock(TRACE, SERIAL) - t1
                pulled += alive.to(tl.int32)
            i += COMM
    _store_trace(trace_ptr, start, wait_ns, pull_ns, 0, pulled, 0, 0, TRACE, SERIAL)


@triton.jit
def _item(j, G, LAG, NB_I, NB_H, NB_IS, SG):
    """Item j -> (an A item?, its tile u, its column block): step s holds the A items of group s's tiles
    [s·G, s·G + G), column block major, then the B items of group s - LAG's (a tile < 0 before step LAG); groups
    below SG are the shared expert's (NB_IS column blocks of gate/up per tile, the routed ones' NB_I)."""
    shared_items = SG * G * (NB_IS + NB_H)
    in_shared = j < shared_items
    per_step = G * (tl.where(in_shared, NB_IS, NB_I) + NB_H)
    since = tl.where(in_shared, j, j - shared_items)
    step = tl.where(in_shared, 0, SG) + since // per_step
    r = since % per_step
    per_step_a = per_step - G * NB_H
    is_a = r < per_step_a
    r_b = r - per_step_a
    tile = tl.where(is_a, step * G + r % G, (step - LAG) * G + r_b % G)
    block = tl.where(is_a, r // G, r_b // G)
    return is_a, tile, block


@triton.jit
def _gate_up_item(f, stamp, a_src, a_row, a_ok, wg_src, wu_src, w_row, h_ptr, n0, h_ready_ptr, gate_up_done_ptr, H,
                  I, NB_I, limit, wg_scales, wu_scales, kept_g_ptr, kept_u_ptr, kept_h_ptr, kept_rows,
                  HAS_LIMIT: tl.constexpr, MX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, TMA: tl.constexpr, KEEP_ROWS: tl.constexpr):
    """An A item of the tile of flag slot f (its wait done): h columns [n0, n0 + BLOCK_N) (KEEP_ROWS: and the kept
    g, u, h rows' columns, _gate_up_block), then the count; the tile's last A item publishes h_ready[f] = stamp."""
    _gate_up_block(a_src, a_row, a_ok, wg_src, wu_src, w_row, h_ptr, n0, H, I, limit, wg_scales, wu_scales,
                   kept_g_ptr, kept_u_ptr, kept_h_ptr, kept_rows, HAS_LIMIT, MX, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32,
                   TMA, KEEP_ROWS)
    tl.debug_barrier()  # every thread's h columns stored, and its reads of the row tile done, before the count
    if tl.atomic_add(gate_up_done_ptr + f, 1, sem="acq_rel", scope="sys") == NB_I - 1:
        # the tile's last A item: every other's h columns are ordered before this (acq_rel); rearm the count for the
        # slot's next round (ordered before it by the release below)
        tl.atomic_xchg(gate_up_done_ptr + f, 0, sem="relaxed", scope="sys")
        tl.atomic_xchg(h_ready_ptr + f, stamp, sem="release", scope="sys")


@triton.jit
def _down_item(f, stamp, h_src, h_row, wd_src, w_row, dst_ptrs, arrival_ptrs, real, n0, consumed_ptr, down_done_ptr,
               H, I, NB_H, wd_scales, MX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, TMA: tl.constexpr):
    """A B item of the tile of flag slot f (its wait done): output columns [n0, n0 + BLOCK_N) of its real rows,
    then the count; the tile's last B item stores consumed[f] = stamp and adds 1 at each real row's arrival
    counter."""
    _down_block(h_src, h_row, wd_src, w_row, dst_ptrs, real, n0, H, I, wd_scales, MX, BLOCK_M, BLOCK_N, BLOCK_K,
                DOT_F32, TMA)
    tl.debug_barrier()  # every thread's output stores and h reads done before the count
    if tl.atomic_add(down_done_ptr + f, 1, sem="acq_rel", scope="sys") == NB_H - 1:
        # the tile's last B item: every other's output stores and reads are ordered before this (acq_rel)
        tl.atomic_xchg(down_done_ptr + f, 0, sem="relaxed", scope="sys")
        tl.atomic_xchg(consumed_ptr + f, stamp, sem="release", scope="sys")
        tl.debug_barrier()  # the count's acquire before every thread's arrival increments
        tl.atomic_add(arrival_ptrs, 1, mask=real, sem="release", scope="sys")


@triton.jit
def _compute_program(rank, ring_ptr, h_ptr, ready_ptr, h_ready_ptr, consumed_ptr, gate_up_done_ptr, down_done_ptr,
                     next_item_ptr, programs_done_ptr, x_table, slots_table, arrivals_table, group_end_ptr,
                     tile_end_ptr, row_slot_ptr, wg_ptr, wu_ptr, wd_ptr, shared_h_ptr, shared_out_ptr, wsg_ptr, wsu_ptr,
                     wsd_ptr, err_ptr, wg_scale_ptr, wu_scale_ptr, wd_scale_ptr, kept_g_ptr, kept_u_ptr, kept_h_ptr,
                     trace_ptr, epoch, timeout_us, tile_lo, tile_hi, item_lo, item_hi, limit, shared_limit, L, T, N,
                     K, H, I, I_S, Q, COMPUTE, G, LAG, SG, PHASE: tl.constexpr, HAS_LIMIT: tl.constexpr,
                     SHARED: tl.constexpr, HAS_SHARED_LIMIT: tl.constexpr, MX: tl.constexpr, LOG_L: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                     TMA: tl.constexpr, KEEP_ROWS: tl.constexpr, TRACE: tl.constexpr):
    """Claims items until none is left (module docstring), running those of its launch's kind and window. MX: the
    routed experts' operands are MXFP8 (ring and h: bf16 MXFP8 values; weights: E4M3 bits with E8M0 bits at the
    *_scale_ptr), the shared expert's bf16. KEEP_ROWS: the routed A items also store g, u, h of their real rows into
    the grouped rows [R, I] at kept_*_ptr (the shared expert's items never do)."""
    SERIAL: tl.constexpr = PHASE != 0
    start = _clock(TRACE, SERIAL)
    # The GEMM operands as 2D row-major [rows, K] sources (_operand_tile): the rank's ring [Q·M, H] and h [Q·M, I],
    # its experts' weights [L·I, H] and [L·H, I], the shared expert's x [T, H], h [SG·G·M, I_S] and weights. TMA: a
    # tensor descriptor of each, made once per program (128 bytes of the launch's global scratch each).
    ring_src, h_src, wg_src, wu_src, wd_src = ring_ptr, h_ptr, wg_ptr, wu_ptr, wd_ptr
    x_src, shared_h_src, wsg_src, wsu_src, wsd_src = x_table, shared_h_ptr, wsg_ptr, wsu_ptr, wsd_ptr
    STEP_K: tl.constexpr = 32 if MX else BLOCK_K  # the routed GEMMs' K step (MXFP8: one scale block)
    if TMA:
        ring_src = _descriptor(ring_ptr, Q * BLOCK_M, H, BLOCK_M, STEP_K)
        h_src = _descriptor(h_ptr, Q * BLOCK_M, I, BLOCK_M, STEP_K)
        wg_src = _descriptor(wg_ptr, L * I, H, BLOCK_N, STEP_K)
        wu_src = _descriptor(wu_ptr, L * I, H, BLOCK_N, STEP_K)
        wd_src = _descriptor(wd_ptr, L * H, I, BLOCK_N, STEP_K)
        if SHARED:
            x_src = _descriptor(_own_rows(x_table, rank), T, H, BLOCK_M, BLOCK_K)
            shared_h_src = _descriptor(shared_h_ptr, SG * G * BLOCK_M, I_S, BLOCK_M, BLOCK_K)
            wsg_src = _descriptor(wsg_ptr, I_S, H, BLOCK_N, BLOCK_K)
            wsu_src = _descriptor(wsu_ptr, I_S, H, BLOCK_N, BLOCK_K)
            wsd_src = _descriptor(wsd_ptr, H, I_S, BLOCK_N, BLOCK_K)
    FENCE: tl.constexpr = TMA and not SERIAL
    NB_I = tl.cdiv(I, BLOCK_N)
    NB_H = tl.cdiv(H, BLOCK_N)
    NB_IS = tl.cdiv(I_S, BLOCK_N)
    first_routed = SG * G  # tile u of the item order: the shared expert's below first_routed, routed u - first_routed
    tiles = tl.load(tile_end_ptr + L - 1)
    end = tl.minimum(SG * G * (NB_IS + NB_H) + (tl.cdiv(tiles, G) + LAG) * G * (NB_I + NB_H), item_hi)
    tile_lo = tl.maximum(tile_lo, 0)
    tile_hi = tl.minimum(tile_hi, first_routed + tiles)
    alive = tl.full((), 1, tl.int1)
    wait_ns = tl.full((), 0, tl.int64)
    a_ns = tl.full((), 0, tl.int64)
    b_ns = tl.full((), 0, tl.int64)
    a_items = tl.full((), 0, tl.int32)
    b_items = tl.full((), 0, tl.int32)
    j = item_lo + tl.atomic_add(next_item_ptr, 1, sem="relaxed", scope="gpu")
    while alive & (j < end):
        is_a, u, block = _item(j, G, LAG, NB_I, NB_H, NB_IS, SG)
        # a tile of this launch's window (every tile but in serialized mode); the shared groups' padding tiles: none
        mine = (u >= tile_lo) & (u < tile_hi) & ((u >= first_routed) | (u * BLOCK_M < T))
        i = u - first_routed  # the routed tile
        q = i % Q
        stamp = _stamp(epoch, tl.maximum(i, 0) // Q)  # a shared tile's: round 0
        n0 = block * BLOCK_N
        t0 = _clock(TRACE, SERIAL)
        waited = wait_ns
        if PHASE != 4:
            if is_a & mine & (u >= first_routed):
                alive = _wait(ready_ptr + q, stamp, err_ptr, WAIT_RING_READY, rank, i, timeout_us, SERIAL)
                if TRACE:
                    wait_ns += _clock(TRACE, SERIAL) - t0
                if alive:
                    _async_proxy_fence(FENCE)
                    e, rows, real = _tile_rows(i, group_end_ptr, tile_end_ptr, L, LOG_L, BLOCK_M)
                    _gate_up_item(q, stamp, ring_src, q * BLOCK_M, real, wg_src, wu_src, e * I,
                                  h_ptr + q.to(tl.int64) * BLOCK_M * I, n0, h_ready_ptr, gate_up_done_ptr, H, I, NB_I,
                                  limit, wg_scale_ptr, wu_scale_ptr, kept_g_ptr, kept_u_ptr, kept_h_ptr, rows,
                                  HAS_LIMIT, MX, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, TMA, KEEP_ROWS)
            if SHARED:
                if is_a & mine & (u < first_routed):  # this rank's own tokens: no wait (written before the launch)
                    rows = u * BLOCK_M + tl.arange(0, BLOCK_M)
                    a_src = x_src
                    if not TMA:  # the pointer, loaded here: a register less across the item loop
                        a_src = _own_rows(x_table, rank)
                    _gate_up_item(Q + u, stamp, a_src, u * BLOCK_M, rows < T, wsg_src, wsu_src, 0,
                                  shared_h_ptr + u.to(tl.int64) * BLOCK_M * I_S, n0, h_ready_ptr, gate_up_done_ptr, H,
                                  I_S, NB_IS, shared_limit, err_ptr, err_ptr, kept_g_ptr, kept_u_ptr, kept_h_ptr,
                                  rows, HAS_SHARED_LIMIT, False, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, TMA, False)
        if PHASE != 3:
            if (is_a == 0) & mine & (u >= first_routed):
                alive = _wait(h_ready_ptr + q, stamp, err_ptr, WAIT_H_READY, rank, i, timeout_us, SERIAL)
                if TRACE:
                    wait_ns += _clock(TRACE, SERIAL) - t0
                if alive:
                    _async_proxy_fence(FENCE)
                    e, rows, real = _tile_rows(i, group_end_ptr, tile_end_ptr, L, LOG_L, BLOCK_M)
                    s = tl.load(row_slot_ptr + rows, mask=real, other=0)  # gathered slot p·N + t·K + j
                    src = s // N
                    slot_ptrs = tl.load(slots_table + src, mask=real, other=0).to(tl.pointer_type(tl.bfloat16))
                    arrivals = tl.load(arrivals_table + src, mask=real, other=0).to(tl.pointer_type(tl.int32))
                    _down_item(q, stamp, h_src, q * BLOCK_M, wd_src, e * H, slot_ptrs + (s % N).to(tl.int64) * H,
                               arrivals + (s % N) // K, real, n0, consumed_ptr, down_done_ptr, H, I, NB_H,
                               wd_scale_ptr, MX, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, TMA)
            if SHARED:
                if (is_a == 0) & mine & (u < first_routed):
                    alive = _wait(h_ready_ptr + Q + u, stamp, err_ptr, WAIT_SHARED_H_READY, rank, u, timeout_us,
                                  SERIAL)
                    if TRACE:
                        wait_ns += _clock(TRACE, SERIAL) - t0
                    if alive:
                        _async_proxy_fence(FENCE)
                        rows = u * BLOCK_M + tl.arange(0, BLOCK_M)
                        arrivals = tl.load(arrivals_table + rank).to(tl.pointer_type(tl.int32))
                        _down_item(Q + u, stamp, shared_h_src, u * BLOCK_M, wsd_src, 0,
                                   shared_out_ptr + rows.to(tl.int64) * H, arrivals + rows, rows < T, n0,
                                   consumed_ptr, down_done_ptr, H, I_S, NB_H, err_ptr, False, BLOCK_M, BLOCK_N,
                                   BLOCK_K, DOT_F32, TMA)
        if TRACE:  # the item's time past its wait
            spent = _clock(TRACE, SERIAL) - t0 - (wait_ns - waited)
            ran = mine & alive
            if PHASE != 4:
                a_ns += tl.where(ran & is_a, spent, 0)
                a_items += (ran & is_a).to(tl.int32)
            if PHASE != 3:
                b_ns += tl.where(ran & (is_a == 0), spent, 0)
                b_items += (ran & (is_a == 0)).to(tl.int32)
        j = item_lo + tl.atomic_add(next_item_ptr, 1, sem="relaxed", scope="gpu")
    _store_trace(trace_ptr, start, wait_ns, a_ns, b_ns, a_items, b_items, 1, TRACE, SERIAL)
    # this program claims nothing more; the last of the rank's programs to get here rearms the counter for the next
    # launch (stream order puts that launch after every claim of this one; acq_rel: the others' claims come before)
    if tl.atomic_add(programs_done_ptr, 1, sem="acq_rel", scope="gpu") == COMPUTE - 1:
        tl.atomic_xchg(next_item_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(programs_done_ptr, 0, sem="relaxed", scope="gpu")


# not specialized: the integers that vary per call or per configuration (one compiled kernel per H, I, I_S and tiles)
@triton.jit(do_not_specialize=["first_rank", "epoch", "stall_rank", "timeout_us", "tile_lo", "tile_hi", "item_lo",
                               "item_hi", "P", "L", "T", "K", "Q", "COMM", "COMPUTE", "G", "LAG", "SG"])
def _megakernel(
    # local to the hosted ranks: ring [V, Q, M, H] bf16, h [V, Q, M, I] bf16; int64 [V, Q] ready
    ring_ptr, h_ptr, ready_ptr,
    # per flag slot f (the ring's Q slots, then the shared expert's SG·G tiles; F = Q + SG·G): int64 [V, F] h_ready,
    # consumed; int32 [V, F] gate_up_done, down_done; int32 [V]: next_item, programs_done
    h_ready_ptr, consumed_ptr, gate_up_done_ptr, down_done_ptr, next_item_ptr, programs_done_ptr,
    # int64 [P] addresses of every rank's symmetric buffers
    x_table, slots_table, arrivals_table, x_ready_table,
    # the hosted ranks' schedules: group_end, tile_end int32 [V, L], row_slot int32 [V, P·N]
    group_end_ptr, tile_end_ptr, row_slot_ptr,
    # the hosted ranks' expert weights: w_gate, w_up [V·L, I, H], w_down [V·L, H, I] bf16
    wg_ptr, wu_ptr, wd_ptr,
    # the shared expert (SHARED): its h [V, SG·G·M, I_S] and output [V, T, H] bf16, its weights w_gate, w_up
    # [I_S, H], w_down [H, I_S] bf16
    shared_h_ptr, shared_out_ptr, wsg_ptr, wsu_ptr, wsd_ptr,
    err_ptr,
    # MX: E8M0 bits (uint8) of the routed weights: w_gate, w_up [V·L, I, H / 32], w_down [V·L, H, I / 32] (the
    # weights above then hold E4M3 bits, uint8; ring and h the MXFP8 values, bf16); else never read
    wg_scale_ptr, wu_scale_ptr, wd_scale_ptr,
    # KEEP_ROWS: the hosted ranks' kept g, u, h rows [V, R, I] bf16 (R = P·N, row r: schedule row r); else never read
    kept_g_ptr, kept_u_ptr, kept_h_ptr,
    # TRACE: int64 [programs, 8], each program's row (TRACE_FIELDS); else never written
    trace_ptr,
    first_rank, epoch, stall_rank, timeout_us, tile_lo, tile_hi, item_lo, item_hi, limit, shared_limit,
    P, L, T, K, H, I, I_S, Q, COMM, COMPUTE, G, LAG, SG,
    PHASE: tl.constexpr, HAS_LIMIT: tl.constexpr, SHARED: tl.constexpr, HAS_SHARED_LIMIT: tl.constexpr,
    MX: tl.constexpr, LOG_L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr, DOT_F32: tl.constexpr, TMA: tl.constexpr, KEEP_ROWS: tl.constexpr, TRACE: tl.constexpr,
):
    pid = tl.program_id(0)
    trace_ptr += pid * 8
    local = pid // (COMM + COMPUTE)  # this program's rank, within the launch
    role = pid % (COMM + COMPUTE)
    rank = first_rank + local
    N = T * K
    local64 = local.to(tl.int64)
    F = Q + SG * G
    ring_ptr += local64 * Q * BLOCK_M * H
    ready_ptr += local64 * Q
    consumed_ptr += local64 * F
    group_end_ptr += local * L
    tile_end_ptr += local * L
    row_slot_ptr += local64 * P * N
    first_tile = SG * G  # the item order's tiles: the shared expert's first, then the routed (tile i: first_tile + i)
    if role < COMM:
        if PHASE <= 2:
            # (no pulled rows kept: the pointer is never read)
            _comm_program(role, rank, ring_ptr, ready_ptr, consumed_ptr, x_table, x_ready_table, group_end_ptr,
                          tile_end_ptr, row_slot_ptr, ring_ptr, err_ptr, trace_ptr, epoch, stall_rank, timeout_us,
                          tile_lo - first_tile, tile_hi - first_tile, P, L, N, K, H, Q, COMM, PHASE, MX, False, LOG_L,
                          BLOCK_M, BLOCK_H, TRACE)
    else:
        if PHASE == 0 or PHASE >= 3:
            w_off = local64 * L * I * H  # the hosted rank's first expert (MX: its E4M3 bits; its E8M0 bits below)
            ws_off = local64 * L * I * H // 32
            kept_off = local64 * P * N * I
            _compute_program(rank, ring_ptr, h_ptr + local64 * Q * BLOCK_M * I, ready_ptr, h_ready_ptr + local64 * F,
                             consumed_ptr, gate_up_done_ptr + local64 * F, down_done_ptr + local64 * F,
                             next_item_ptr + local, programs_done_ptr + local, x_table, slots_table, arrivals_table,
                             group_end_ptr, tile_end_ptr, row_slot_ptr, wg_ptr + w_off, wu_ptr + w_off, wd_ptr + w_off,
                             shared_h_ptr + local64 * first_tile * BLOCK_M * I_S, shared_out_ptr + local64 * T * H,
                             wsg_ptr, wsu_ptr, wsd_ptr, err_ptr, wg_scale_ptr + ws_off, wu_scale_ptr + ws_off,
                             wd_scale_ptr + ws_off, kept_g_ptr + kept_off, kept_u_ptr + kept_off,
                             kept_h_ptr + kept_off, trace_ptr, epoch, timeout_us, tile_lo, tile_hi,
                             item_lo, item_hi, limit, shared_limit, L, T, N, K, H, I, I_S, Q, COMPUTE, G, LAG, SG,
                             PHASE, HAS_LIMIT, SHARED, HAS_SHARED_LIMIT, MX, LOG_L, BLOCK_M, BLOCK_N, BLOCK_K,
                             DOT_F32, TMA, KEEP_ROWS, TRACE)


# debug: the device assertions below are compiled in
@triton.jit(debug=True, do_not_specialize=["first_rank", "arrivals_expected", "timeout_us"])
def _finish_kernel(slots_table, arrivals_table, w_ptr, shared_ptr, scale_ptr, out_ptr, err_ptr, first_rank,
                   arrivals_expected, timeout_us, T, H, K: tl.constexpr, HAS_SHARED: tl.constexpr,
                   HAS_SCALE: tl.constexpr, SERIAL: tl.constexpr, TRAP: tl.constexpr, BLOCK_H: tl.constexpr):
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
        tl.device_assert(code != WAIT_SHARED_H_READY,
                         "mok megakernel: timed out waiting for the shared expert's gate/up items")
    slots_ptr = tl.load(slots_table + rank).to(tl.pointer_type(tl.bfloat16))
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    w_ptr += local.to(tl.int64) * T * K
    acc = _slot_term(slots_ptr, w_ptr, slots_ptr, t, 0, cols, ok, H, K, True, False)
    for j in tl.static_range(1, K):  # ascending slot order, fp32 adds (no FMA: enable_fp_fusion=False)
        acc = acc + _slot_term(slots_ptr, w_ptr, slots_ptr, t, j, cols, ok, H, K, True, False)
    row = (local.to(tl.int64) * T + t) * H
    if HAS_SHARED:
        shared = tl.load(shared_ptr + row + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_SCALE:  # a per-token scale of the shared output (Qwen3.5's gate), rounded to fp32 before the add
            shared = shared * tl.load(scale_ptr + local * T + t)
        acc = acc + shared
    tl.store(out_ptr + row + cols, _round_to(acc, out_ptr), mask=ok)


# ----------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class SharedFFN:
    """The shared expert, run inside the launch on each hosted rank's own tokens: bf16 contiguous w_gate [I_S, H],
    w_up [I_S, H], w_down [H, I_S], its own SwiGLU clamp."""

    w_gate_IH: torch.Tensor
    w_up_IH: torch.Tensor
    w_down_HI: torch.Tensor
    swiglu_limit: float | None = None

    @property
    def dim(self) -> int:
        return self.w_gate_IH.shape[0]


class RingBuffers:
    """The sizes every launch's buffers derive from their ring ``ring_VQMH`` [V, Q, M, H] (forward and dgrad)."""

    ring_VQMH: torch.Tensor

    @property
    def ring_tiles(self) -> int:
        return self.ring_VQMH.shape[1]

    @property
    def block_m(self) -> int:
        return self.ring_VQMH.shape[2]


@dataclass
class MegakernelBuffers(RingBuffers):
    """What a launch reads and writes besides the schedule and the weights (module docstring; F = Q + SG·G flag
    slots: the ring's, then the shared expert's tiles')."""

    ring_VQMH: torch.Tensor
    h_VQMI: torch.Tensor
    ready_VQ: torch.Tensor
    h_ready_VF: torch.Tensor
    consumed_VF: torch.Tensor
    gate_up_done_VF: torch.Tensor
    down_done_VF: torch.Tensor
    next_item_V: torch.Tensor
    programs_done_V: torch.Tensor
    tables: dict[str, torch.Tensor]
    """"x_TH", "slots_NH", "arrivals_T", "x_ready": int64 [P] addresses of every rank's buffer."""
    errors: torch.Tensor
    """int64 [6]: code, waiting rank, index, seen, expected (0: no error)."""
    shared_h_VRI: torch.Tensor | None = None
    """The shared expert's h rows (R = SG·G·M: its tiles, the last groups' padded) [V, R, I_S] bf16; None: no shared
    expert in the launch."""
    shared_out_VTH: torch.Tensor | None = None
    """The shared expert's output rows [V, T, H] bf16 (the finish adds them)."""

    @property
    def flags(self) -> list[torch.Tensor]:
        """The launch's own flags and counters (the symmetric ones are the caller's)."""
        return [self.ready_VQ, self.h_ready_VF, self.consumed_VF, self.gate_up_done_VF, self.down_done_VF,
                self.next_item_V, self.programs_done_V]


@dataclass(frozen=True)
class KeptRows:
    """Where a training launch (bf16 or MXFP8) keeps each routed row's g, u and h for the backward: [V, R, I] bf16
    contiguous (R = P·N, row r of rank v: its schedule's row r; rows past its end are not written), the bits the
    Triton grouped FFN's ``grouped_gate_up_swiglu`` returns (MXFP8: h before its quantization). Per call (the backward
    holds them), 3·V·R·I·2 bytes."""

    gate_VRI: torch.Tensor
    up_VRI: torch.Tensor
    h_VRI: torch.Tensor

    def __iter__(self):
        return iter((self.gate_VRI, self.up_VRI, self.h_VRI))


def ring_buffers(ranks: int, ring_tiles: int, block_m: int, dim_h: int, dim_i: int, device) -> dict[str, torch.Tensor]:
    """MegakernelBuffers' ring and h for ``ranks`` hosted ranks, zeroed, bf16 in either precision (an MXFP8 launch's
    hold the rows' MXFP8 values)."""
    rows = (ranks, ring_tiles, block_m)
    return dict(ring_VQMH=torch.zeros(*rows, dim_h, dtype=torch.bfloat16, device=device),
                h_VQMI=torch.zeros(*rows, dim_i, dtype=torch.bfloat16, device=device))


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
    shared_groups: int = 0
    """SG: the item order's groups of shared-expert tiles (0: no shared expert in the launch)."""
    gemm: str = "ptr"
    """How the items' GEMMs read their operands (GEMM_LOADS): "ptr" masked pointer loads, "tma" TMA loads."""

    @property
    def programs(self) -> int:
        return self.hosted_ranks * (self.comm_programs + self.compute_programs)

    def first_item(self, step: int, dim_h: int, dim_i: int, shared_dim: int) -> int:
        """j of the first item of a step (``_item``'s order: SG steps of G·(NB_IS + NB_H) items, then steps of
        G·(NB_I + NB_H))."""
        blocks = lambda d: triton.cdiv(d, self.block_n)  # noqa: E731
        shared_steps = min(step, self.shared_groups)
        return self.group_tiles * (shared_steps * (blocks(shared_dim) + blocks(dim_h))
                                   + (step - shared_steps) * (blocks(dim_i) + blocks(dim_h)))

    @property
    def arrivals_per_call(self) -> int:
        """What a token's arrival counter grows by per call: its K expert rows, and its shared expert row."""
        return self.top_k + (self.shared_groups > 0)


def shared_groups(num_tokens: int, block_m: int, group_tiles: int) -> int:
    """SG for a shared expert in the launch: its cdiv(T, M) tiles in groups of G."""
    return triton.cdiv(triton.cdiv(num_tokens, block_m), group_tiles)


def read_error(errors: torch.Tensor) -> str | None:
    """The recorded wait that ran out, in words (None: none). NOTE: host sync (reads the error buffer)."""
    code, rank, index, seen, expected, _ = errors.tolist()
    if code == 0:
        return None
    what = WAIT_NAMES.get(code, "unknown wait code {code}").format(rank=rank, index=index, code=code)
    return f"mok megakernel: timed out: {what} (flag held {seen}, expected {expected})"


def _weight_bits(weights) -> tuple[tuple, tuple | None]:
    """(the routed weights as the kernel reads them, their E8M0 bits or None): bf16 tensors as they are; MXTensors
    (MXFP8 along K, MMA order) as their E4M3 bits and E8M0 bits, uint8."""
    if not isinstance(weights[0], MXTensor):
        return tuple(weights), None
    return tuple(w.data.view(torch.uint8) for w in weights), tuple(w.scale.view(torch.uint8) for w in weights)


def _megakernel_args(bufs, schedule, weights, shared: SharedFFN | None, kept: KeptRows | None, trace,
                     shape: LaunchShape, epoch, stall_rank, timeout_us, tiles, items, limit):
    group_end_VL, tile_end_VL, row_slot_VR = schedule
    weights, weight_scales = _weight_bits(weights)
    w_gate_XIH, w_up_XIH, w_down_XHI = weights
    _, dim_i, dim_h = w_gate_XIH.shape
    scale_ptrs = (bufs.errors,) * 3 if weight_scales is None else weight_scales  # bf16: pointers never read
    kept_ptrs = (bufs.h_VQMI,) * 3 if kept is None else tuple(kept)  # no kept rows: pointers never read
    t = bufs.tables
    if shared is None:  # pointers the kernel does not read, and the routed I (no second specialization)
        shared_ptrs, shared_dim, shared_limit = (bufs.h_VQMI,) * 2 + weights, dim_i, 0.0
    else:
        shared_ptrs = (bufs.shared_h_VRI, bufs.shared_out_VTH, shared.w_gate_IH, shared.w_up_IH, shared.w_down_HI)
        shared_dim = shared.dim
        shared_limit = float(shared.swiglu_limit) if shared.swiglu_limit is not None else 0.0
    return (bufs.ring_VQMH, bufs.h_VQMI, *bufs.flags, t["x_TH"], t["slots_NH"], t["arrivals_T"], t["x_ready"],
            group_end_VL, tile_end_VL, row_slot_VR, w_gate_XIH, w_up_XIH, w_down_XHI, *shared_ptrs, bufs.errors,
            *scale_ptrs, *kept_ptrs, bufs.errors if trace is None else trace, shape.first_rank, epoch, stall_rank,
            timeout_us, *tiles, *items, limit, shared_limit, shape.ep_degree, shape.num_local, shape.num_tokens,
            shape.top_k, dim_h, dim_i, shared_dim, bufs.ring_tiles, shape.comm_programs, shape.compute_programs,
            shape.group_tiles, shape.lag, shape.shared_groups)


@dataclass(frozen=True)
class KernelVariant:
    """What one compiled megakernel is specialized on (besides the phase)."""

    dim_h: int
    dim_i: int
    shared_dim: int
    """I_S of the shared expert in the launch; 0: none."""
    num_local: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    has_limit: bool
    has_shared_limit: bool = False
    gemm: str = "ptr"
    mx: bool = False
    """The routed experts' operands in MXFP8 (the shared expert's stay bf16)."""
    keep_rows: bool = False
    """The routed A items also store g, u, h into the call's KeptRows (training)."""
    trace: bool = False
    """Every program records its timings (module docstring, Trace)."""

    def constexprs(self, phase: int) -> dict:
        return dict(PHASE=phase, HAS_LIMIT=self.has_limit, SHARED=self.shared_dim > 0,
                    HAS_SHARED_LIMIT=self.has_shared_limit, MX=self.mx, LOG_L=self.num_local.bit_length(),
                    BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=BLOCK_K,
                    BLOCK_H=min(256, triton.next_power_of_2(self.dim_h)), DOT_F32=_DOT_F32, TMA=self.gemm == "tma",
                    KEEP_ROWS=self.keep_rows, TRACE=self.trace, num_warps=self.num_warps,
                    num_stages=self.num_stages)


def _variant(bufs: MegakernelBuffers, weights, shared: SharedFFN | None, kept: KeptRows | None, traced: bool,
             shape: LaunchShape, swiglu_limit: float | None) -> KernelVariant:
    dim_i, dim_h = _weight_bits(weights)[0][0].shape[1:]
    return KernelVariant(dim_h, dim_i, 0 if shared is None else shared.dim, shape.num_local, bufs.block_m,
                         shape.block_n, shape.num_warps, shape.num_stages, swiglu_limit is not None,
                         shared is not None and shared.swiglu_limit is not None, shape.gemm,
                         isinstance(weights[0], MXTensor), kept is not None, traced)


def compile_megakernel(variant: KernelVariant):
    """The concurrent launch's kernel compiled for a variant (its other integers are not specialized), launching
    nothing: the current driver's target (``benchmarks/tools/sass.py`` compiles it for sm_90 without a GPU)."""
    weights = torch.uint8 if variant.mx else torch.bfloat16  # the routed weights: E4M3 bits or bf16
    ptrs = [torch.bfloat16] * 2 + [torch.int64] * 3 + [torch.int32] * 4 + [torch.int64] * 4 + [torch.int32] * 3 + [
        weights] * 3 + [torch.bfloat16] * 5 + [torch.int64] + [torch.uint8 if variant.mx else torch.int64] * 3 + [
        torch.bfloat16] * 3 + [torch.int64]
    # (pointer arguments as their dtypes: Triton's warmup takes those)
    # first_rank ... item_hi, limit, shared_limit, P ... K, H, I, I_S, Q ... SG
    ints = [2] * 8 + [0.0] * 2 + [2] * 4 + [variant.dim_h, variant.dim_i, variant.shared_dim or variant.dim_i] + [
        2] * 6
    return _megakernel.warmup(*ptrs, *ints, grid=(1,), **variant.constexprs(PHASE_ALL))


def programs_per_sm(n_regs: int, shared_bytes: int, num_warps: int, props: dict) -> int:
    """Programs of a compiled kernel that fit on one SM at once: by registers (allocated per warp in units of
    256), shared memory (1 KB reserved per program; the SM has the per-program opt-in maximum + 1 KB), threads
    (2048) and blocks (32)."""
    regs_per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = props["max_num_regs"] // (regs_per_warp * num_warps)
    by_shared = (props["max_shared_mem"] + 1024) // (shared_bytes + 1024)
    return max(0, min(by_regs, by_shared, 2048 // (32 * num_warps), 32))


def resident_programs(compiled, device_index: int) -> int:
    """How many programs of a compiled persistent kernel the device runs at once: its programs per SM times the
    SMs (the forward's and the dgrad launch's)."""
    compiled._init_handles()
    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    per_sm = programs_per_sm(compiled.n_regs, compiled.metadata.shared, compiled.metadata.num_warps, props)
    return per_sm * props["multiprocessor_count"]


@functools.cache
def co_resident_programs(device_index: int, variant: KernelVariant) -> int:
    """How many programs of a concurrent launch of this variant the device runs at once."""
    return resident_programs(compile_megakernel(variant), device_index)


def megakernel_phase(bufs: MegakernelBuffers, schedule, weights, shape: LaunchShape, phase: int, *, epoch: int,
                     swiglu_limit: float | None, shared: SharedFFN | None = None, kept: KeptRows | None = None,
                     trace: torch.Tensor | None = None, stall_rank: int | None = None, timeout_ms: float = 10_000.0,
                     tiles: tuple[int, int] = (0, 2**31 - 1), items: tuple[int, int] = (0, 2**31 - 1)) -> None:
    """One launch of the grid in ``phase`` (PHASE_*): its communication programs pull the routed tiles, and its
    compute programs run the items in ``items`` (a half-open range of j) of the phase's kind, whose tiles of the item
    order (the shared expert's SG·G, then the routed) lie in ``tiles``. PHASE_ALL is the concurrent launch: refused
    when the device cannot hold every program at once. ``megakernel_launch`` makes the calls; tests call the
    serialized phases one by one. kept, trace: ``megakernel_launch``'s."""
    if (shared is not None) != (shape.shared_groups > 0):
        raise ValueError(f"megakernel_phase: a launch shaped for {shape.shared_groups} groups of shared-expert tiles "
                         f"{'needs' if shape.shared_groups else 'takes no'} shared expert weights")
    variant = _variant(bufs, weights, shared, kept, trace is not None, shape, swiglu_limit)
    w_gate = _weight_bits(weights)[0][0]
    if variant.gemm == "tma" and w_gate.is_cuda:
        _set_triton_allocator()  # the compute programs make their TMA descriptors in the launch's global scratch
    if phase == PHASE_ALL:
        max_programs = co_resident_programs(w_gate.device.index, variant)
        if shape.programs > max_programs:
            raise RuntimeError(
                f"mok megakernel: {shape.programs} programs ({shape.hosted_ranks} ranks x ({shape.comm_programs} "
                f"communication + {shape.compute_programs} compute)) exceed the {max_programs} this device runs "
                "at once, so its spin-waits could deadlock: use fewer programs per rank")
    args = _megakernel_args(bufs, schedule, weights, shared, kept, trace, shape, epoch,
                            -1 if stall_rank is None else stall_rank, int(timeout_ms * 1000), tiles, items,
                            float(swiglu_limit) if swiglu_limit is not None else 0.0)
    _megakernel[(shape.programs,)](*args, **variant.constexprs(phase))


def _check_precision(bufs: MegakernelBuffers, weights, shape: LaunchShape) -> None:
    """The routed weights are all bf16 tensors (a bf16 launch) or all the MXFP8 operands the Triton grouped FFN reads
    (an MXFP8 launch: ``grouped_ffn.weight_operand(w, "mxfp8", 2, name)``, blocked along K, MMA order)."""
    names = ("w_gate", "w_up", "w_down")
    mx = [isinstance(w, MXTensor) for w in weights]
    if any(mx) != all(mx):
        raise TypeError(f"megakernel_launch: the routed weights (w_gate, w_up, w_down as MXTensor: {mx}) must all be "
                        "MXTensors (MXFP8) or all bf16 tensors")
    if not all(mx):
        return
    for name, w in zip(names, weights):
        if w.dim != 2 or not w.mma_order or w.scale.shape != (*w.data.shape[:2], w.data.shape[2] // MX_BLOCK):
            raise ValueError(f"megakernel_launch: {name} must be MXFP8 blocked along K (dim 2) in MMA order, as "
                             f"grouped_ffn.weight_operand makes it; got dim {w.dim}, mma_order {w.mma_order}, data "
                             f"{tuple(w.data.shape)}, scale {tuple(w.scale.shape)}")
        if not (w.data.is_contiguous() and w.scale.is_contiguous()):
            raise ValueError(f"megakernel_launch: {name}'s MXFP8 data and scales must be contiguous")
    if shape.block_n % MX_BLOCK:
        raise ValueError(f"megakernel_launch: MXFP8 stores h in 32-column blocks per item: block_n = {shape.block_n} "
                         f"must be a multiple of {MX_BLOCK}")
    dim_h, dim_i = bufs.ring_VQMH.shape[3], bufs.h_VQMI.shape[3]
    if dim_h % MX_BLOCK or dim_i % MX_BLOCK:
        raise ValueError(f"megakernel_launch: MXFP8 needs H ({dim_h}) and I ({dim_i}) to be multiples of {MX_BLOCK}")


def _check_kept(kept: KeptRows, shape: LaunchShape, dim_i: int) -> None:
    want = (shape.hosted_ranks, shape.ep_degree * shape.num_tokens * shape.top_k, dim_i)
    for name, t in zip(("gate_VRI", "up_VRI", "h_VRI"), kept):
        if tuple(t.shape) != want or t.dtype != torch.bfloat16 or not t.is_contiguous():
            raise ValueError(f"megakernel_launch: kept.{name} must be bf16 contiguous {list(want)} (V, P·T·K, I), "
                             f"got {t.dtype} {list(t.shape)}{'' if t.is_contiguous() else ' non-contiguous'}")


def megakernel_launch(bufs: MegakernelBuffers, schedule, weights, shape: LaunchShape, *, epoch: int,
                      swiglu_limit: float | None, serialized: bool, shared: SharedFFN | None = None,
                      kept: KeptRows | None = None, trace: torch.Tensor | None = None,
                      stall_rank: int | None = None, timeout_ms: float = 10_000.0,
                      phase_barrier: Callable[[], None] | None = None) -> None:
    """The forward's one launch (``serialized``: its phases one after another, see the module docstring).

    phase_barrier: in serialized mode with peers outside this launch (a rank of a real group, hosted_ranks <
    ep_degree), the group's barrier: called after the publish (every peer's x_TH is ready before any pull asserts
    it) and after the last round (every row pushed into a peer before its finish asserts the arrivals). The
    concurrent launch needs none: its waits spin.

    schedule: (group_end_VL, tile_end_VL, row_slot_VR) int32 of the hosted ranks; weights: (w_gate [V·L, I, H],
    w_up [V·L, I, H], w_down [V·L, H, I]) bf16 contiguous, or for an MXFP8 ring (``bufs.mx``) their MXFP8 operands
    (MXTensors blocked along K in MMA order: ``grouped_ffn.weight_operand(w, "mxfp8", 2, name)``); shared: the
    shared expert in the launch (exactly when shape.shared_groups > 0); kept: where the routed A items also store
    each real row's g, u, h (None: nowhere, the inference launch); trace: int64
    [shape.programs, 8], where every program writes its timings (module docstring, Trace; serialized: zeroed first,
    then each phase adds its counts). A concurrent launch with
    more programs than the device runs at once raises instead of risking a deadlock. ``stall_rank``: a rank whose
    communication programs publish nothing (tests of the bounded waits)."""
    if not 1 <= epoch <= MAX_EPOCH:
        raise ValueError(f"megakernel_launch: epoch = {epoch} must be in [1, {MAX_EPOCH}]")
    if shape.gemm not in GEMM_LOADS:
        raise ValueError(f"megakernel_launch: gemm = {shape.gemm!r} must be one of {GEMM_LOADS}")
    _check_precision(bufs, weights, shape)
    weight_data = _weight_bits(weights)[0]
    if kept is not None:
        _check_kept(kept, shape, weight_data[0].shape[1])
    if trace is not None and (tuple(trace.shape) != (shape.programs, len(TRACE_FIELDS))
                              or trace.dtype != torch.int64 or not trace.is_contiguous()):
        raise ValueError(f"megakernel_launch: trace must be int64 contiguous [{shape.programs}, {len(TRACE_FIELDS)}] "
                         f"(programs, TRACE_FIELDS), got {trace.dtype} {list(trace.shape)}")
    if shape.gemm == "tma":
        widths = {"H": weight_data[0].shape[2], "I": weight_data[0].shape[1],
                  "I_S": 8 if shared is None else shared.dim}
        for name, dim in widths.items():
            if dim % 8:
                raise ValueError(f"megakernel_launch: gemm = 'tma' reads rows by TMA, which needs 16-byte rows: {name} "
                                 f"= {dim} must be a multiple of 8 (or use gemm = 'ptr')")
        # the descriptors' bases: the weights as given (the launch's own buffers are allocations of their own)
        named = zip(("w_gate", "w_up", "w_down", "the shared expert's w_gate", "the shared expert's w_up",
                     "the shared expert's w_down"),
                    (*weight_data, *(() if shared is None else (shared.w_gate_IH, shared.w_up_IH,
                                                                 shared.w_down_HI))))
        for name, w in named:
            if w.data_ptr() % 16:
                raise ValueError(f"megakernel_launch: gemm = 'tma' reads {name} by TMA, which needs a 16-byte aligned "
                                 f"start: its data starts {w.data_ptr() % 16} bytes past one (or use gemm = 'ptr')")
    ring, group = bufs.ring_tiles, shape.group_tiles
    if (shape.lag + 1) * group > ring:
        raise ValueError(f"megakernel_launch: (lag + 1) x group_tiles = ({shape.lag} + 1) x {group} must be <= the "
                         f"{ring} ring tiles (module docstring: deadlock freedom)")
    run = functools.partial(megakernel_phase, bufs, schedule, weights, shape, epoch=epoch, swiglu_limit=swiglu_limit,
                            shared=shared, kept=kept, trace=trace, stall_rank=stall_rank, timeout_ms=timeout_ms)
    if not serialized:
        run(PHASE_ALL)
        return
    if trace is not None:
        trace.zero_()
    dims = (weight_data[0].shape[2], weight_data[0].shape[1], 0 if shared is None else shared.dim)

    def compute(window):  # the window's A items, then its B items (each from the steps that hold them)
        steps = (window[0] // group, triton.cdiv(window[1], group))
        for phase, lag in ((PHASE_GATE_UP, 0), (PHASE_DOWN, shape.lag)):
            run(phase, tiles=window, items=tuple(shape.first_item(s + lag, *dims) for s in steps))

    sync_peers = phase_barrier if phase_barrier is not None else (lambda: None)
    run(PHASE_PUBLISH)
    sync_peers()
    first_routed = shape.shared_groups * group
    if first_routed:  # the shared expert's tiles
        compute((0, first_routed))
    # the host knows an upper bound of the routed tiles (no sync): every row in its own expert's tiles
    max_tiles = triton.cdiv(shape.ep_degree * shape.num_tokens * shape.top_k, bufs.block_m) + shape.num_local
    for n in range(triton.cdiv(max_tiles, ring)):  # a round: the ring's tiles pulled, their A items, their B items
        window = (first_routed + n * ring, first_routed + (n + 1) * ring)
        run(PHASE_COMM, tiles=window)
        compute(window)
    sync_peers()


def megakernel_finish(bufs: MegakernelBuffers, weights_VTK: torch.Tensor, shared_VTH: torch.Tensor | None,
                      out_VTH: torch.Tensor, shape: LaunchShape, *, arrivals: int, serialized: bool, trap: bool,
                      shared_scale_VT: torch.Tensor | None = None, timeout_ms: float = 10_000.0) -> None:
    """out[v, t] = cast(Σ_j w[v,t,j]·slots_v[t,j] + shared[v,t]) in fp32, ascending j, once token t's rows have
    arrived: its arrival counter holds ``arrivals`` (every call so far's shape.arrivals_per_call, summed; ``trap``:
    a recorded error stops the device with an assertion naming the wait). shared: the launch's
    shared expert output when it ran one (then shared_VTH must be None), else shared_VTH (None: no shared term);
    shared_scale_VT (fp32): shared[v, t] times it first (one fp32 rounding)."""
    if shape.shared_groups and shared_VTH is not None:
        raise ValueError("megakernel_finish: the launch ran the shared expert; shared_VTH must be None")
    shared = bufs.shared_out_VTH if shape.shared_groups else shared_VTH
    if shared_scale_VT is not None and shared is None:
        raise ValueError("megakernel_finish: shared_scale_VT scales a shared output, and there is none")
    num_tokens, dim_h = out_VTH.shape[1:]
    if num_tokens == 0:
        return
    block_h = 1024
    grid = (shape.hosted_ranks * num_tokens, triton.cdiv(dim_h, block_h))
    _finish_kernel[grid](bufs.tables["slots_NH"], bufs.tables["arrivals_T"], weights_VTK,
                         shared if shared is not None else out_VTH,
                         shared_scale_VT if shared_scale_VT is not None else weights_VTK, out_VTH, bufs.errors,
                         shape.first_rank, arrivals, int(timeout_ms * 1000), num_tokens, dim_h,
                         K=shape.top_k, HAS_SHARED=shared is not None, HAS_SCALE=shared_scale_VT is not None,
                         SERIAL=serialized, TRAP=trap, BLOCK_H=block_h, enable_fp_fusion=False)
