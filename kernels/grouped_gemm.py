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
  and a two-term sum (dx). On CUDA a bf16 kind with a ``"bf16_ws/<kind>"`` config runs
  ``grouped_mm_ws``, or, where that config says ``COOPERATIVE`` (the plain and SwiGLU gate/up kinds, contiguous
  weights), ``grouped_mm_coop``: the same bits.
- ``grouped_wgrad``: ``c_ENK[e] = a_RN[rows of e].T @ b_RK[rows of e]``, each expert's rows read
  by TMA through descriptors the kernel makes over them (rows past the expert's end read as zeros;
  on CUDA from 64 rows per expert on, and below for a gradient with N > K, ``grouped_wgrad_ws``: the same bits,
  warp-specialized);
  ``grouped_wgrads``: several such pairs, an operand shared by two quantized once for MXFP8.

Precision: bf16 operands, or MXFP8 (DESIGN §6). Weights arrive as ``MXTensor`` blocked along
K (quantized once per pass by ``mxfp8_quantize``, in the layout each GEMM reads; the MoE layer's
in MMA order, ``MXTensor.mma_order``). Activations
are quantized once per GEMM by a one-pass kernel with the reference rule (``mx_quantize_block``),
along K for grouped_mm and along the token axis for grouped_wgrad (blocks of 32 rows starting at
each group's first row; a group's last block is zero-padded), so no tile re-quantizes its A.
Default (``_grouped_mm_tma_kernel``, bf16 and MXFP8): operand tiles by TMA; an MXFP8 weight
tile is dequantized in registers one 32-wide scale block at a time (E4M3 * 2^e -> bf16, exact)
and reaches the bf16 tensor cores through shared memory, against bf16 activations holding the
MXFP8 values; the scales of block k+1 are loaded while block k runs. On CUDA, the MXFP8 kinds
with a ``"mxfp8_ws/<kind>"`` config and K a multiple of 128 run ``grouped_mm_ws`` instead: the same
bits, computed transposed with the dequantized weights as the MMA's register operand, a TMA loader
warp and two consumer warpgroups (for three kinds persistent: one program per SM looping over
tiles). fp32 accumulation, each output tile computed by one program, fixed K order: no split-K, no
atomics, run-to-run deterministic.

Row-batch invariance: every row goes through the same instruction sequence whatever its group's
size or its position in a tile. Tile shapes (``_MM_CONFIGS``; per chip, ``mm_configs``) depend on the kind of GEMM
and the precision, and the token tile also on the rows held per expert (``_mm_config``): a row's bits do
not follow the token tile (each MMA sums a row's K in the same order whatever its M or N; a GPU
test compares 64-, 128- and 256-token tiles bit for bit), so that choice keeps them.

