"""The MoK megakernel's input-gradient (dgrad) launch: the mirror of the forward launch
(``kernels/mok_megakernel.py``, docs/design.md §5.9). Communication programs pull the rows w[t,j]·dY[t] of this
rank's schedule from their owners into the fixed ring of row tiles; compute programs run the down projection's
dgrad through the SwiGLU backward, then the gate/up dgrad, per (tile, column block), and push each input-gradient
row to its source's (token, slot) slot; a finish launch sums a token's K slots.

Legend: P ep degree, V ranks hosted by this launch, T tokens per rank, K top-k, N = T·K slots per rank,
R = P·N grouped rows per rank (the most a rank's schedule can hold), H hidden, I expert FFN size, L local experts
per rank, Q ring tiles per rank, M rows per tile (BLOCK_M), C compute programs per rank, G tiles per group,
NB_I = cdiv(I, BLOCK_N) and NB_H = cdiv(H, BLOCK_N) column blocks.

Everything but the work items is the forward's, reused from ``kernels/mok_megakernel.py``: programs per rank
(COMM communication, then C compute), tiles (the schedule's rows cut into M-row tiles per local expert, tile i in
ring slot i mod Q during round i div Q), the communication program (``_comm_program``: publish, acquire every
source's ready flag, then per tile wait for its ring slot, pull, release ready[q]), the item order and its
counter (``_item``: D1 items where the forward has A items, D2 where it has B), the stamps, bounded waits, error
record and serialized phases. The pull reads a slot row, not a token row: the forward's pull with K = 1 reads row
s mod N of the source's ``dy_NH`` (gathered slot s = p·N + t·K + j); it also stores each real row, as pulled, into
the grouped rows ``dy_VRH`` (the weight gradient of w_down reads them).

Work items of tile i (slot q, round n of call e; its rows: its schedule rows, the real ones those before its
expert's end):
- D1(i, b), b < NB_I: acquire ready[q] = stamp(e, n); dh[:, cols b] = dy_tile @ w_down[:, cols b] (its
  expert's) over all of H (fp32, BLOCK_K steps), then the SwiGLU backward with the rows' g, u (``gate_VRI``,
  ``up_VRI``: grouped rows of this rank's schedule) → dgate, dup (bf16, ``grouped_tiles._epilogue``'s SwiGLU
  backward) stored into the grouped rows ``dgate_VRI``, ``dup_VRI`` at the real rows. Then old = d1_done[q]++
  (acq_rel); the last arriver rearms it and stores dgrad_ready[q] = stamp(e, n) (release).
- D2(i, c), c < NB_H: acquire dgrad_ready[q] = stamp(e, n); dx[:, cols c] = dgate @ w_gate[:, cols c] +
  dup @ w_up[:, cols c] (its expert's), one fp32 accumulator (all of dgate's K steps, then dup's:
  grouped_mm_sum's order), rounded to bf16, each real row's stored into its source rank's ``dx_slots_NH`` at its
  slot. Then old = d2_done[q]++ (acq_rel); the last arriver rearms it, stores consumed[q] = stamp(e, n) (release:
  the ring tile's reads are done) and adds 1 to arrivals[token] on each real row's source rank (release).
- finish (``megakernel_bwd_finish``): token t waits until arrivals[t] = the host's running total (acquire: e·K
  when one workspace's calls own the counters; a rank of a real EP group shares them with its forward calls), then
  dx[t] = cast(Σ_j dx_slots[t, j]) in fp32, ascending j (``mok_combine.slot_reduce``'s arithmetic, no FMA).
Deadlock freedom, the epochs and the reset are the forward's argument word for word (D1 for A, D2 for B).
Across calls: a rank rewrites dy_NH for call e + 1 only after its finish of call e saw every one of its slots'
rows pushed (so pulled), and peers push into its dx slots only after acquiring its dy_ready >= e + 1 (at least,
as the forward's x_ready: on real EP a fast rank may already have published a later call, and then a slow
program of call e has none of its rows left to pull).

Buffers. Symmetric (int64 [P] address tables): ``dy_NH`` (w·dY per (token, slot), written by the owner before the
launch: ``mok_combine.slot_scale``), ``dx_slots_NH``, ``arrivals_T`` int32, ``dy_ready`` int64 [1]. Local to a
rank: ``ring_VQMH``, int64 ``ready_VQ`` / ``dgrad_ready_VQ`` / ``consumed_VQ``, int32 ``d1_done_VQ`` /
``d2_done_VQ`` / ``next_item_V`` / ``programs_done_V``, ``errors`` int64 [6]; MXFP8: ``dgate_mx_VQMI``,
``dup_mx_VQMI`` (each slot's tile of dgate's, dup's MXFP8 values). Per call (the caller's, for the weight
gradients): ``dy_VRH``, ``dgate_VRI``, ``dup_VRI``; rows past the rank's last expert's end are not written.
Memory: the ring Q·M·H·2 bytes per rank (Kimi K2.7, H 7168, the default Q = 32, M = 64: 29 MB); the grouped rows
V·R·(H + 2·I)·2 bytes per call, with the g, u inputs V·R·2·I·2 more (one rank: R = N; under virtual EP every
rank's rows are sized for all P·N, P times the tokens' slots).

Bits: dgate and dup are ``grouped_gemm.grouped_down_dgrad_swiglu``'s, the grouped rows' dx
``grouped_gemm.grouped_mm_sum``'s (bf16: fp32 accumulation over K in BLOCK_K = 64 steps, one rounding), dX
``slot_reduce``'s: each output element is computed by one item, so a token's gradient does not depend on the
tile, the item order, the program, the ring, the batch or P.

MXFP8 (the MX constexpr: the weights given as their dgrad operands, ``grouped_ffn.weight_operand(w, "mxfp8", 1,
name)``: w_gate, w_up [L·H, I] blocked along I, w_down [L·I, H] blocked along H, E4M3 in MMA order with E8M0 bits
per row): the Triton grouped FFN's MXFP8 dgrad (``grouped_down_dgrad_swiglu`` and ``grouped_mm_sum`` on MXFP8
operands), as the forward launch runs its MXFP8 forward. Its A operands hold their MXFP8 values (bf16,
``mxfp8_fake_quantize``'s code): the pull quantizes each dy row along H on its way into the ring (``dy_VRH`` gets the
row as pulled: the weight gradient quantizes its operands along the token axis itself), and D1 quantizes its dgate
and dup columns along I (BLOCK_N and I multiples of 32: whole blocks) into the slot's ``dgate_mx_VQMI``,
``dup_mx_VQMI`` tiles, every tile row (zeros past the expert's end), besides storing their bf16 values into the
grouped rows. D2 reads those tiles: they are the slot's, written by D1 after ready[q] (so after the previous tile's
D2 items freed the slot) and read after dgrad_ready[q], as the forward's h. The items dequantize the weights'
blocks in registers per 32-wide K step (the Triton path's MXFP8 step; each step's scales loaded a step ahead, D2's
across its switch from w_gate to w_up) and compute the product transposed (acc^T = w @ a^T, the forward's MX
items). So dgate, dup, the rows' dx and dX are the Triton MXFP8 path's bits. Memory: 2·Q·M·I·2 bytes per rank
more (Kimi K2.7, Q = 32, M = 64: 16.8 MB).

GEMM loads (``LaunchShape.gemm``, the TMA constexpr; ``MegakernelConfig.gemm``: None is "tma" for bf16 where the
rule below allows it, else "ptr", as measured fastest on an H100, docs/performance.md): the items' K loops read
their operands by masked pointer loads ("ptr") or, as the forward's, by TMA ("tma") through tensor descriptors each
compute program makes once, before its first claim: over
the rank's ring [Q·M, H], its experts' weights (bf16 w_down [L·H, I], w_gate and w_up [L·I, H] in [BLOCK_K, BLOCK_N]
blocks, K along rows; MXFP8 their dgrad operands [L·I, H], [L·H, I] in [BLOCK_N, 32] blocks) and D2's A operands
(bf16 the grouped dgate, dup rows [R, I]; MXFP8 the slots' tiles [Q·M, I]); D2 takes the gate's or the up's
descriptors per K step by a branch (descriptors have no select). TMA reads what other programs stored (the pulled
rows, dgate and dup) through the async proxy, so a proxy fence follows the acquire that waited for them. The same
bits as the pointer loads, by one rule (``check_tma_loads``): H and I multiples of the K step (bf16 BLOCK_K, MXFP8
32, which MXFP8 needs anyway; also 16-byte rows). A bf16 weight's K runs along its rows, so a block running past an
expert's H (D1) or I (D2) rows along K would read the next expert's rows into the sum (against A columns read as
zeros, but 0·w is -0 for a negative w and NaN for an infinite one, where the pointer loads add 0·0), and the rule
leaves no such block; 3-D descriptors [L, rows, cols] (each expert's bounds read as zeros) would lift it, at more
code (the four models' full sizes meet it; Kimi K2.7: H 7168, I 2048). The other reads past a bound feed nothing
that is stored: along N, bf16 blocks read zeros past H or I (their columns are the output's), MXFP8 weight blocks
the next expert's rows (or zeros past the last), which only feed output columns the stores skip, as the forward's;
D2's bf16 A rows past the tile's expert's end read the next expert's rows (or zeros past R; the pointer loads mask
them), which only feed output rows the stores skip.

Not here: the weight gradients (``grouped_gemm.grouped_wgrads`` on the grouped rows this launch writes),
the combine weights' gradient.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from titan_mok.kernels.grouped_gemm import _DOT_F32, _dot, _set_triton_allocator
from titan_mok.kernels.grouped_tiles import _bf16_rne, _swiglu_grads
from titan_mok.kernels.mok_combine import _round_to, _slot_term
from titan_mok.kernels.mok_megakernel import (
    BLOCK_K,
    GEMM_LOADS,
    MAX_EPOCH,
    PHASE_ALL,
    PHASE_COMM,
    PHASE_DOWN,
    PHASE_GATE_UP,
    PHASE_PUBLISH,
    WAIT_ARRIVALS,
    WAIT_H_READY,
    WAIT_RING_READY,
    KernelVariant,
    LaunchShape,
    RingBuffers,
    _async_proxy_fence,
    _comm_program,
    _descriptor,
    _item,
    _mx_values,
    _mx_weight_tile,
    _operand_tile,
    _scale_bits,
    _stamp,
    _tile_rows,
    _wait,
    _weight_bits,
    resident_programs,
)
from titan_mok.kernels.mxfp8 import BLOCK as MX_BLOCK
from titan_mok.kernels.mxfp8 import MXTensor

# Launch phases: the forward's (the kernels compare PHASE with literals: 0 all, 1 publish, 2 pull, 3 D1, 4 D2).
PHASE_D1, PHASE_D2 = PHASE_GATE_UP, PHASE_DOWN

WAIT_NAMES = {
    1: "dy_ready: rank {rank}'s communication program waited for rank {index} to publish its w·dY rows",
    2: "ring ready: rank {rank}'s compute program waited for ring tile {index} to be pulled",
    3: "ring free: rank {rank}'s communication program waited for the ring slot of tile {index} to be consumed",
    4: "arrivals: rank {rank} waited for all K input-gradient rows of its token {index}",
    5: "dgrad ready: rank {rank}'s compute program waited for the D1 items of ring tile {index}",
}
"""The backward's meaning of each error code (the codes are the forward's: its communication program records them)."""


@triton.jit
def _down_dgrad_block(a_src, a_row, wd_src, w_row, wd_scales, g_ptr, u_ptr, dgate_ptr, dup_ptr, dgate_mx_ptr,
                      dup_mx_ptr, rows, real, n0, H, I, limit, HAS_LIMIT: tl.constexpr, MX: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                      TMA: tl.constexpr):
    """dh[:, n0:n0 + BLOCK_N] = a @ w_down[:, n0:n0 + BLOCK_N] for one ring tile a [M, H] = rows [a_row, a_row + M)
    of a_src and the expert's w_down [H, I] = rows [w_row, w_row + H) of wd_src (pointers: the tile's and the
    expert's own, rows 0; TMA: descriptors of the rank's ring [Q·M, H] and weights [L·H, I], H a multiple of
    BLOCK_K: no block runs into the next expert's rows), through the SwiGLU backward with the rows' g, u: dgate, dup
    stored at the real rows of the grouped [R, I] buffers.

    MX: a holds the dy rows' MXFP8 values along H (the pull's), w_down is its dgrad operand [I, H] (E4M3 rows blocked
    along H, E8M0 bits [I, H / 32] at wd_scales; TMA: rows [w_row, w_row + I) of [L·I, H], a block's rows past I
    the next expert's, feeding output columns never stored), dequantized per 32-wide K step with the scales loaded a
    step ahead, the product transposed (the forward's MX items); dgate and dup also go, as their MXFP8 values along
    I (whole 32-blocks: BLOCK_N and I multiples of 32), into the slot's [M, I] tiles at dgate_mx_ptr, dup_mx_ptr,
    every tile row (the rows past the expert's end are zeros: zero dy, zero g, u), D2's A operands."""
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    every_row = tl.full((BLOCK_M,), 1, tl.int1)
    if MX:
        acct = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        scale_rows = wd_scales + offs_n * (H // 32)  # int32: the expert's [I, H / 32] bits
        s_next = _scale_bits(scale_rows, 0, n_ok, H)
        for k0 in range(0, H, 32):
            # .cg: another SM wrote the tile (as below)
            at = tl.trans(_operand_tile(a_src, a_row, k0, every_row, H, BLOCK_M, 32, TMA, ".cg"))
            s = s_next
            s_next = _scale_bits(scale_rows, k0 + 32, n_ok, H)
            acct = _dot(_mx_weight_tile(wd_src, w_row + n0, k0, n_ok, H, s, BLOCK_N, TMA), at, acct, DOT_F32)
        acc = tl.trans(acct)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            if TMA:  # K runs along w_down's rows: H is a multiple of BLOCK_K, so the block is the expert's
                a = _operand_tile(a_src, a_row, k0, None, H, BLOCK_M, BLOCK_K, TMA, ".cg")
                b = _operand_tile(wd_src, w_row + k0, n0, None, I, BLOCK_K, BLOCK_N, TMA, "")
            else:
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < H
                # .cg: another SM wrote the tile; read it from L2, never from a line this SM cached in an earlier
                # round
                a = tl.load(a_src + offs_m[:, None] * H + offs_k[None, :], mask=k_ok[None, :], other=0.0,
                            cache_modifier=".cg")
                b = tl.load(wd_src + offs_k[:, None].to(tl.int64) * I + offs_n[None, :],
                            mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = _dot(a, b, acc, DOT_F32)
    # the tile's rows are consecutive: int32 offsets from its first row (int64 ones spill registers on sm_90)
    first = tl.min(rows, axis=0).to(tl.int64) * I
    c_off = offs_m[:, None].to(tl.int32) * I + offs_n[None, :]
    c_ok = real[:, None] & n_ok[None, :]
    dgate, dup = _swiglu_grads(acc, g_ptr + first, u_ptr + first, c_off, c_ok, limit, HAS_LIMIT)
    dgate = _bf16_rne(dgate)
    tl.store(dgate_ptr + first + c_off, dgate, mask=c_ok)
    dup = _bf16_rne(dup)
    tl.store(dup_ptr + first + c_off, dup, mask=c_ok)
    if MX:
        tl.store(dgate_mx_ptr + c_off, _mx_values(dgate, BLOCK_M, BLOCK_N), mask=n_ok[None, :])
        tl.store(dup_mx_ptr + c_off, _mx_values(dup, BLOCK_M, BLOCK_N), mask=n_ok[None, :])


@triton.jit
def _either(up, gate_src, up_src, TMA: tl.constexpr):
    """up_src where up, else gate_src: pointers by a select, TMA descriptors (no select of two) by a branch."""
    if TMA:
        src = gate_src
        if up:
            src = up_src
    else:
        src = tl.where(up, up_src, gate_src)
    return src


@triton.jit
def _gate_up_dgrad_block(dgate_src, dup_src, a_row, wg_src, wu_src, w_row, wg_scales, wu_scales, dst_ptrs, rows, real,
                         n0, H, I, MX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, TMA: tl.constexpr):
    """dx[:, n0:n0 + BLOCK_N] = dgate @ w_gate[:, cols] + dup @ w_up[:, cols] in one fp32 accumulator (dgate's K
    steps over I, then dup's, each ascending), rounded to bf16; real row r's columns stored at dst_ptrs[r] (its
    (token, slot) row). dgate, dup: grouped rows [R, I] (pointers: the rank's, the tile's rows; TMA: descriptors,
    the tile's rows from a_row, its first, those past its expert's end another expert's or zeros past R, feeding
    output rows never stored); w_gate, w_up [I, H]: rows [w_row, w_row + I) of wg_src, wu_src (pointers: the
    expert's own, rows 0; TMA: descriptors of the rank's [L·I, H], I a multiple of BLOCK_K: no block runs into the
    next expert's rows).

    MX: dgate, dup are the slot's [M, I] tiles of their MXFP8 values along I (D1's; rows [a_row, a_row + M) of
    dgate_src, dup_src: the slot's, or TMA the rank's [Q·M, I]), w_gate, w_up their dgrad operands [H, I] (E4M3 rows
    blocked along I, E8M0 bits [H, I / 32] at wg_scales, wu_scales; TMA: rows [w_row, w_row + H) of [L·H, I], a
    block's rows past H the next expert's, feeding output columns never stored), dequantized per 32-wide K step
    with the scales loaded a step ahead (across the switch from w_gate to w_up too), the product transposed."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    # one loop over both products, the same steps in the same order (two loops, each software-pipelined, spill
    # 400+ bytes of registers on sm_90)
    if MX:
        steps = I // 32
        every_row = tl.full((BLOCK_M,), 1, tl.int1)
        scale_off = offs_n * (I // 32)  # int32: an expert's [H, I / 32] bits (the bases carry the expert's offset)
        s_next = _scale_bits(wg_scales + scale_off, 0, n_ok, I)
        acct = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for step in range(0, 2 * steps):
            up = step >= steps
            k0 = (step - tl.where(up, steps, 0)) * 32
            # .cg: other SMs wrote these rows in this launch
            at = tl.trans(_operand_tile(_either(up, dgate_src, dup_src, TMA), a_row, k0, every_row, I, BLOCK_M, 32,
                                        TMA, ".cg"))
            s = s_next
            up_next = step + 1 >= steps  # past the last step: k = I, so the scales read as 2^0 (never used)
            s_next = _scale_bits(tl.where(up_next, wu_scales, wg_scales) + scale_off,
                                 (step + 1 - tl.where(up_next, steps, 0)) * 32, n_ok, I)
            acct = _dot(_mx_weight_tile(_either(up, wg_src, wu_src, TMA), w_row + n0, k0, n_ok, I, s, BLOCK_N, TMA),
                        at, acct, DOT_F32)
        dx = tl.trans(_bf16_rne(acct))
    else:
        a_rows = rows[:, None].to(tl.int64) * I
        steps = tl.cdiv(I, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, 2 * steps):
            up = step >= steps
            if TMA:
                k0 = (step - tl.where(up, steps, 0)) * BLOCK_K
                # (the tile's rows past its expert's end: another expert's rows, or zeros past R; stores skip them)
                a = _operand_tile(_either(up, dgate_src, dup_src, TMA), a_row, k0, None, I, BLOCK_M, BLOCK_K, TMA,
                                  ".cg")
                b = _operand_tile(_either(up, wg_src, wu_src, TMA), w_row + k0, n0, None, H, BLOCK_K, BLOCK_N, TMA,
                                  "")
            else:
                offs_k = (step - tl.where(up, steps, 0)) * BLOCK_K + tl.arange(0, BLOCK_K)
                k_ok = offs_k < I
                # .cg: other SMs wrote these rows in this launch
                a = tl.load(tl.where(up, dup_src, dgate_src) + a_rows + offs_k[None, :],
                            mask=real[:, None] & k_ok[None, :], other=0.0, cache_modifier=".cg")
                b = tl.load(tl.where(up, wu_src, wg_src) + offs_k[:, None].to(tl.int64) * H + offs_n[None, :],
                            mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = _dot(a, b, acc, DOT_F32)
        dx = _bf16_rne(acc)
    tl.store(dst_ptrs[:, None] + offs_n[None, :], dx, mask=real[:, None] & n_ok[None, :])


@triton.jit
def _d1_item(i, b, rank, ring_src, ready_ptr, dgrad_ready_ptr, d1_done_ptr, group_end_ptr, tile_end_ptr, wd_src,
             wd_scale_ptr, g_ptr, u_ptr, dgate_ptr, dup_ptr, dgate_mx_ptr, dup_mx_ptr, err_ptr, epoch, timeout_us,
             limit, L, H, I, Q, NB_I, SERIAL: tl.constexpr, HAS_LIMIT: tl.constexpr, MX: tl.constexpr,
             LOG_L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             DOT_F32: tl.constexpr, TMA: tl.constexpr):
    """D1(i, b) (module docstring); False when its wait ran out. ring_src, wd_src: the rank's ring and w_down (its
    dgrad operand under MX), pointers or TMA descriptors (_compute_program)."""
    FENCE: tl.constexpr = TMA and not SERIAL  # serialized: a launch ends between the writer and the reader
    q = i % Q
    n = i // Q
    ok = _wait(ready_ptr + q, _stamp(epoch, n), err_ptr, WAIT_RING_READY, rank, i, timeout_us, SERIAL)
    if ok:
        _async_proxy_fence(FENCE)  # the pulled rows (generic stores) before the TMA reads of them
        e, rows, real = _tile_rows(i, group_end_ptr, tile_end_ptr, L, LOG_L, BLOCK_M)
        if TMA:  # the tile's rows of the ring, the expert's rows of the weights
            a_src, a_row, w_src = ring_src, q * BLOCK_M, wd_src
            if MX:
                w_row = e * I
            else:
                w_row = e * H
        else:  # the tile's and the expert's own pointers
            a_src, a_row = ring_src + q.to(tl.int64) * BLOCK_M * H, 0
            w_src, w_row = wd_src + e.to(tl.int64) * H * I, 0
        slot_i = q.to(tl.int64) * BLOCK_M * I  # the slot's [M, I] tiles (MX)
        _down_dgrad_block(a_src, a_row, w_src, w_row, wd_scale_ptr + e.to(tl.int64) * I * (H // 32), g_ptr, u_ptr,
                          dgate_ptr, dup_ptr, dgate_mx_ptr + slot_i, dup_mx_ptr + slot_i, rows, real, b * BLOCK_N, H,
                          I, limit, HAS_LIMIT, MX, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, TMA)
        tl.debug_barrier()  # every thread's stores, and its reads of the ring tile, done before the count
        if tl.atomic_add(d1_done_ptr + q, 1, sem="acq_rel", scope="sys") == NB_I - 1:
            # the tile's last D1 item: every other's dgate/dup rows are ordered before this (acq_rel)
            tl.atomic_xchg(d1_done_ptr + q, 0, sem="relaxed", scope="sys")
            tl.atomic_xchg(dgrad_ready_ptr + q, _stamp(epoch, n), sem="release", scope="sys")
    return ok


@triton.jit
def _d2_item(i, c, rank, dgrad_ready_ptr, consumed_ptr, d2_done_ptr, slots_table, arrivals_table, group_end_ptr,
             tile_end_ptr, row_slot_ptr, wg_src, wu_src, wg_scale_ptr, wu_scale_ptr, dgate_src, dup_src, err_ptr,
             epoch, timeout_us, L, N, K, H, I, Q, NB_H, SERIAL: tl.constexpr, MX: tl.constexpr, LOG_L: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
             TMA: tl.constexpr):
    """D2(i, c) (module docstring); False when its wait ran out. wg_src, wu_src: the rank's w_gate, w_up (their
    dgrad operands under MX); dgate_src, dup_src: its grouped dgate, dup rows (MX: its slots' tiles of their MXFP8
    values); pointers or TMA descriptors (_compute_program)."""
    FENCE: tl.constexpr = TMA and not SERIAL  # serialized: a launch ends between the writer and the reader
    q = i % Q
    n = i // Q
    ok = _wait(dgrad_ready_ptr + q, _stamp(epoch, n), err_ptr, WAIT_H_READY, rank, i, timeout_us, SERIAL)
    if ok:
        _async_proxy_fence(FENCE)  # the D1 items' rows (generic stores) before the TMA reads of them
        e, rows, real = _tile_rows(i, group_end_ptr, tile_end_ptr, L, LOG_L, BLOCK_M)
        s = tl.load(row_slot_ptr + rows, mask=real, other=0)  # gathered slot p·N + t·K + j
        src = s // N
        slot_ptrs = tl.load(slots_table + src, mask=real, other=0).to(tl.pointer_type(tl.bfloat16))
        w_off = e.to(tl.int64) * I * H
        if TMA:  # the tile's rows (MX: the slot's) and the expert's rows of the weights
            a_gate, a_up, w_gate, w_up = dgate_src, dup_src, wg_src, wu_src
            if MX:
                a_row, w_row = q * BLOCK_M, e * H
            else:
                a_row, w_row = tl.min(rows, axis=0), e * I
        else:
            if MX:  # the A operands: the slot's tiles of their MXFP8 values
                slot_i = q.to(tl.int64) * BLOCK_M * I
                a_gate, a_up = dgate_src + slot_i, dup_src + slot_i
            else:  # the grouped rows
                a_gate, a_up = dgate_src, dup_src
            a_row = 0
            w_gate, w_up, w_row = wg_src + w_off, wu_src + w_off, 0
        _gate_up_dgrad_block(a_gate, a_up, a_row, w_gate, w_up, w_row, wg_scale_ptr + w_off // 32,
                             wu_scale_ptr + w_off // 32, slot_ptrs + (s % N).to(tl.int64) * H, rows, real,
                             c * BLOCK_N, H, I, MX, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, TMA)
        tl.debug_barrier()  # every thread's slot stores and row reads done before the count
        if tl.atomic_add(d2_done_ptr + q, 1, sem="acq_rel", scope="sys") == NB_H - 1:
            # the tile's last D2 item: every other's slot stores are ordered before this (acq_rel)
            tl.atomic_xchg(d2_done_ptr + q, 0, sem="relaxed", scope="sys")
            tl.atomic_xchg(consumed_ptr + q, _stamp(epoch, n), sem="release", scope="sys")
            tl.debug_barrier()  # the count's acquire before every thread's arrival increments
            arrivals = tl.load(arrivals_table + src, mask=real, other=0).to(tl.pointer_type(tl.int32))
            tl.atomic_add(arrivals + (s % N) // K, 1, mask=real, sem="release", scope="sys")
    return ok


@triton.jit
def _compute_program(rank, ring_ptr, ready_ptr, dgrad_ready_ptr, consumed_ptr, d1_done_ptr, d2_done_ptr,
                     next_item_ptr, programs_done_ptr, slots_table, arrivals_table, group_end_ptr, tile_end_ptr,
                     row_slot_ptr, wg_ptr, wu_ptr, wd_ptr, wg_scale_ptr, wu_scale_ptr, wd_scale_ptr, g_ptr, u_ptr,
                     dgate_ptr, dup_ptr, dgate_mx_ptr, dup_mx_ptr, err_ptr, epoch, timeout_us, tile_lo, tile_hi,
                     item_lo, item_hi, limit, L, N, K, H, I, R, Q, COMPUTE, G, LAG, PHASE: tl.constexpr,
                     HAS_LIMIT: tl.constexpr, MX: tl.constexpr, LOG_L: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, TMA: tl.constexpr):
    SERIAL: tl.constexpr = PHASE != 0
    # The GEMM operands (_operand_tile): the rank's ring [Q·M, H], its experts' weights (bf16 w_down [L·H, I], w_gate,
    # w_up [L·I, H] in [BLOCK_K, BLOCK_N] blocks, K along rows; MX their dgrad operands [L·I, H], [L·H, I] in
    # [BLOCK_N, 32] blocks), the A operands of D2 (bf16 the grouped dgate, dup rows [R, I]; MX the slots' tiles
    # [Q·M, I]). TMA: a tensor descriptor of each, made once per program (128 bytes of the launch's global scratch
    # each).
    ring_src, wd_src, wg_src, wu_src = ring_ptr, wd_ptr, wg_ptr, wu_ptr
    dgate_src, dup_src = dgate_ptr, dup_ptr
    if MX:
        dgate_src, dup_src = dgate_mx_ptr, dup_mx_ptr
    if TMA:
        ring_src = _descriptor(ring_ptr, Q * BLOCK_M, H, BLOCK_M, 32 if MX else BLOCK_K)
        if MX:
            wd_src = _descriptor(wd_ptr, L * I, H, BLOCK_N, 32)
            wg_src = _descriptor(wg_ptr, L * H, I, BLOCK_N, 32)
            wu_src = _descriptor(wu_ptr, L * H, I, BLOCK_N, 32)
            dgate_src = _descriptor(dgate_mx_ptr, Q * BLOCK_M, I, BLOCK_M, 32)
            dup_src = _descriptor(dup_mx_ptr, Q * BLOCK_M, I, BLOCK_M, 32)
        else:
            wd_src = _descriptor(wd_ptr, L * H, I, BLOCK_K, BLOCK_N)
            wg_src = _descriptor(wg_ptr, L * I, H, BLOCK_K, BLOCK_N)
            wu_src = _descriptor(wu_ptr, L * I, H, BLOCK_K, BLOCK_N)
            dgate_src = _descriptor(dgate_ptr, R, I, BLOCK_M, BLOCK_K)
            dup_src = _descriptor(dup_ptr, R, I, BLOCK_M, BLOCK_K)
    NB_I = tl.cdiv(I, BLOCK_N)
    NB_H = tl.cdiv(H, BLOCK_N)
    tiles = tl.load(tile_end_ptr + L - 1)
    end = tl.minimum((tl.cdiv(tiles, G) + LAG) * G * (NB_I + NB_H), item_hi)
    tile_lo = tl.maximum(tile_lo, 0)
    tile_hi = tl.minimum(tile_hi, tiles)
    alive = tl.full((), 1, tl.int1)
    j = item_lo + tl.atomic_add(next_item_ptr, 1, sem="relaxed", scope="gpu")
    while alive & (j < end):
        is_d1, i, block = _item(j, G, LAG, NB_I, NB_H, NB_I, 0)  # no shared-expert groups
        mine = (i >= tile_lo) & (i < tile_hi)  # a tile of this launch's window (every tile but in serialized mode)
        if PHASE != 4:
            if is_d1 & mine:
                alive = _d1_item(i, block, rank, ring_src, ready_ptr, dgrad_ready_ptr, d1_done_ptr, group_end_ptr,
                                 tile_end_ptr, wd_src, wd_scale_ptr, g_ptr, u_ptr, dgate_ptr, dup_ptr, dgate_mx_ptr,
                                 dup_mx_ptr, err_ptr, epoch, timeout_us, limit, L, H, I, Q, NB_I, SERIAL, HAS_LIMIT,
                                 MX, LOG_L, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, TMA)
        if PHASE != 3:
            if (is_d1 == 0) & mine:
                alive = _d2_item(i, block, rank, dgrad_ready_ptr, consumed_ptr, d2_done_ptr, slots_table,
                                 arrivals_table, group_end_ptr, tile_end_ptr, row_slot_ptr, wg_src, wu_src,
                                 wg_scale_ptr, wu_scale_ptr, dgate_src, dup_src, err_ptr, epoch, timeout_us, L, N, K,
                                 H, I, Q, NB_H, SERIAL, MX, LOG_L, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, TMA)
        j = item_lo + tl.atomic_add(next_item_ptr, 1, sem="relaxed", scope="gpu")
    # the last of the rank's programs to run out of items rearms the counter for the next launch (acq_rel: the
    # others' claims are ordered before the reset)
    if tl.atomic_add(programs_done_ptr, 1, sem="acq_rel", scope="gpu") == COMPUTE - 1:
        tl.atomic_xchg(next_item_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(programs_done_ptr, 0, sem="relaxed", scope="gpu")


# not specialized: the integers that vary per call or per configuration (one compiled kernel per H, I and tiles)
@triton.jit(do_not_specialize=["first_rank", "epoch", "stall_rank", "timeout_us", "tile_lo", "tile_hi", "item_lo",
                               "item_hi", "P", "L", "T", "K", "Q", "COMM", "COMPUTE", "G", "LAG"])
def _megakernel_bwd(
    # local to the hosted ranks: ring [V, Q, M, H] bf16
    ring_ptr,
    # ... int64 [V, Q]: ready, dgrad_ready, consumed; int32 [V, Q]: d1_done, d2_done; int32 [V]: next_item,
    # programs_done
    ready_ptr, dgrad_ready_ptr, consumed_ptr, d1_done_ptr, d2_done_ptr, next_item_ptr, programs_done_ptr,
    # MX: the slots' dgate, dup tiles of MXFP8 values [V, Q, M, I] bf16; else never read
    dgate_mx_ptr, dup_mx_ptr,
    # int64 [P] addresses of every rank's symmetric buffers
    dy_table, slots_table, arrivals_table, dy_ready_table,
    # the hosted ranks' schedules: group_end, tile_end int32 [V, L], row_slot int32 [V, R]
    group_end_ptr, tile_end_ptr, row_slot_ptr,
    # the hosted ranks' expert weights: w_gate, w_up [V·L, I, H], w_down [V·L, H, I] bf16; MX: their dgrad operands'
    # E4M3 bits, w_gate, w_up [V·L, H, I], w_down [V·L, I, H] (uint8)
    wg_ptr, wu_ptr, wd_ptr,
    # MX: their E8M0 bits (uint8) [V·L, H, I / 32], [V·L, H, I / 32], [V·L, I, H / 32]; else never read
    wg_scale_ptr, wu_scale_ptr, wd_scale_ptr,
    # grouped rows of the hosted ranks' schedules: g, u in; dgate, dup out [V, R, I]; dy out [V, R, H] (bf16)
    g_ptr, u_ptr, dgate_ptr, dup_ptr, dy_rows_ptr,
    err_ptr,
    first_rank, epoch, stall_rank, timeout_us, tile_lo, tile_hi, item_lo, item_hi, limit,
    P, L, T, K, H, I, Q, COMM, COMPUTE, G, LAG,
    PHASE: tl.constexpr, HAS_LIMIT: tl.constexpr, MX: tl.constexpr, LOG_L: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, DOT_F32: tl.constexpr, TMA: tl.constexpr,
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
            # the forward's communication program, K = 1: tile row j is slot row s mod N of rank s div N's dy_NH
            # (MX: its MXFP8 values along H, as the forward's x); each real row also into the grouped dy rows, as
            # pulled (no trace)
            _comm_program(role, rank, ring_ptr, ready_ptr, consumed_ptr, dy_table, dy_ready_table, group_end_ptr,
                          tile_end_ptr, row_slot_ptr, dy_rows_ptr + local64 * P * N * H, err_ptr, err_ptr, epoch,
                          stall_rank, timeout_us, tile_lo, tile_hi, P, L, N, 1, H, Q, COMM, PHASE, MX, True, LOG_L,
                          BLOCK_M, BLOCK_H, False)
    else:
        if PHASE == 0 or PHASE >= 3:
            w_off = local64 * L * I * H  # the hosted rank's first expert (MX: its E4M3 bits; its E8M0 bits / 32)
            rows_i = local64 * P * N * I  # the hosted rank's grouped rows
            slots_i = local64 * Q * BLOCK_M * I  # its slots' [M, I] tiles (MX)
            _compute_program(rank, ring_ptr, ready_ptr, dgrad_ready_ptr + local64 * Q, consumed_ptr,
                             d1_done_ptr + local64 * Q, d2_done_ptr + local64 * Q, next_item_ptr + local,
                             programs_done_ptr + local, slots_table, arrivals_table, group_end_ptr, tile_end_ptr,
                             row_slot_ptr, wg_ptr + w_off, wu_ptr + w_off, wd_ptr + w_off, wg_scale_ptr + w_off // 32,
                             wu_scale_ptr + w_off // 32, wd_scale_ptr + w_off // 32, g_ptr + rows_i, u_ptr + rows_i,
                             dgate_ptr + rows_i, dup_ptr + rows_i, dgate_mx_ptr + slots_i, dup_mx_ptr + slots_i,
                             err_ptr, epoch, timeout_us, tile_lo, tile_hi, item_lo, item_hi, limit, L, N, K, H, I,
                             P * N, Q, COMPUTE, G, LAG, PHASE, HAS_LIMIT, MX, LOG_L, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32,
                             TMA)


# debug: the device assertions below are compiled in
@triton.jit(debug=True, do_not_specialize=["first_rank", "arrivals_expected", "timeout_us"])
def _finish_bwd_kernel(slots_table, arrivals_table, out_ptr, err_ptr, first_rank, arrivals_expected, timeout_us, T,
                       H, K: tl.constexpr, SERIAL: tl.constexpr, TRAP: tl.constexpr, BLOCK_H: tl.constexpr):
    local = tl.program_id(0) // T
    t = (tl.program_id(0) % T).to(tl.int64)
    rank = first_rank + local
    arrivals = tl.load(arrivals_table + rank).to(tl.pointer_type(tl.int32))
    _wait(arrivals + t, arrivals_expected, err_ptr, WAIT_ARRIVALS, rank, t, timeout_us, SERIAL)
    if TRAP:
        code = tl.load(err_ptr, volatile=True)
        tl.device_assert(code != 1, "mok megakernel backward: timed out waiting for a source rank's dy_ready")
        tl.device_assert(code != 2, "mok megakernel backward: timed out waiting for a ring tile to be pulled")
        tl.device_assert(code != 3, "mok megakernel backward: timed out waiting for a ring slot to be consumed")
        tl.device_assert(code != 4, "mok megakernel backward: timed out waiting for a token's K rows to arrive")
        tl.device_assert(code != 5, "mok megakernel backward: timed out waiting for a ring tile's D1 items")
    slots_ptr = tl.load(slots_table + rank).to(tl.pointer_type(tl.bfloat16))
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = _slot_term(slots_ptr, slots_ptr, slots_ptr, t, 0, cols, ok, H, K, False, False)
    for j in tl.static_range(1, K):  # ascending slot order, fp32 adds (no FMA: enable_fp_fusion=False)
        acc = acc + _slot_term(slots_ptr, slots_ptr, slots_ptr, t, j, cols, ok, H, K, False, False)
    row = (local.to(tl.int64) * T + t) * H
    tl.store(out_ptr + row + cols, _round_to(acc, out_ptr), mask=ok)


# ----------------------------------------------------------------------------- host side


@dataclass
class BackwardBuffers(RingBuffers):
    """What a launch reads and writes besides the schedule, the weights and the per-call grouped rows (module
    docstring)."""

    ring_VQMH: torch.Tensor
    ready_VQ: torch.Tensor
    dgrad_ready_VQ: torch.Tensor
    consumed_VQ: torch.Tensor
    d1_done_VQ: torch.Tensor
    d2_done_VQ: torch.Tensor
    next_item_V: torch.Tensor
    programs_done_V: torch.Tensor
    tables: dict[str, torch.Tensor]
    """"dy_NH", "dx_slots_NH", "arrivals_T", "dy_ready": int64 [P] addresses of every rank's buffer."""
    errors: torch.Tensor
    """int64 [6]: code, waiting rank, index, seen, expected (0: no error)."""
    dgate_mx_VQMI: torch.Tensor | None = None
    """MXFP8 launches: each slot's tile of dgate's MXFP8 values along I (D1 writes, D2 reads), bf16; None: bf16."""
    dup_mx_VQMI: torch.Tensor | None = None
    """Likewise dup's."""

    @property
    def mx(self) -> bool:
        """Whether the buffers serve MXFP8 launches."""
        return self.dgate_mx_VQMI is not None

    @property
    def flags(self) -> list[torch.Tensor]:
        """The launch's own flags and counters (the symmetric ones are the caller's)."""
        return [self.ready_VQ, self.dgrad_ready_VQ, self.consumed_VQ, self.d1_done_VQ, self.d2_done_VQ,
                self.next_item_V, self.programs_done_V]


@dataclass(frozen=True)
class GroupedRows:
    """The grouped rows of the hosted ranks' schedules (row r of rank v: its schedule's row r), bf16."""

    gate_VRI: torch.Tensor
    """In: the forward's g rows (kept by the forward launch)."""
    up_VRI: torch.Tensor
    """In: the forward's u rows."""
    dgate_VRI: torch.Tensor
    """Out: the SwiGLU backward's dgate rows."""
    dup_VRI: torch.Tensor
    """Out: its dup rows."""
    dy_VRH: torch.Tensor
    """Out: the pulled w·dY rows, as pulled (under MXFP8 too: the weight gradient quantizes its own operands)."""


def read_error(errors: torch.Tensor) -> str | None:
    """The recorded wait that ran out, in words (None: none). NOTE: host sync (reads the error buffer)."""
    code, rank, index, seen, expected, _ = errors.tolist()
    if code == 0:
        return None
    what = WAIT_NAMES.get(code, "unknown wait code {code}").format(rank=rank, index=index, code=code)
    return f"mok megakernel backward: timed out: {what} (flag held {seen}, expected {expected})"


def _dims(weights) -> tuple[int, int]:
    """(H, I) of the launch's weights: bf16 w_gate [V·L, I, H], or the MXFP8 dgrad operand of w_gate [V·L, H, I]."""
    if isinstance(weights[0], MXTensor):
        return tuple(weights[0].data.shape[1:])
    dim_i, dim_h = weights[0].shape[1:]
    return dim_h, dim_i


def _args(bufs, schedule, weights, rows: GroupedRows, shape: LaunchShape, epoch, stall_rank, timeout_us, tiles,
          items, limit):
    group_end_VL, tile_end_VL, row_slot_VR = schedule
    dim_h, dim_i = _dims(weights)
    weights, weight_scales = _weight_bits(weights)
    scale_ptrs = (bufs.errors,) * 3 if weight_scales is None else weight_scales  # bf16: pointers never read
    mx_tiles = (bufs.dgate_mx_VQMI, bufs.dup_mx_VQMI) if bufs.mx else (bufs.ring_VQMH,) * 2  # bf16: never read
    t = bufs.tables
    return (bufs.ring_VQMH, *bufs.flags, *mx_tiles, t["dy_NH"], t["dx_slots_NH"], t["arrivals_T"], t["dy_ready"],
            group_end_VL, tile_end_VL, row_slot_VR, *weights, *scale_ptrs, rows.gate_VRI, rows.up_VRI, rows.dgate_VRI,
            rows.dup_VRI, rows.dy_VRH, bufs.errors, shape.first_rank, epoch, stall_rank, timeout_us, *tiles, *items,
            limit, shape.ep_degree, shape.num_local, shape.num_tokens, shape.top_k, dim_h, dim_i, bufs.ring_tiles,
            shape.comm_programs, shape.compute_programs, shape.group_tiles, shape.lag)


def _constexprs(variant: KernelVariant, phase: int) -> dict:
    return dict(PHASE=phase, HAS_LIMIT=variant.has_limit, MX=variant.mx, LOG_L=variant.num_local.bit_length(),
                BLOCK_M=variant.block_m, BLOCK_N=variant.block_n, BLOCK_K=BLOCK_K,
                BLOCK_H=min(256, triton.next_power_of_2(variant.dim_h)), DOT_F32=_DOT_F32, TMA=variant.gemm == "tma",
                num_warps=variant.num_warps, num_stages=variant.num_stages)


def _variant(bufs: BackwardBuffers, weights, shape: LaunchShape, swiglu_limit: float | None) -> KernelVariant:
    dim_h, dim_i = _dims(weights)
    return KernelVariant(dim_h, dim_i, 0, shape.num_local, bufs.block_m, shape.block_n, shape.num_warps,
                         shape.num_stages, swiglu_limit is not None, gemm=shape.gemm,
                         mx=isinstance(weights[0], MXTensor))


def compile_megakernel_bwd(variant: KernelVariant):
    """The concurrent launch's kernel compiled for a variant (its other integers are not specialized; no shared
    expert: ``variant.shared_dim`` is 0), launching nothing: the current driver's target."""
    if variant.shared_dim:
        raise ValueError(f"compile_megakernel_bwd: the dgrad launch has no shared expert, got {variant}")
    weights = torch.uint8 if variant.mx else torch.bfloat16  # E4M3 bits or bf16
    ptrs = [torch.bfloat16] + [torch.int64] * 3 + [torch.int32] * 4 + [torch.bfloat16] * 2 + [torch.int64] * 4 + [
        torch.int32] * 3 + [weights] * 3 + [torch.uint8 if variant.mx else torch.int64] * 3 + [torch.bfloat16] * 5 + [
        torch.int64]  # pointer arguments as their dtypes (Triton's warmup takes those)
    ints = [2] * 8 + [0.0] + [2] * 4 + [variant.dim_h, variant.dim_i] + [2] * 5  # first_rank ... LAG
    return _megakernel_bwd.warmup(*ptrs, *ints, grid=(1,), **_constexprs(variant, PHASE_ALL))


@functools.cache
def co_resident_programs_bwd(device_index: int, variant: KernelVariant) -> int:
    """How many programs of a concurrent dgrad launch of this variant the device runs at once."""
    return resident_programs(compile_megakernel_bwd(variant), device_index)


def megakernel_bwd_phase(bufs: BackwardBuffers, schedule, weights, rows: GroupedRows, shape: LaunchShape,
                         phase: int, *, epoch: int, swiglu_limit: float | None, stall_rank: int | None = None,
                         timeout_ms: float = 10_000.0, tiles: tuple[int, int] = (0, 2**31 - 1),
                         items: tuple[int, int] = (0, 2**31 - 1)) -> None:
    """One launch of the grid in ``phase`` (PHASE_ALL, PHASE_PUBLISH, PHASE_COMM, PHASE_D1, PHASE_D2): as the
    forward's ``megakernel_phase``. PHASE_ALL is refused when the device cannot hold every program at once."""
    if shape.shared_groups:
        raise ValueError(f"megakernel_bwd_phase: the dgrad launch has no shared expert, got a launch shaped for "
                         f"{shape.shared_groups} groups of its tiles")
    variant = _variant(bufs, weights, shape, swiglu_limit)
    if variant.gemm == "tma" and rows.dy_VRH.is_cuda:
        _set_triton_allocator()  # the compute programs make their TMA descriptors in the launch's global scratch
    has_limit = swiglu_limit is not None
    if phase == PHASE_ALL:
        max_programs = co_resident_programs_bwd(rows.dy_VRH.device.index, variant)
        if shape.programs > max_programs:
            raise RuntimeError(
                f"mok megakernel backward: {shape.programs} programs ({shape.hosted_ranks} ranks x "
                f"({shape.comm_programs} communication + {shape.compute_programs} compute)) exceed the {max_programs} "
                "this device runs at once, so its spin-waits could deadlock: use fewer programs per rank")
    args = _args(bufs, schedule, weights, rows, shape, epoch, -1 if stall_rank is None else stall_rank,
                 int(timeout_ms * 1000), tiles, items, float(swiglu_limit) if has_limit else 0.0)
    _megakernel_bwd[(shape.programs,)](*args, **_constexprs(variant, phase))


def _check_precision(bufs: BackwardBuffers, weights, shape: LaunchShape) -> None:
    """bf16 buffers take bf16 weights; MXFP8 buffers the weights' MXFP8 dgrad operands, as the Triton grouped FFN's
    backward reads them (blocked along K in MMA order, contiguous), with H, I and block_n multiples of 32."""
    names = ("w_gate", "w_up", "w_down")
    mx = [isinstance(w, MXTensor) for w in weights]
    if mx != [bufs.mx] * 3:
        raise TypeError(f"megakernel_bwd_launch: {'MXFP8' if bufs.mx else 'bf16'} buffers need the weights "
                        f"{'all as MXTensors (their dgrad operands)' if bufs.mx else 'all bf16'}; got MXTensor: "
                        f"{dict(zip(names, mx))}")
    if not bufs.mx:
        return
    dim_h, dim_i = _dims(weights)
    for name, w, shape_nk in zip(names, weights, ((dim_h, dim_i), (dim_h, dim_i), (dim_i, dim_h))):
        if (w.dim != 2 or not w.mma_order or tuple(w.data.shape[1:]) != shape_nk
                or w.scale.shape != (*w.data.shape[:2], w.data.shape[2] // MX_BLOCK)
                or not (w.data.is_contiguous() and w.scale.is_contiguous())):
            raise ValueError(f"megakernel_bwd_launch: {name} must be its MXFP8 dgrad operand [V·L, {shape_nk[0]}, "
                             f"{shape_nk[1]}], blocked along K (dim 2) in MMA order, contiguous, as "
                             f"grouped_ffn.weight_operand(w, 'mxfp8', 1, name) makes it; got dim {w.dim}, mma_order "
                             f"{w.mma_order}, data {tuple(w.data.shape)}, scale {tuple(w.scale.shape)}")
    if dim_h % MX_BLOCK or dim_i % MX_BLOCK or shape.block_n % MX_BLOCK:
        raise ValueError(f"megakernel_bwd_launch: MXFP8 needs H ({dim_h}), I ({dim_i}) and block_n "
                         f"({shape.block_n}) to be multiples of {MX_BLOCK}")
    want = (shape.hosted_ranks, bufs.ring_tiles, bufs.block_m, dim_i)
    for name, t in (("dgate_mx_VQMI", bufs.dgate_mx_VQMI), ("dup_mx_VQMI", bufs.dup_mx_VQMI)):
        if tuple(t.shape) != want or t.dtype != torch.bfloat16 or not t.is_contiguous():
            raise ValueError(f"megakernel_bwd_launch: bufs.{name} must be bf16 contiguous {list(want)}, got "
                             f"{t.dtype} {list(t.shape)}")


def tma_loads_fit(dim_h: int, dim_i: int, mx: bool) -> bool:
    """Whether gemm = "tma" may read the dgrad launch's operands (``check_tma_loads``)."""
    step = MX_BLOCK if mx else BLOCK_K
    return dim_h % step == 0 and dim_i % step == 0


def check_tma_loads(caller: str, key: str, dim_h: int, dim_i: int, mx: bool) -> None:
    """The sizes gemm = "tma" (named ``key`` by the caller) needs (module docstring, GEMM loads): H and I multiples of
    the GEMMs' K step (bf16 BLOCK_K, MXFP8 32), so that no block along K runs past an expert's rows (a bf16 weight's
    K runs along its rows: such a block would add the next expert's rows into the sum); so also 16-byte rows."""
    step = MX_BLOCK if mx else BLOCK_K
    if not tma_loads_fit(dim_h, dim_i, mx):
        raise ValueError(f"{caller}: {key} = 'tma' reads the dgrad launch's operands by TMA in {step}-wide K steps, "
                         f"none past an expert's rows: H ({dim_h}) and I ({dim_i}) must be multiples of {step} "
                         f"({'MXFP8' if mx else 'bf16'}), else use {key} = 'ptr'")


def _check_tma_starts(bufs: BackwardBuffers, weights, rows: GroupedRows) -> None:
    """What the TMA descriptors read must start 16-byte aligned: the weights (MXFP8: their E4M3 bits), the ring, and
    D2's A operands (bf16: the grouped dgate, dup rows; MXFP8: the slots' tiles)."""
    a_operands = ((("dgate_mx_VQMI", bufs.dgate_mx_VQMI), ("dup_mx_VQMI", bufs.dup_mx_VQMI)) if bufs.mx else
                  (("rows.dgate_VRI", rows.dgate_VRI), ("rows.dup_VRI", rows.dup_VRI)))
    named = (*zip(("w_gate", "w_up", "w_down"), _weight_bits(weights)[0]), ("ring_VQMH", bufs.ring_VQMH), *a_operands)
    for name, t in named:
        if t.data_ptr() % 16:
            raise ValueError(f"megakernel_bwd_launch: gemm = 'tma' reads {name} by TMA, which needs a 16-byte aligned "
                             f"start: its data starts {t.data_ptr() % 16} bytes past one (or use gemm = 'ptr')")


def megakernel_bwd_launch(bufs: BackwardBuffers, schedule, weights, rows: GroupedRows, shape: LaunchShape, *,
                          epoch: int, swiglu_limit: float | None, serialized: bool, stall_rank: int | None = None,
                          timeout_ms: float = 10_000.0, phase_barrier: Callable[[], None] | None = None) -> None:
    """The dgrad's one launch (``serialized``: its phases one after another, as the forward's; ``phase_barrier``:
    the group's barrier after the publish and after the last round, as the forward's ``megakernel_launch``).

    schedule: (group_end_VL, tile_end_VL, row_slot_VR) int32 of the hosted ranks; weights: (w_gate [V·L, I, H],
    w_up [V·L, I, H], w_down [V·L, H, I]) bf16 contiguous, or for MXFP8 buffers (``bufs.mx``) their dgrad operands
    (``grouped_ffn.weight_operand(w, "mxfp8", 1, name)``: MXTensors [V·L, H, I], [V·L, H, I], [V·L, I, H] blocked
    along K in MMA order); rows: [V, R, ·] bf16 contiguous. ``stall_rank``: a rank whose communication programs
    publish nothing (tests of the bounded waits)."""
    if not 1 <= epoch <= MAX_EPOCH:
        raise ValueError(f"megakernel_bwd_launch: epoch = {epoch} must be in [1, {MAX_EPOCH}]")
    if shape.gemm not in GEMM_LOADS:
        raise ValueError(f"megakernel_bwd_launch: gemm = {shape.gemm!r} must be one of {GEMM_LOADS}")
    _check_precision(bufs, weights, shape)
    if shape.gemm == "tma":
        check_tma_loads("megakernel_bwd_launch", "gemm", *_dims(weights), bufs.mx)
        _check_tma_starts(bufs, weights, rows)
    ring, group = bufs.ring_tiles, shape.group_tiles
    if (shape.lag + 1) * group > ring:
        raise ValueError(f"megakernel_bwd_launch: (lag + 1) x group_tiles = ({shape.lag} + 1) x {group} must be <= "
                         f"the {ring} ring tiles (kernels/mok_megakernel.py: deadlock freedom)")
    run = functools.partial(megakernel_bwd_phase, bufs, schedule, weights, rows, shape, epoch=epoch,
                            swiglu_limit=swiglu_limit, stall_rank=stall_rank, timeout_ms=timeout_ms)
    if not serialized:
        run(PHASE_ALL)
        return
    sync_peers = phase_barrier if phase_barrier is not None else (lambda: None)
    run(PHASE_PUBLISH)
    sync_peers()
    # the host knows an upper bound of the tiles (no sync): every row in its own expert's tiles
    max_tiles = triton.cdiv(shape.ep_degree * shape.num_tokens * shape.top_k, bufs.block_m) + shape.num_local
    dim_h, dim_i = _dims(weights)
    first_item = functools.partial(shape.first_item, dim_h=dim_h, dim_i=dim_i, shared_dim=0)
    for n in range(triton.cdiv(max_tiles, ring)):  # a round: the ring's tiles pulled, their D1 items, their D2 items
        lo, hi = n * ring, (n + 1) * ring
        steps = (lo // group, triton.cdiv(hi, group))  # the steps holding the window's D1 items
        run(PHASE_COMM, tiles=(lo, hi))
        run(PHASE_D1, tiles=(lo, hi), items=(first_item(steps[0]), first_item(steps[1])))
        run(PHASE_D2, tiles=(lo, hi), items=(first_item(steps[0] + shape.lag), first_item(steps[1] + shape.lag)))
    sync_peers()


def megakernel_bwd_finish(bufs: BackwardBuffers, dx_VTH: torch.Tensor, shape: LaunchShape, *, arrivals: int,
                          serialized: bool, trap: bool, timeout_ms: float = 10_000.0) -> None:
    """dx[v, t] = cast(Σ_j dx_slots_v[t, j]) in fp32, ascending j, once token t's K rows have arrived: its arrival
    counter holds ``arrivals`` (every call so far's rows per token, summed; ``trap``: a recorded error stops the
    device with an assertion naming the wait)."""
    num_tokens, dim_h = dx_VTH.shape[1:]
    if num_tokens == 0:
        return
    block_h = 1024
    grid = (shape.hosted_ranks * num_tokens, triton.cdiv(dim_h, block_h))
    _finish_bwd_kernel[grid](bufs.tables["dx_slots_NH"], bufs.tables["arrivals_T"], dx_VTH, bufs.errors,
                             shape.first_rank, arrivals, int(timeout_ms * 1000), num_tokens, dim_h,
                             K=shape.top_k, SERIAL=serialized, TRAP=trap, BLOCK_H=block_h, enable_fp_fusion=False)