Grid: tiles are enumerated expert by expert (tile prefix sums computed on the device), and
within an expert in GROUP_M-row super-tiles, so the programs of one expert's N-tiles run side
by side and each weight tile is read from HBM once per pass while an expert has <= BM rows
(the MoE regime: tens of rows per expert).
"""

import functools
import os

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation as triton_allocation
from triton.tools.tensor_descriptor import TensorDescriptor

from titan_mok.kernels import grouped_mm_coop, grouped_mm_ws, grouped_wgrad_ws
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

# Tile configs per kind of GEMM and precision ("<precision>/<mode>"), module-level so benchmarks
# can try others. Only the token tile BM may follow the number of rows (``_mm_config``): tests
# hold a row's bits equal across it, on the GPU and the interpreter (BK, by contrast, changes the
# interpreter's rounding). On the MXFP8 path the K loop takes one 32-wide scale block per TMA
# load (BK: how many it unrolls). Chosen by `python -m titan_mok.bench.grouped_ffn --tune` on an
# H200 (benchmarks/NOTES.md, 2026-12-01); bf16/dual's 128 x 256 tiles by a wider sweep over all
# four shapes (session 9). A chip whose own A/Bs chose otherwise reads a table of its own (_CHIP_MM_CONFIGS).
_MODE_NAMES = {PLAIN: "plain", SWIGLU: "swiglu", SWIGLU_BWD: "swiglu_bwd", DUAL: "dual"}
_MM_CONFIGS = {
    # HALF_TILES (BM >= 128; any BM on the warp-specialized kernel): a tile holding at most BM / 2 of its
    # expert's rows runs BM / 2-row MMAs
    # (an expert's last tile; with skewed routing most light experts' only one): with skewed routing
    # 5-10% faster per kind at EP=2 (GLM-5.2's dual level) and up to 11% at EP=1; within +-4% with
    # balanced routing and at 8 x 4096 rows (NOTES.md, session 12).
    "bf16/plain": dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=4, num_stages=3, HALF_TILES=True),
    "bf16/swiglu": dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4, HALF_TILES=True),
    "bf16/swiglu_bwd": dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4, HALF_TILES=True),
    "bf16/dual": dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=4, HALF_TILES=True),
    # bf16 on CUDA: the warp-specialized Gluon kernel (grouped_mm_ws, the wgmmas reading the bf16 weights from
    # shared memory) where a config is given, else (None) the Triton kernel above. Against the Triton kernel,
    # four shapes, EP=1 and EP=2 (balanced and skewed) and 8 x 4096 rows: plain and SwiGLU gate/up within -6% to
    # +7%, dual 3-32% slower (persistent, and one program per tile), the SwiGLU backward persistent 9-14% faster
    # at 8 x 4096 only (bits equal; NOTES.md, session 23). The SwiGLU backward with one program per tile at EP=2
    # (65-2047 rows per expert): 4-17% faster in 7 of 8 (shape, routing) cases, DeepSeek-V4-Pro skewed level
    # (session 24); at few rows it stays on the Triton kernel (persistent: 8-12% slower at EP=1, session 23).
    "bf16_ws/plain": None,
    "bf16_ws/swiglu": None,
    "bf16_ws/swiglu_bwd": dict(BM=128, BN=128, GROUP_M=8, PERSISTENT=False, STAGES=3, CONSUMER_REGS=232, num_warps=4,
                               HALF_TILES=True, SPLIT_TILES=True),
    "bf16_ws/swiglu_bwd@few_rows": None,
    "bf16_ws/dual": None,
    "mxfp8/plain": dict(BM=128, BN=128, BK=32, GROUP_M=8, num_warps=4, num_stages=3),
    "mxfp8/swiglu": dict(BM=128, BN=64, BK=32, GROUP_M=8, num_warps=4, num_stages=3),
    "mxfp8/swiglu_bwd": dict(BM=128, BN=128, BK=32, GROUP_M=8, num_warps=4, num_stages=3),
    "mxfp8/dual": dict(BM=128, BN=128, BK=32, GROUP_M=8, num_warps=4, num_stages=3),
    # MXFP8 on CUDA: the warp-specialized Gluon kernel (grouped_mm_ws) where it measured faster, else
    # (None) the Triton kernel above. BN is fixed at 128 (two warpgroups of 64 weight rows); BM tokens
    # per tile; STAGES loads in flight (each grouped_mm_ws.KB K blocks); CONSUMER_REGS the registers
    # per thread asked for the second consumer warpgroup (a worker partition of warp_specialize);
    # PERSISTENT: one program per SM looping over tiles, else one program per tile; maxnreg (optional)
    # caps the kernel's registers per thread, so that two programs fit on an SM. HALF_TILES as for bf16
    # (64-token MMAs; 0.4-7.2% faster for the dgrad kinds, session 12). SPLIT_TILES: a tile holding 65-96
    # of its expert's rows runs 64 + 32-token MMAs, 3/4 of the padded work (EP=2: 80-85 rows per expert at
    # Kimi K2.7 and Qwen3.5). With the 16-byte stores (spills 408 -> 0-24 B), both together 4-13% faster
    # than 16-byte stores alone at EP=2 and level at 8 x 4096 rows; at EP=1 the half tiles in 128-token
    # programs were 2-4% slower than 64-token tiles, hence the "@few_rows" entries (NOTES.md, session 20).
    # ROW_BLOCKS = 2 (plain): a tile is two 128-row blocks of the weight against one activation tile, each
    # warpgroup 64 rows of both on two accumulators as SwiGLU gate/up runs its two weights, so the activation
    # bytes through L2 and the loader's TMAs halve; three stages to fit shared memory (200 KB). Faster in all
    # four A/Bs, Kimi K2.7 EP=2 balanced (twice) and skewed 4.8-6.1%, Qwen3.5 EP=2 balanced 11%, bits equal
    # (same-run A/As of the unchanged kinds: -14% to +2%; NOTES.md, session 21). The dual kind the same way
    # (each of its two weights' load brings that weight's next 128 rows): 5.3-11% faster at EP=2, Kimi K2.7,
    # GLM-5.2 and Qwen3.5, balanced and skewed, bits equal (A/As: -3.8% to +3.4%; session 22).
    # Three consumer warpgroups instead (BN = 192, one row block: each one's dequantization hidden behind the other
    # two's MMAs) were 6-9% faster than two at one row block but level to 10% slower than two row blocks, and with
    # both at 64-token tiles 1.5-12% slower (one H100, NOTES.md, session 33): not kept.
    "mxfp8_ws/plain": dict(BM=128, BN=128, GROUP_M=8, PERSISTENT=True, STAGES=3, CONSUMER_REGS=232, num_warps=4,
                           HALF_TILES=True, SPLIT_TILES=True, ROW_BLOCKS=2),
    "mxfp8_ws/swiglu": dict(BM=128, BN=128, GROUP_M=8, PERSISTENT=False, STAGES=2, CONSUMER_REGS=232, num_warps=4,
                            HALF_TILES=True, SPLIT_TILES=True),
    "mxfp8_ws/swiglu_bwd": dict(BM=128, BN=128, GROUP_M=8, PERSISTENT=True, STAGES=3, CONSUMER_REGS=248, num_warps=4,
                                HALF_TILES=True, SPLIT_TILES=True),
    "mxfp8_ws/dual": dict(BM=128, BN=128, GROUP_M=8, PERSISTENT=True, STAGES=3, CONSUMER_REGS=232, num_warps=4,
                          HALF_TILES=True, SPLIT_TILES=True, ROW_BLOCKS=2),
    # At few rows per expert (below): 64-token tiles halve the accumulators, so two programs fit on an
    # SM (80 registers per thread, 104 for the consumers, two loads in flight) and hide each other's
    # latencies: the dgrad kinds 1-13% faster per kind and case (the dgrad 6-9% at EP=1; dual has since left
    # it, below); plain was level and SwiGLU gate/up (two accumulators) spills (NOTES.md, session 11). Plain
    # and SwiGLU gate/up keep the 64-token tiles they had before their 128-token configs took HALF_TILES: those
    # configs' half tiles were 2-12% slower here with balanced routing, level to 11% slower with skewed (session
    # 20).
    # Plain's two weight row blocks per 64-token tile (as at 128 tokens, above): 7.9-16% faster at EP=1 in
    # all four shapes, balanced and skewed, bits equal (A/As: -3.6% to +3.4%; session 22).
    # HALF_TILES on these 64-token tiles (the Gluon kernel's tokens are its MMAs' N, so 32 is allowed): a tile
    # holding at most 32 of its expert's rows runs 32-token MMAs. DeepSeek-V4-Pro at EP=1 (32 rows per expert):
    # all four kinds 5-12% faster, balanced and skewed, bits equal (A/As -5.1% to +4.4%; NOTES.md, session 24).
    "mxfp8_ws/plain@few_rows": dict(BM=64, BN=128, GROUP_M=8, PERSISTENT=True, STAGES=4, CONSUMER_REGS=232,
                                    num_warps=4, ROW_BLOCKS=2, HALF_TILES=True),
    "mxfp8_ws/swiglu@few_rows": dict(BM=64, BN=128, GROUP_M=8, PERSISTENT=False, STAGES=2, CONSUMER_REGS=232,
                                     num_warps=4, HALF_TILES=True),
    "mxfp8_ws/swiglu_bwd@few_rows": dict(BM=64, BN=128, GROUP_M=8, PERSISTENT=False, STAGES=2, CONSUMER_REGS=104,
                                         maxnreg=80, num_warps=4, HALF_TILES=True),
    # Dual's two weight row blocks per 64-token tile, one program per SM (as plain's): 2-7.5% faster in all 10
    # few-rows (shape, routing) cases, bits equal (A/As -3.0% to +2.7%; NOTES.md, session 24; session 22's shorter
    # A/B: 3-6.5% in 4 of 4).
    "mxfp8_ws/dual@few_rows": dict(BM=64, BN=128, GROUP_M=8, PERSISTENT=True, STAGES=4, CONSUMER_REGS=232,
                                   num_warps=4, ROW_BLOCKS=2, HALF_TILES=True),
    # The bf16 SwiGLU backward at 128 tokens spills (255 registers); its 64-token tiles were 4.6-8%
    # faster than HALF_TILES' 64-row path in the 128-token kernel at EP=1, skewed routing (session 12).
    "bf16/swiglu_bwd@few_rows": dict(BM=64, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4),
    # At many rows per expert (the compute regime): 256-token tiles double the MMA time per dequantized
    # weight load, which is what lets the two consumer warpgroups hide each other's dequantization; two
    # stages to fit shared memory. 8 experts x 2048 and x 4096 rows, all four shapes: plain 4-11% and dual
    # 7-13% faster; at 1024 rows mixed (NOTES.md, session 17). SwiGLU gate/up (two accumulators) cannot
    # fit, its backward spills.
    # bf16 dgrad kinds at many rows: the Triton kernel persistent (PERSISTENT: one program per SM, the
    # tile loop flattened into the K loop, so the next tile's loads can overlap this one's epilogue).
    # 8 x 4096 rows, four shapes, two runs: 0.4-3.9% faster in all 8 (kind, shape) pairs, about the
    # spread of an A/A; SwiGLU gate/up and plain were 3-30% slower persistent (NOTES.md, session 18).
    "bf16/swiglu_bwd@many_rows": dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4, PERSISTENT=True),
    # bf16 SwiGLU backward at many rows: the warp-specialized kernel (above), 9-14% faster than this Triton config
    # in all four shapes at 8 x 4096 rows, same bits (NOTES.md, session 23).
    "bf16_ws/swiglu_bwd@many_rows": dict(BM=128, BN=128, GROUP_M=8, PERSISTENT=True, STAGES=3, CONSUMER_REGS=232,
                                         num_warps=4, HALF_TILES=True, SPLIT_TILES=True),
    "bf16/dual@many_rows": dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=4, PERSISTENT=True),
    "mxfp8_ws/plain@many_rows": dict(BM=256, BN=128, GROUP_M=8, PERSISTENT=True, STAGES=2, CONSUMER_REGS=240,
                                     num_warps=4),
    "mxfp8_ws/dual@many_rows": dict(BM=256, BN=128, GROUP_M=8, PERSISTENT=True, STAGES=2, CONSUMER_REGS=240,
                                    num_warps=4, HALF_TILES=True),
}
# bf16 plain at many rows (the forward's down projection): plain's own config, a key of its own so that a chip can
# replace it (the H100 does, below); persistent tiles were 3-30% slower on the H200 (session 18).
_MM_CONFIGS["bf16/plain@many_rows"] = dict(_MM_CONFIGS["bf16/plain"])
_MM_CONFIGS["bf16_ws/plain@many_rows"] = None  # the Triton kernel (the H100 replaces it: grouped_mm_coop's)
_MM_CONFIGS["bf16_ws/swiglu@many_rows"] = None  # likewise
# Rows tiers, from the experts' average rows (the operand's row count, padding included, so the host
# never syncs); a kind's "<key>@<tier>" config runs where there is one.
# - "few_rows", at most _FEW_ROWS on average (the MoE regime at EP=1): else the kind's config with
#   _FEW_ROWS-token tiles instead of a BM whose MMAs would run mostly on padding rows: balanced routing
#   at 32-64 rows per expert, 8-30% faster for every kind in both precisions (NOTES.md, session 9).
# - "many_rows", at least _MANY_ROWS on average (few experts per GPU, or the compute regime).
_FEW_ROWS = 64
_MANY_ROWS = 2048
# A chip whose own A/Bs chose otherwise has a table of its own (keyed by torch.cuda.get_device_name): the table above
# with those entries replaced. The table above was chosen on H200s; the H100 (SXM) has the same tensor cores beside HBM
# at 0.70x the H200's bandwidth (NOTES.md, session 31).
_H100 = "NVIDIA H100 80GB HBM3"
_CHIP_MM_CONFIGS = {
    # MXFP8 SwiGLU gate/up on 3 ring slots instead of 2, and at few rows per expert plain and dual on 3 instead of 4
    # (one H100, NOTES.md session 34; bits equal everywhere; same-run A/As of the unchanged kinds -2.8% to +4.4%, one
    # line +27%). The H200's entries as the variant took, against these: SwiGLU gate/up 1.052-1.070x at Kimi K2.7,
    # Qwen3.5 and GLM-5.2 EP=2 (DeepSeek-V4-Pro EP=2 0.99-1.00x) and 1.034-1.057x in the few-rows cases (those three at
    # EP=1, DeepSeek-V4-Pro at EP=2), dual 1.005-1.054x and plain 0.996-1.027x there; the forward A/Bs before them read
    # the same way (SwiGLU gate/up 0.941-0.982x, dual 0.930-0.987x, plain 0.937-1.009x, faster in 13 of 18 lines).
    # Not measured on an H200. At 128-token tiles plain and dual on 2 slots were 1.6-3.9% slower.
    # bf16 plain at many rows persistent on 128 x 256 tiles, 8 warps, 4 stages (as the dual kind's): 8 x 4096 rows, the
    # forward's down projection, 0.815-0.866x the time in one run and 0.789-0.872x in another, four shapes, bits equal
    # (A/As of the other kinds 0.974-1.011); it had run at ~500 TFLOP/s against torch._grouped_mm's ~657 (NOTES.md,
    # session 35). 128 x 128 persistent on 8 warps 0.89-0.93x, 128 x 256 not persistent 0.95-1.04x.
    # Both forward kinds at many rows on the cooperative kernel (grouped_mm_coop: each tile's TMA stores under the next
    # tile's MMAs), bits equal: plain 0.945-0.972x the persistent Triton kernel's time (session 37); SwiGLU gate/up on
    # 4 ring slots 0.938-0.988x the Triton kernel's, and the Triton kernel as the variant 1.015-1.085x (3 slots:
    # 1.002-1.038x). With them (and the padding rows zeroed alone) the compute regime's forward took 0.91-0.96x
    # torch._grouped_mm's time in all four shapes (NOTES.md, session 38).
    _H100: {**_MM_CONFIGS, **{key: {**_MM_CONFIGS[key], "STAGES": 3} for key in (
        "mxfp8_ws/swiglu", "mxfp8_ws/swiglu@few_rows", "mxfp8_ws/plain@few_rows", "mxfp8_ws/dual@few_rows")},
            "bf16/plain@many_rows": dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=4, PERSISTENT=True),
            "bf16_ws/plain@many_rows": dict(BM=128, BN=256, BK=64, GROUP_M=8, STAGES=3, CONSUMER_REGS=232, num_warps=4,
                                            COOPERATIVE=True),
            "bf16_ws/swiglu@many_rows": dict(BM=128, BN=128, BK=64, GROUP_M=8, STAGES=4, CONSUMER_REGS=232,
                                             num_warps=4, COOPERATIVE=True)},
}
_INTERPRETED_PROGRAMS = 1  # a PERSISTENT config's programs under Triton's interpreter: one loops over all tiles
# Weight gradient: the flat loop while experts average fewer than _WGRAD_FLAT_MAX_ROWS rows (a
# static property of the shapes, so the choice never depends on the routing), else the row loop;
# each with its tiles (BR rows summed per MMA step; same bits for any BR on the GPU: NOTES.md,
# session 8). The flat loop's K tiles are split among more programs when there would be fewer than
# _WGRAD_MIN_PROGRAMS, and for experts with more rows than average (_wgrad_programs). Measured
# 2026-12-01. The row loop runs PERSISTENT (one program per SM looping over the (features, K tile)
# pairs): at 8 x 4096 rows, four shapes, faster in 10 of 12 weight gradients in each of two runs, by
# up to 3.7% (about 1% typical); the flat loop with two programs per SM was mixed (NOTES.md, session 19).
_WGRAD_CONFIGS = {
    "flat": dict(BR=32, BN=128, BK=128, num_warps=8, num_stages=3),
    "rows": dict(BR=64, BN=128, BK=256, num_warps=8, num_stages=3, PERSISTENT=True),
    # CUDA, flat loop, experts averaging >= _WGRAD_WS_MIN_ROWS rows, or fewer for a gradient with more features
    # than K columns (N > K: w_down's [E, H, I]): the warp-specialized Gluon kernel
    # (grouped_wgrad_ws, one program per SM; BN must be 128, two warpgroups of 64 features) where a config is
    # given, else (None) the Triton kernel's "flat" config. 256-wide K tiles: up to 8% faster than 128 at EP=2 in
    # 21 of 24 (shape, routing, weight) lines, the other 3 within 1.3%. Against this config at EP=2 the Triton kernel
    # takes 1.05-1.32x the time, DeepSeek-V4-Pro balanced 0.97-1.05x, GLM-5.2 EP=1 (64 rows) 0.98-1.04x; at 32-43
    # rows per expert (EP=1) the Triton kernel was faster in 14 of 18 lines, hence the threshold (NOTES.md,
    # session 26; session 25 for BK 128). STORER_WARPS warps store the tiles (STORER_REGS registers each): two
    # were 0.935-0.953x the time of the consumers storing their own tiles in 7 of 8 EP=2 cases. With them, at
    # 32-43 rows the Gluon kernel took 0.84-1.00x the Triton kernel's time for w_down's gradient in all 6 (shape,
    # routing) cases (session 26, without them: 4 of 6), 0.98-1.05x for w_gate's and w_up's (session 30).
    "flat_ws": dict(BR=32, BN=128, BK=256, STAGES=6, CONSUMER_REGS=232, STORER_WARPS=2, STORER_REGS=64, num_warps=4),
    # The same kernel where experts average >= _WGRAD_WS_LONG_STEPS_MIN_ROWS rows (None: "flat_ws" there too): 64-row
    # MMA steps, half as many as 32-row ones and, from 128 rows, padding the rows hardly more; 3 ring slots, to fit.
    # GLM-5.2 EP=2 (128 rows per expert): 0.905 / 0.953 of the 32-row steps' time summed over the three weights on
    # the H200 (balanced / skewed; NOTES.md session 30), 0.966-1.012 per weight on the H100 (session 31). At 80-85
    # rows (Kimi, Qwen3.5 EP=2), where 64-row steps pad an expert to 128 rows and 32-row steps to 96, they were
    # 0.99-1.11x on the H200 while 0.96-0.995x on the H100; at 64 rows (DeepSeek-V4-Pro EP=2) 0.98-0.99x and 1.00-1.01x.
    "flat_ws_long": dict(BR=64, BN=128, BK=256, STAGES=3, CONSUMER_REGS=232, STORER_WARPS=2, STORER_REGS=64,
                         num_warps=4),
}
# CUDA, many rows per expert: the Gluon kernel on the row loop's programs (one K tile each) where a config is given,
# else (None) the Triton kernel's "rows" config. flat_ws_long's config (64-row MMA steps, 3 ring slots) at 8 x 4096
# rows took 0.925-0.991x the Triton row loop's time in all 12 (shape, weight) lines of config_ab's 7 alternating
# rounds, bits equal; 32-row steps on 6 slots 0.929-1.013x (one H100, NOTES.md session 40; the H200's tensor cores
# are the same and this regime is MMA-bound, but it was not measured there). A copy: config_ab varies each alone.
_WGRAD_CONFIGS["rows_ws"] = dict(_WGRAD_CONFIGS["flat_ws_long"])
_WGRAD_WS_MIN_ROWS = 64
_WGRAD_WS_LONG_STEPS_MIN_ROWS = 128
# Per chip (as _CHIP_MM_CONFIGS): on the H100 the 64-row steps from 80 rows per expert (Kimi K2.7 and Qwen3.5 at EP=2):
# 0.958-0.994x the time of 32-row steps at Kimi and 0.975-1.004x at Qwen3.5 (session 31 and 34's runs, faster in 23 of
# 24 lines), and in reverse the 32-row steps 0.998-1.030x (11 of 12 slower); at 64 rows (DeepSeek-V4-Pro EP=2)
# 0.997-1.019x, so not there (NOTES.md, sessions 31 and 34).
_CHIP_WGRAD_WS_LONG_STEPS_MIN_ROWS = {_H100: 80}
_WGRAD_FLAT_MAX_ROWS = 512
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


def ref_grouped_mm(a_RK: torch.Tensor, group_end_E: torch.Tensor, b_ENK: torch.Tensor, precision: str) -> torch.Tensor:
    """fp32 c_RN[r] = a_RK[r] @ b_ENK[e(r)].T on the exact operand values (MXFP8 along K)."""
    a_RK = _operand_fp32(a_RK, precision, -1, "a_RK")
    b_ENK = _operand_fp32(b_ENK, precision, -1, "b_ENK")
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
    s1_next = _scale_bits(s_ptrs1, 0, n_ok, k_end, stride_sk, MX)
    if MODE == 1:
        s2_next = _scale_bits(s_ptrs2, 0, n_ok, k_end, stride_sk, MX)
    for k0 in range(0, k_end, BK):
        for j in tl.static_range(BK // KB):
            k = k0 + j * KB
            s1 = s1_next
            s1_next = _scale_bits(s_ptrs1, k + KB, n_ok, K, stride_sk, MX)
            a = a1_desc.load([m0, k])
            acc1 = _dot(a, _b_tile(b1_desc, e, n0, k, N, K, s1, B_KN, MMA_ORDER, MX), acc1, DOT_F32)
            if MODE == 1:  # SWIGLU: the second B (w_up) shares the A tile
                s2 = s2_next
                s2_next = _scale_bits(s_ptrs2, k + KB, n_ok, K, stride_sk, MX)
                acc2 = _dot(a, _b_tile(b2_desc, e, n0, k, N, K, s2, B_KN, MMA_ORDER, MX), acc2, DOT_F32)
    if MODE == 3:  # DUAL: acc1 += A2 @ B2, continuing the same fixed K order
        s2_next = _scale_bits(s_ptrs2, 0, n_ok, k_end, stride_sk, MX)
        for k0 in range(0, k_end, BK):
            for j in tl.static_range(BK // KB):
                k = k0 + j * KB
                s2 = s2_next
                s2_next = _scale_bits(s_ptrs2, k + KB, n_ok, K, stride_sk, MX)
                b = _b_tile(b2_desc, e, n0, k, N, K, s2, B_KN, MMA_ORDER, MX)
                acc1 = _dot(a2_desc.load([m0, k]), b, acc1, DOT_F32)

    c_off = rows[:, None].to(tl.int64) * N + offs_n[None, :]
    _epilogue(acc1, acc2, c_off, row_ok[:, None] & n_ok[None, :], c1_ptr, c2_ptr, c3_ptr, g_ptr, u_ptr, limit, MODE,
              HAS_LIMIT)


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
    # A TMA box needs at least one row: an expert without rows gets a one-row descriptor and its
    # single row block starts past it (skip), so it too reads zeros and stores a zero gradient.
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


def _tile_ends(group_end_E: torch.Tensor, rows_per_tile: int, tiles_per_rows: int) -> torch.Tensor:
    """Cumulative tile counts per expert (int32, on the device: no host sync)."""
    counts_E = torch.diff(group_end_E, prepend=group_end_E.new_zeros(1))
    return (torch.div(counts_E + rows_per_tile - 1, rows_per_tile, rounding_mode="floor") * tiles_per_rows).cumsum(0).to(
        torch.int32
    )


def _launch_mm(mode, a1, a2, b1, b2, group_end_E, outs, gu=(None, None), swiglu_limit=None, warp_specialized=None):
    """warp_specialized: the Gluon kernel of grouped_mm_ws; None picks it on CUDA outside Triton's interpreter
    where the kind's "<precision>_ws" config is not None (False: the Triton kernel it must match, for tests and
    benchmarks)."""
    b1_data, b1_s, mma_order = _b_operand(b1, "b1")
    b2_data, b2_s, mma_order2 = _b_operand(b2, "b2") if b2 is not None else (b1_data, b1_s, mma_order)
    mx = b1_s is not None
    if mma_order != mma_order2:
        raise ValueError("b1 and b2 must both be in MMA order (MXTensor.mma_order) or both not")
    num_experts, n, k = b1_data.shape
    tier, chip = rows_tier(a1.shape[0], num_experts), chip_of(b1_data)
    ws_key = mm_config_key(mode, mx, True)
    ws_cfg = _mm_config(ws_key, tier, chip)
    ws_k = 32 * grouped_mm_ws.KB  # its loads take K in blocks of ws_k
    # COOPERATIVE (the plain and SwiGLU gate/up kinds): grouped_mm_coop's kernel, which reads the weights as a
    # contiguous [E, N, K] and stores its output rows by TMA (N a multiple of 8 bf16)
    cooperative = ws_cfg is not None and ws_cfg.get("COOPERATIVE", False)
    if cooperative and mode not in (PLAIN, SWIGLU):
        raise ValueError(f"{ws_key}: COOPERATIVE is for the plain and SwiGLU gate/up kinds only")
    coop_readable = b1_data.is_contiguous() and b2_data.is_contiguous() and n % 8 == 0
    if warp_specialized is None:
        warp_specialized = (_on_cuda(b1_data) and not _DOT_F32 and ws_cfg is not None
                            and (coop_readable if cooperative else k % ws_k == 0))
    if warp_specialized and cooperative and not coop_readable:
        raise ValueError(f"{ws_key}'s cooperative kernel needs b1 (and b2) as a contiguous [E, N, K] (not a "
                         f"transposed view) and N a multiple of 8 (TMA stores of the output rows); got strides "
                         f"{b1_data.stride()}, {b2_data.stride()}, N = {n}")
    if warp_specialized and ws_cfg is None:
        raise ValueError(f"{ws_key} has no config (None: this kind runs the Triton kernel); set one to run the "
                         "warp-specialized kernel")
    if warp_specialized and not cooperative and k % ws_k:
        raise ValueError(f"the warp-specialized kernel needs K (here {k}) to be a multiple of {ws_k}; "
                         "the Triton kernel runs any K")
    cfg = ws_cfg if warp_specialized else _mm_config(mm_config_key(mode, mx), tier, chip)
    if cfg is not None and cfg.get("ROW_BLOCKS", 1) > 1 and not b1_data.is_contiguous():
        cfg = {**cfg, "ROW_BLOCKS": 1}  # two row blocks per tile: measured on [E, N, K] weights only (the FFN's)
    if a1.shape[1] != k:
        raise ValueError(f"A operand has K = {a1.shape[1]}, B has K = {k}")
    if group_end_E.shape != (num_experts,):
        raise ValueError(f"group_end_E must be [{num_experts}], got {tuple(group_end_E.shape)}")
    if num_experts == 0 or a1.shape[0] == 0:
        return
    a1 = _a_operand(a1, mx, "a1")
    a2 = _a_operand(a2, mx, "a2") if a2 is not None else a1
    bm, bn = cfg["BM"], cfg["BN"]
    n_tiles = triton.cdiv(n, bn * cfg.get("ROW_BLOCKS", 1))  # ROW_BLOCKS: BN-row weight blocks per tile
    tile_end_E = _tile_ends(group_end_E, bm, n_tiles)
    grid = ((triton.cdiv(a1.shape[0], bm) + num_experts) * n_tiles,)  # upper bound, no host sync
    c1, c2, c3 = (list(outs) + [outs[0]] * 2)[:3]
    if warp_specialized and cooperative:
        weights = (("b1", b1_data), ("b2", b2_data))[:1 + (mode == SWIGLU)]
        descs = (_tma_descriptor(a1, [bm, cfg["BK"]], "a1", True),
                 [_tma_descriptor(b.view(num_experts * n, k), [bn, cfg["BK"]], name, True) for name, b in weights],
                 [_tma_descriptor(c, [bm // 2, bn], f"c{i + 1}", True) for i, c in enumerate(outs)])
        grouped_mm_coop.launch(descs, outs, group_end_E, tile_end_E, grid[0], swiglu_limit, **cfg)
        return
    g, u = gu if gu[0] is not None else (c1, c1)
    common = dict(HAS_LIMIT=swiglu_limit is not None, LOG_E=num_experts.bit_length(), MODE=mode, **cfg)
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
    # MXFP8 and the Gluon kernel load activations one 32-wide (scale) block at a time...
    block_k = 32 if mx or warp_specialized else cfg["BK"]
    block_kw = ws_k if warp_specialized else block_k  # ...the Gluon kernel's weights KB blocks at a time
    a_descs = [_tma_descriptor(a, [bm, block_k], name, warp_specialized) for name, a in (("a1", a1), ("a2", a2))]
    b_kn, b_descs = _weight_descriptors(b1_data, b2_data, bn, block_kw, warp_specialized)
    if b_kn and mma_order:
        raise ValueError("a weight in MMA order (MXTensor.mma_order) must be a contiguous [E, N, K], not a transposed "
                         "view")
    outs_and_groups = (c1, c2, c3, g, u, group_end_E, tile_end_E, n, k, num_experts)
    # Triton's MMAs take at least 64 tokens (a warpgroup's M); the Gluon kernel's tokens are its MMAs' N
    half = common["HALF_TILES"] = common.get("HALF_TILES", False) and (bm >= 128 or warp_specialized)
    if warp_specialized:
        persistent = common.pop("PERSISTENT")
        if mx:
            wide_E = _wide_scale_experts(b1_s, *([] if b2_s is b1_s else [b2_s]))
            s1 = _scales_by_row(b1_s)
            s2 = s1 if b2_s is b1_s else _scales_by_row(b2_s)
        else:  # bf16: no scales (never read)
            wide_E = s1 = s2 = a1
        grouped_mm_ws.launch(grid[0], persistent, *a_descs, *b_descs, s1, s2, wide_E, *outs_and_groups,
                             *s1.stride()[:2], limit, B_KN=b_kn, MMA_ORDER=mma_order, KB=grouped_mm_ws.KB, MX=mx,
                             **common)
    else:
        a_half = ([_tma_descriptor(a, [bm // 2, block_k], name) for name, a in (("a1", a1), ("a2", a2))] if half
                  else a_descs)
        sb1, sb2, s_strides = (b1_s, b2_s, b1_s.stride()) if mx else (a1, a1, (0, 0, 0))  # bf16: never read
        if common.get("PERSISTENT"):
            grid = (_persistent_programs(a1, grid[0]),)
        _grouped_mm_tma_kernel[grid](*a_descs, *a_half, *b_descs, sb1, sb2, *outs_and_groups, *s_strides, limit,
                                     MX=mx, B_KN=b_kn, MMA_ORDER=mma_order, DOT_F32=_DOT_F32, **common)


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
    return min(work_items, grouped_mm_ws.sm_count(t.device.index) if _on_cuda(t) else _INTERPRETED_PROGRAMS)


def _on_cuda(t: torch.Tensor) -> bool:
    """Whether launches for t's operands run on CUDA (titan_mok.bench.sass answers yes while compiling
    for sm_90 on the CPU, so that the kernel choice is CUDA's)."""
    return t.is_cuda


def rows_tier(rows: int, num_experts: int) -> str:
    """The rows tier ("few_rows", "many_rows" or "") of experts averaging rows / num_experts rows."""
    if rows <= _FEW_ROWS * num_experts:
        return "few_rows"
    return "many_rows" if rows >= _MANY_ROWS * num_experts else ""


@functools.cache
def _device_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


def chip_of(t: torch.Tensor) -> str:
    """The chip t's launches run on, as the config tables key it: its GPU's name, "" off the GPU."""
    return _device_name(t.device.index) if t.is_cuda else ""


def current_chip() -> str:
    """chip_of a tensor on this process's current GPU ("" without one): the benchmarks' chip."""
    return _device_name(torch.cuda.current_device()) if torch.cuda.is_available() else ""


def mm_configs(chip: str | None = None) -> dict:
    """The tile-config table launches on this chip (None: this process's GPU, current_chip) read: its own
    (_CHIP_MM_CONFIGS), else _MM_CONFIGS."""
    return _CHIP_MM_CONFIGS.get(current_chip() if chip is None else chip, _MM_CONFIGS)


def _mm_config(key: str, tier: str, chip: str = "") -> dict | None:
    """The kind's tile config on this chip (None: no warp-specialized config) in this rows tier: its "@<tier>"
    config where there is one (a None kind's too); else with few rows (but for HALF_TILES configs, whose
    half tiles are those experts' tiles already) the same with at most _FEW_ROWS-token tiles."""
    table = mm_configs(chip)
    if tier and f"{key}@{tier}" in table:
        return table[f"{key}@{tier}"]
    cfg = table[key]
    if not tier or cfg is None:
        return cfg
    if tier == "many_rows" or cfg.get("HALF_TILES"):
        return cfg
    return {**cfg, "BM": min(cfg["BM"], _FEW_ROWS)}


def mm_config_key(mode: int, mx: bool, warp_specialized: bool = False) -> str:
    """The ``_MM_CONFIGS`` entry a grouped_mm of this kind and precision runs with."""
    precision = ("mxfp8" if mx else "bf16") + ("_ws" if warp_specialized else "")
    return f"{precision}/{_MODE_NAMES[mode]}"


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
    on an H100, beside the down projection's 0.43-2.1 (NOTES.md, session 38)."""
    if group_end_E.numel() == 0:
        return c_RN.zero_()
    if c_RN.numel():
        grid = (triton.cdiv(c_RN.shape[0], 32),)
        _zero_padding_rows_kernel[grid](c_RN, group_end_E, c_RN.shape[0], c_RN.shape[1], group_end_E.shape[0],
                                        BLOCK_R=32, BLOCK_N=256)
    return c_RN


def grouped_mm(a_RK, group_end_E, b_ENK) -> torch.Tensor:
    """c_RN[r] = a_RK[r] @ b_ENK[e(r)].T in bf16 (fp32 accumulation), padding rows zero; b bf16 or MXTensor
    (dim 2)."""
    c_RN = _new_rows(a_RK, _b_operand(b_ENK, "b_ENK")[0].shape[1])
    _launch_mm(PLAIN, a_RK, None, b_ENK, None, group_end_E, [c_RN])
    return _zero_padding_rows(c_RN, group_end_E)


def grouped_mm_sum(a1_RK, a2_RK, group_end_E, b1_ENK, b2_ENK) -> torch.Tensor:
    """c_RN = a1 @ b1[e].T + a2 @ b2[e].T in one fp32 accumulator (the input gradient of gate/up), padding rows
    zero."""
    c_RN = _new_rows(a1_RK, _b_operand(b1_ENK, "b1_ENK")[0].shape[1])
    _launch_mm(DUAL, a1_RK, a2_RK, b1_ENK, b2_ENK, group_end_E, [c_RN])
    return _zero_padding_rows(c_RN, group_end_E)


def grouped_gate_up_swiglu(x_RH, group_end_E, w_gate_EIH, w_up_EIH, swiglu_limit):
    """(gate_RI, up_RI, h_RI): gate/up GEMMs sharing x, h = silu(clamp gate) * clamp up, all bf16."""
    dim_i = _b_operand(w_gate_EIH, "w_gate_EIH")[0].shape[1]
    gate_RI, up_RI, h_RI = (_new_rows(x_RH, dim_i) for _ in range(3))
    _launch_mm(SWIGLU, x_RH, None, w_gate_EIH, w_up_EIH, group_end_E, [gate_RI, up_RI, h_RI],
               swiglu_limit=swiglu_limit)
    return gate_RI, up_RI, h_RI


def grouped_down_dgrad_swiglu(dy_RH, group_end_E, w_down_EIH, gate_RI, up_RI, swiglu_limit):
    """(dgate_RI, dup_RI): dh = dy @ w_down[e] (w_down viewed [E, I, H]) through the SwiGLU backward."""
    dim_i = gate_RI.shape[1]
    dgate_RI, dup_RI = (_new_rows(dy_RH, dim_i) for _ in range(2))
    _launch_mm(SWIGLU_BWD, dy_RH, None, w_down_EIH, None, group_end_E, [dgate_RI, dup_RI], gu=(gate_RI, up_RI),
               swiglu_limit=swiglu_limit)
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


def grouped_wgrad(a_RN, b_RK, group_end_E, precision: str) -> torch.Tensor:
    """bf16 c_ENK[e] = a_RN[rows of e].T @ b_RK[rows of e], each tile written once (fp32 accumulation).

    MXFP8: both operands quantized along the token axis per group first (one pass each)."""
    (c_ENK,) = grouped_wgrads([(a_RN, b_RK)], group_end_E, precision)
    return c_ENK


def grouped_wgrads(pairs, group_end_E, precision: str):
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
        yield _grouped_wgrad_values(a_RN, b_RK, group_end_E)


def _grouped_wgrad_values(a_RN, b_RK, group_end_E) -> torch.Tensor:
    """grouped_wgrad on the operands' values as they are (bf16, already MXFP8 values for MXFP8)."""
    a_RN, b_RK = a_RN.contiguous(), b_RK.contiguous()
    for name, t in (("a_RN", a_RN), ("b_RK", b_RK)):
        if t.shape[1] % 8 or t.data_ptr() % 16:  # each expert's rows are a TMA descriptor's rows
            raise ValueError(f"grouped_wgrad: {name}'s rows must be 16-byte aligned (a multiple of 8 features, "
                             f"a 16-byte aligned start), got {tuple(t.shape)} at {t.data_ptr() % 16} bytes past 16")
    num_experts, n, k = group_end_E.shape[0], a_RN.shape[1], b_RK.shape[1]
    c_ENK = torch.empty(num_experts, n, k, dtype=torch.bfloat16, device=a_RN.device)
    if num_experts:
        loop = wgrad_loop(a_RN.shape[0], num_experts, n, k, _on_cuda(a_RN), chip_of(a_RN))
        cfg = _WGRAD_CONFIGS[loop]
        flat = loop.startswith("flat")  # "flat_ws*" run the flat loop's programs, "rows_ws" the row loop's
        n_tiles, k_tiles = triton.cdiv(n, cfg["BN"]), triton.cdiv(k, cfg["BK"])
        prog_end_E, k_tiles_per_prog_E, max_programs = _wgrad_programs(group_end_E, a_RN.shape[0], cfg["BR"], n_tiles,
                                                                       k_tiles, flat)
        args = (a_RN, b_RK, c_ENK, group_end_E, prog_end_E, k_tiles_per_prog_E, n, k, num_experts)
        _set_triton_allocator()  # the kernels make each program's TMA descriptors
        if loop.endswith(("_ws", "_ws_long")):  # one program per SM looping over the loop's programs: the same bits
            grouped_wgrad_ws._grouped_wgrad_ws_kernel[(_persistent_programs(a_RN, n_tiles * max_programs),)](
                *args, LOG_E=num_experts.bit_length(), **cfg)
        else:
            grid = (n_tiles, max_programs)
            if cfg.get("PERSISTENT"):
                grid = (_persistent_programs(a_RN, n_tiles * max_programs),)
            _grouped_wgrad_kernel[grid](*args, LOG_E=num_experts.bit_length(), FLAT=flat, DOT_F32=_DOT_F32, **cfg)
    return c_ENK


def wgrad_loop(num_rows: int, num_experts: int, n: int, k: int, on_cuda: bool = False, chip: str = "") -> str:
    """The ``_WGRAD_CONFIGS`` entry grouped_wgrad runs for a gradient [E, n, k]: "flat" while experts average
    fewer than _WGRAD_FLAT_MAX_ROWS rows (padding included: a static property of the shapes), else "rows" (on CUDA
    "rows_ws" where it has a config); on CUDA "flat_ws" instead of "flat" where it has a config and experts average
    at least _WGRAD_WS_MIN_ROWS rows, or the gradient has more features than K columns (n > k); "flat_ws_long"
    instead of "flat_ws" where it has a config and experts average at least the chip's
    _CHIP_WGRAD_WS_LONG_STEPS_MIN_ROWS (else _WGRAD_WS_LONG_STEPS_MIN_ROWS) rows."""
    if num_rows >= _WGRAD_FLAT_MAX_ROWS * num_experts:
        return "rows_ws" if on_cuda and _WGRAD_CONFIGS["rows_ws"] else "rows"
    if on_cuda and (num_rows >= _WGRAD_WS_MIN_ROWS * num_experts or n > k) and _WGRAD_CONFIGS["flat_ws"]:
        long_steps_min_rows = _CHIP_WGRAD_WS_LONG_STEPS_MIN_ROWS.get(chip, _WGRAD_WS_LONG_STEPS_MIN_ROWS)
        if num_rows >= long_steps_min_rows * num_experts and _WGRAD_CONFIGS["flat_ws_long"]:
            return "flat_ws_long"
        return "flat_ws"
    return "flat"


def _wgrad_programs(group_end_E, num_rows: int, block_rows: int, n_tiles: int, k_tiles: int, flat: bool):
    """(cumulative programs per expert [E], K tiles per program [E], an upper bound of the programs)
    for one column of BN features, on the device (no host sync).

    Row loop: one K tile per program. Flat loop: each expert's K tiles in chunks of P, split further
    (fewer than _WGRAD_MIN_PROGRAMS programs otherwise), and an expert with more row blocks b than
    the average A gets max(1, P * A // b) K tiles per program: no program walks much more than
    P * A (row block, K tile) steps, where a heavy expert's programs made the tail under skewed
    routing (NOTES.md, session 12). Which program computes a tile never changes its bits."""
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
