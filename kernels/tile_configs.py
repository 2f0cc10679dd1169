"""Which kernel and tile config each grouped GEMM launches with: one frozen table per chip, read by ``select``.

``select(kind, precision, rows_per_expert, chip, n=..., k=...)`` is the one place that decides; the launchers in
``grouped_gemm`` call it and run what it returns, and ``grouped_ffn.selections`` lists its answers for the routed-expert
FFN. A tool that tries other configs passes its own ``ChipTable`` (``table=``); nothing here changes at run time.

Kinds: grouped_mm's "plain", "swiglu" (gate/up with the SwiGLU epilogue), "swiglu_bwd" (down's input gradient with
the SwiGLU backward) and "dual" (gate/up's input gradient, two products summed), and grouped_wgrad's "wgrad".
Kernels (``Selection.kernel``, each config class's ``KERNEL``):
- "triton": ``grouped_gemm._grouped_mm_tma_kernel`` / ``_grouped_wgrad_kernel``, the definition the others match bit
  for bit, the one Triton's CPU interpreter runs, and on CUDA where a table's other kernel cannot read the operands;
- "warp_specialized": ``grouped_mm_ws`` / ``grouped_wgrad_ws`` (Gluon, CUDA);
- "cooperative": ``grouped_mm_coop`` (Gluon, CUDA; plain and SwiGLU gate/up).

Rows per expert: the operand's rows (padding included) over the experts, a static property of the shapes, so no
choice syncs with the host or follows the routing. A row's bits follow none of these choices: every kernel and
tile shape sums each output element's K in the same order (tests/kernels/test_grouped_ffn.py holds them equal on the
interpreter and on the GPU), which is why the tile may follow the rows and the chip (docs/design.md, determinism).

The tables were chosen by A/Bs on an H200 (the default, for any chip without a table of its own) and an H100 (SXM:
the same tensor cores beside HBM at 0.70x the H200's bandwidth), on the four models' shapes at 2048 tokens per GPU,
EP=1 and EP=2 (balanced and skewed routing), and 8 experts x 4096 rows.
"""

import dataclasses
import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, NamedTuple

import torch

from titan_mok.kernels.grouped_mm_ws import KB as WS_KB

_log = logging.getLogger(__name__)

PRECISIONS = ("bf16", "mxfp8")
MM_KINDS = ("plain", "swiglu", "swiglu_bwd", "dual")  # grouped_gemm's MODE 0..3
TIERS = ("few_rows", "mid_rows", "many_rows")
WGRAD_CONFIGS = ("flat", "rows", "flat_ws", "flat_ws_long", "rows_ws")
THRESHOLDS = ("few_rows", "many_rows", "wgrad_ws", "wgrad_long_steps", "wgrad_rows_loop")  # ChipTable's
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class TritonMM:
    """``_grouped_mm_tma_kernel``: BM x BN output tiles, BK of K per step (MXFP8: one 32-wide scale block per TMA
    load, BK // 32 of them unrolled), GROUP_M row tiles per super-tile. HALF_TILES: a tile holding at most BM / 2 of
    its expert's rows runs BM / 2-row MMAs (Triton's MMAs take at least 64 rows: BM >= 128). PERSISTENT: one
    program per SM looping over the tiles, the tile loop flattened into the K loop."""

    KERNEL: ClassVar[str] = "triton"
    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int
    GROUP_M: int = 8
    HALF_TILES: bool = False
    PERSISTENT: bool = False

    def __post_init__(self):
        if self.HALF_TILES and self.BM < 128:
            raise ValueError(f"{self}: HALF_TILES needs BM >= 128 (Triton's MMAs take at least 64 rows)")


@dataclass(frozen=True, kw_only=True)
class _WarpSpecialized:
    """What the Gluon kernels share: a ring of STAGES load slots feeding two consumer warpgroups (num_warps = 4, a
    warpgroup per partition), CONSUMER_REGS registers per consumer thread."""

    STAGES: int
    CONSUMER_REGS: int
    num_warps: int = 4

    def __post_init__(self):
        if self.num_warps != 4:
            raise ValueError(f"{self}: the Gluon kernels take num_warps = 4 (a consumer warpgroup per partition)")


@dataclass(frozen=True, kw_only=True)
class GluonMM(_WarpSpecialized):
    """``grouped_mm_ws``: BM tokens per tile against BN = 128 weight rows (each consumer warpgroup 64); each of the
    STAGES loads KB = 4 K blocks of 32; PERSISTENT: one program per SM looping over tiles, else one program per
    tile; maxnreg (optional) caps the kernel's registers per thread, so that two programs fit on an SM. HALF_TILES:
    a tile holding at most BM / 2 of its expert's rows runs BM / 2-token MMAs (the tokens are the MMAs' N: any BM);
    SPLIT_TILES: one holding at most 3/4 BM runs BM / 2 + BM / 4-token MMAs. ROW_BLOCKS = 2: a tile is two BN-row
    blocks of the weight against one activation tile (the one-weight kinds, contiguous weights): the activation
    bytes through L2 and the loader's TMAs halve."""

    KERNEL: ClassVar[str] = "warp_specialized"
    BM: int
    PERSISTENT: bool
    BN: int = 128
    GROUP_M: int = 8
    HALF_TILES: bool = False
    SPLIT_TILES: bool = False
    ROW_BLOCKS: int = 1
    maxnreg: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.BN != 128 or self.ROW_BLOCKS not in (1, 2):
            raise ValueError(f"{self}: the warp-specialized kernel takes BN = 128 (two consumer warpgroups of 64 "
                             f"weight rows) and ROW_BLOCKS 1 or 2")


@dataclass(frozen=True, kw_only=True)
class CoopMM(_WarpSpecialized):
    """``grouped_mm_coop``: BM = 128 tokens (each consumer warpgroup 64) x BN weight rows, BK of K per load; one
    program per SM looping over the tiles, each tile's TMA stores left in flight under the next tile's MMAs."""

    KERNEL: ClassVar[str] = "cooperative"
    BN: int
    BK: int
    BM: int = 128
    GROUP_M: int = 8

    def __post_init__(self):
        super().__post_init__()
        if self.BM != 128:
            raise ValueError(f"{self}: the cooperative kernel takes BM = 128 (two consumer warpgroups of 64 rows)")


@dataclass(frozen=True)
class TritonWgrad:
    """``_grouped_wgrad_kernel``: per program BN features of one expert's gradient and K tiles of BK, the expert's
    rows summed BR per MMA step. loop "flat" (few rows per expert): one loop over (K tile, row block), each tile
    stored after its last block; "rows": one K tile per program and the row loop alone. PERSISTENT: one program per
    SM looping over the (features, K tile) pairs."""

    KERNEL: ClassVar[str] = "triton"
    loop: str
    BR: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int
    PERSISTENT: bool = False


@dataclass(frozen=True, kw_only=True)
class GluonWgrad(_WarpSpecialized):
    """``grouped_wgrad_ws`` on the programs of the Triton kernel's ``loop``: BN = 128 features (each consumer
    warpgroup 64), BR rows per MMA step, BK of K per tile, STORER_WARPS warps (STORER_REGS registers) storing the
    tiles; one program per SM."""

    KERNEL: ClassVar[str] = "warp_specialized"
    loop: str
    BR: int
    BK: int
    STORER_WARPS: int
    STORER_REGS: int
    BN: int = 128

    def __post_init__(self):
        super().__post_init__()
        if self.BN != 128:
            raise ValueError(f"{self}: the warp-specialized weight gradient takes BN = 128")


MMConfig = TritonMM | GluonMM | CoopMM
WgradConfig = TritonWgrad | GluonWgrad


@dataclass(frozen=True)
class MMEntry:
    """A kind's configs in one rows tier: ``triton`` (the Triton kernel's: the interpreter's, and CUDA's where
    ``cuda`` cannot read the operands) and ``cuda`` (what CUDA runs; ``triton`` itself where the Triton kernel
    measured fastest)."""

    triton: TritonMM
    cuda: MMConfig


def _triton(cfg: TritonMM) -> MMEntry:
    return MMEntry(cfg, cfg)


@dataclass(frozen=True)
class ChipTable:
    """One chip's choices (select reads them).

    mm: per "<precision>/<kind>@<tier>" an MMEntry. Tiers by rows per expert: "few_rows" up to ``few_rows`` (the
    MoE regime at EP=1), "many_rows" from ``many_rows`` (few experts per GPU, the compute regime), "mid_rows"
    between. wgrad: the weight gradient's configs by name; select picks "flat" below ``wgrad_rows_loop`` rows per
    expert, else "rows", and on CUDA instead "flat_ws" from ``wgrad_ws`` rows (below, for a gradient with more
    features than K columns), "flat_ws_long" from ``wgrad_long_steps`` and "rows_ws" for "rows"."""

    mm: Mapping[str, MMEntry]
    wgrad: Mapping[str, WgradConfig]
    few_rows: int = 64
    many_rows: int = 2048
    wgrad_ws: int = 64
    wgrad_long_steps: int = 128
    wgrad_rows_loop: int = 512

    def __post_init__(self):
        want = {f"{p}/{kind}@{tier}" for p in PRECISIONS for kind in MM_KINDS for tier in TIERS}
        if set(self.mm) != want:
            raise ValueError(f"ChipTable.mm: missing {sorted(want - set(self.mm))}, unknown {sorted(set(self.mm) - want)}")
        for key, entry in self.mm.items():
            kind = key.split("/")[1].split("@")[0]
            if not isinstance(entry.triton, TritonMM):
                raise ValueError(f"{key}: the triton config must be a TritonMM, got {entry.triton}")
            if isinstance(entry.cuda, CoopMM) and kind not in ("plain", "swiglu"):
                raise ValueError(f"{key}: the cooperative kernel runs the plain and SwiGLU gate/up kinds only")
            if isinstance(entry.cuda, GluonMM) and entry.cuda.ROW_BLOCKS == 2 and kind == "swiglu":
                raise ValueError(f"{key}: ROW_BLOCKS = 2 is for the one-weight kinds, not SwiGLU gate/up")
        if set(self.wgrad) != set(WGRAD_CONFIGS):
            raise ValueError(f"ChipTable.wgrad: the configs are {list(WGRAD_CONFIGS)}, got {sorted(self.wgrad)}")
        for name, cfg in self.wgrad.items():
            if cfg.loop != name.split("_")[0] or (name in ("flat", "rows") and not isinstance(cfg, TritonWgrad)):
                raise ValueError(f"wgrad/{name}: must run the {name.split('_')[0]} loop"
                                 f"{' on the Triton kernel' if name in ('flat', 'rows') else ''}, got {cfg}")
        if not self.few_rows < self.many_rows or not self.wgrad_ws <= self.wgrad_long_steps <= self.wgrad_rows_loop:
            raise ValueError(f"ChipTable: rows thresholds out of order: {self.thresholds()}")
        object.__setattr__(self, "mm", MappingProxyType(dict(self.mm)))
        object.__setattr__(self, "wgrad", MappingProxyType(dict(self.wgrad)))

    def thresholds(self) -> dict:
        return {name: getattr(self, name) for name in THRESHOLDS}

    def replace(self, mm: Mapping[str, MMEntry] | None = None, wgrad: Mapping[str, WgradConfig] | None = None,
                **thresholds) -> "ChipTable":
        """This table with these mm entries and wgrad configs replaced (the others kept), and these thresholds."""
        return dataclasses.replace(self, mm={**self.mm, **(mm or {})}, wgrad={**self.wgrad, **(wgrad or {})},
                                   **thresholds)


# ----------------------------------------------------------------------------- the H200's table (the default)


def _tiers(kind: str, few: MMEntry, mid: MMEntry, many: MMEntry | None = None, precision: str = "bf16") -> dict:
    return {f"{precision}/{kind}@few_rows": few, f"{precision}/{kind}@mid_rows": mid,
            f"{precision}/{kind}@many_rows": many or mid}


# bf16, the Triton kernel. HALF_TILES: with skewed routing most light experts' only tile holds at most half its
# rows; 5-10% faster per kind at EP=2 and up to 11% at EP=1 with skewed routing, level with balanced routing and at
# 8 x 4096 rows. bf16/dual's 128 x 256 tiles by a sweep over all four shapes.
_BF16_PLAIN = TritonMM(BM=128, BN=128, BK=64, num_warps=4, num_stages=3, HALF_TILES=True)
_BF16_SWIGLU = TritonMM(BM=128, BN=128, BK=64, num_warps=8, num_stages=4, HALF_TILES=True)
_BF16_DUAL = TritonMM(BM=128, BN=256, BK=64, num_warps=8, num_stages=4, HALF_TILES=True)
# The bf16 SwiGLU backward at 128 tokens spills (255 registers): at few rows its 64-token tiles were 4.6-8% faster
# than the half tiles of the 128-token kernel (EP=1, skewed routing).
_BF16_SWIGLU_BWD_FEW = TritonMM(BM=64, BN=128, BK=64, num_warps=8, num_stages=4)
# The dgrad kinds at many rows persistent (the next tile's loads overlap this one's epilogue): 0.4-3.9% faster at
# 8 x 4096 rows in all four shapes; plain and SwiGLU gate/up were 3-30% slower persistent.
_BF16_SWIGLU_BWD_MANY = TritonMM(BM=128, BN=128, BK=64, num_warps=8, num_stages=4, PERSISTENT=True)
_BF16_DUAL_MANY = TritonMM(BM=128, BN=256, BK=64, num_warps=8, num_stages=4, PERSISTENT=True)
# The bf16 kinds on the warp-specialized kernel (its wgmmas read the bf16 weights from shared memory): plain and
# SwiGLU gate/up within -6% to +7% of the Triton kernel, dual 3-32% slower; the SwiGLU backward 4-17% faster at
# EP=2 with one program per tile and 9-14% faster persistent at 8 x 4096 rows (at few rows, persistent, 8-12% slower:
# it stays on the Triton kernel there).
_BF16_WS_SWIGLU_BWD = GluonMM(BM=128, PERSISTENT=False, STAGES=3, CONSUMER_REGS=232, HALF_TILES=True,
                              SPLIT_TILES=True)
_BF16_WS_SWIGLU_BWD_MANY = dataclasses.replace(_BF16_WS_SWIGLU_BWD, PERSISTENT=True)

# MXFP8, the Triton kernel: the interpreter's and CUDA's for K not a multiple of 128. Few rows: 64-token tiles
# rather than MMAs mostly on padding rows (8-30% faster at 32-64 rows per expert, balanced routing).
_MX_PLAIN = TritonMM(BM=128, BN=128, BK=32, num_warps=4, num_stages=3)
_MX_SWIGLU = TritonMM(BM=128, BN=64, BK=32, num_warps=4, num_stages=3)
_MX_SWIGLU_BWD = TritonMM(BM=128, BN=128, BK=32, num_warps=4, num_stages=3)
_MX_DUAL = TritonMM(BM=128, BN=128, BK=32, num_warps=4, num_stages=3)


def _few(cfg: TritonMM) -> TritonMM:
    return dataclasses.replace(cfg, BM=64)


# MXFP8 on CUDA: the warp-specialized kernel for every kind (the dequantized weights as the MMAs' register operand).
# HALF_TILES 0.4-7.2% faster for the dgrad kinds; with SPLIT_TILES (65-96-row tiles on 64 + 32-token MMAs: Kimi K2.7
# and Qwen3.5 at EP=2 hold 80-85 rows per expert) and 16-byte stores, 4-13% faster than 16-byte stores alone at EP=2,
# level at 8 x 4096. ROW_BLOCKS = 2: plain 4.8-11% and dual 5.3-11% faster at EP=2, bits equal; three stages to fit
# shared memory (200 KB). (Three consumer warpgroups, BN = 192, one row block: level to 10% slower than two row
# blocks.)
_MX_WS_PLAIN = GluonMM(BM=128, PERSISTENT=True, STAGES=3, CONSUMER_REGS=232, HALF_TILES=True, SPLIT_TILES=True,
                       ROW_BLOCKS=2)
_MX_WS_SWIGLU = GluonMM(BM=128, PERSISTENT=False, STAGES=2, CONSUMER_REGS=232, HALF_TILES=True, SPLIT_TILES=True)
_MX_WS_SWIGLU_BWD = GluonMM(BM=128, PERSISTENT=True, STAGES=3, CONSUMER_REGS=248, HALF_TILES=True, SPLIT_TILES=True)
_MX_WS_DUAL = GluonMM(BM=128, PERSISTENT=True, STAGES=3, CONSUMER_REGS=232, HALF_TILES=True, SPLIT_TILES=True,
                      ROW_BLOCKS=2)
# Few rows per expert: 64-token tiles halve the accumulators. The SwiGLU backward capped at 80 registers (104 for
# the consumers, two loads in flight) fits two programs per SM, which hide each other's latencies (the dgrad kinds
# 1-13% faster; SwiGLU gate/up, two accumulators, spills so). Plain's and dual's two weight row blocks per tile, one
# program per SM: 7.9-16% and 2-7.5% faster at EP=1. HALF_TILES on 64-token tiles (32-token MMAs): at 32 rows per
# expert (DeepSeek-V4-Pro, EP=1) all four kinds 5-12% faster. The 128-token configs' half tiles were 2-12% slower
# here.
_MX_WS_PLAIN_FEW = GluonMM(BM=64, PERSISTENT=True, STAGES=4, CONSUMER_REGS=232, ROW_BLOCKS=2, HALF_TILES=True)
_MX_WS_SWIGLU_FEW = GluonMM(BM=64, PERSISTENT=False, STAGES=2, CONSUMER_REGS=232, HALF_TILES=True)
_MX_WS_SWIGLU_BWD_FEW = GluonMM(BM=64, PERSISTENT=False, STAGES=2, CONSUMER_REGS=104, maxnreg=80, HALF_TILES=True)
_MX_WS_DUAL_FEW = GluonMM(BM=64, PERSISTENT=True, STAGES=4, CONSUMER_REGS=232, ROW_BLOCKS=2, HALF_TILES=True)
# Many rows per expert: 256-token tiles double the MMA time per dequantized weight load, which lets the two consumer
# warpgroups hide each other's dequantization; two stages to fit shared memory: plain 4-11% and dual 7-13% faster at
# 8 experts x 2048 and x 4096 rows (mixed at 1024). SwiGLU gate/up (two accumulators) cannot fit; its backward spills.
_MX_WS_PLAIN_MANY = GluonMM(BM=256, PERSISTENT=True, STAGES=2, CONSUMER_REGS=240)
_MX_WS_DUAL_MANY = GluonMM(BM=256, PERSISTENT=True, STAGES=2, CONSUMER_REGS=240, HALF_TILES=True)

# The weight gradient. Triton: the flat loop (K tiles split among more programs for heavy experts, and where there
# would be too few programs: grouped_gemm._wgrad_programs); the row loop persistent (faster in 10 of 12 gradients at
# 8 x 4096 rows, by about 1%). The warp-specialized kernel: 256-wide K tiles (up to 8% faster than 128 at EP=2); two
# storer warps (0.935-0.953x the time of consumers storing their own tiles); against the Triton flat loop 1.05-1.32x
# faster at EP=2, while at 32-43 rows per expert the Triton kernel was faster for w_gate's and w_up's gradients (hence
# wgrad_ws) and 0.84-1.00x the time for w_down's (more features than K columns). 64-row MMA steps (flat_ws_long: half
# the steps, 3 ring slots to fit) from 128 rows per expert: 0.905-0.953x the 32-row steps' time (GLM-5.2, EP=2); at
# 80-85 rows they pad an expert to 128 rows against 96 and were 0.99-1.11x on the H200. rows_ws: the row loop's
# programs on the warp-specialized kernel with 64-row steps, 0.925-0.991x the Triton row loop's time at 8 x 4096
# rows (measured on an H100; the regime is MMA-bound and the tensor cores are the H200's).
_WGRAD = {
    "flat": TritonWgrad(loop="flat", BR=32, BN=128, BK=128, num_warps=8, num_stages=3),
    "rows": TritonWgrad(loop="rows", BR=64, BN=128, BK=256, num_warps=8, num_stages=3, PERSISTENT=True),
    "flat_ws": GluonWgrad(loop="flat", BR=32, BK=256, STAGES=6, CONSUMER_REGS=232, STORER_WARPS=2, STORER_REGS=64),
    "flat_ws_long": GluonWgrad(loop="flat", BR=64, BK=256, STAGES=3, CONSUMER_REGS=232, STORER_WARPS=2,
                               STORER_REGS=64),
    "rows_ws": GluonWgrad(loop="rows", BR=64, BK=256, STAGES=3, CONSUMER_REGS=232, STORER_WARPS=2, STORER_REGS=64),
}

H200 = ChipTable(
    mm={
        **_tiers("plain", _triton(_BF16_PLAIN), _triton(_BF16_PLAIN)),
        **_tiers("swiglu", _triton(_BF16_SWIGLU), _triton(_BF16_SWIGLU)),
        **_tiers("swiglu_bwd", _triton(_BF16_SWIGLU_BWD_FEW), MMEntry(_BF16_SWIGLU, _BF16_WS_SWIGLU_BWD),
                 MMEntry(_BF16_SWIGLU_BWD_MANY, _BF16_WS_SWIGLU_BWD_MANY)),
        **_tiers("dual", _triton(_BF16_DUAL), _triton(_BF16_DUAL), _triton(_BF16_DUAL_MANY)),
        **_tiers("plain", MMEntry(_few(_MX_PLAIN), _MX_WS_PLAIN_FEW), MMEntry(_MX_PLAIN, _MX_WS_PLAIN),
                 MMEntry(_MX_PLAIN, _MX_WS_PLAIN_MANY), "mxfp8"),
        **_tiers("swiglu", MMEntry(_few(_MX_SWIGLU), _MX_WS_SWIGLU_FEW), MMEntry(_MX_SWIGLU, _MX_WS_SWIGLU),
                 precision="mxfp8"),
        **_tiers("swiglu_bwd", MMEntry(_few(_MX_SWIGLU_BWD), _MX_WS_SWIGLU_BWD_FEW),
                 MMEntry(_MX_SWIGLU_BWD, _MX_WS_SWIGLU_BWD), precision="mxfp8"),
        **_tiers("dual", MMEntry(_few(_MX_DUAL), _MX_WS_DUAL_FEW), MMEntry(_MX_DUAL, _MX_WS_DUAL),
                 MMEntry(_MX_DUAL, _MX_WS_DUAL_MANY), "mxfp8"),
    },
    wgrad=_WGRAD,
)


# ----------------------------------------------------------------------------- the H100's: the H200's, these changed


def _stages(key: str, stages: int) -> dict:
    entry = H200.mm[key]
    return {key: dataclasses.replace(entry, cuda=dataclasses.replace(entry.cuda, STAGES=stages))}


H100 = H200.replace(
    mm={
        # MXFP8 SwiGLU gate/up on 3 ring slots instead of 2, and at few rows plain and dual on 3 instead of 4: the
        # H200's configs took 1.034-1.070x the time for SwiGLU gate/up (Kimi K2.7, Qwen3.5, GLM-5.2), 1.005-1.054x for
        # dual and 0.996-1.027x for plain, bits equal. At 128-token tiles plain and dual on 2 slots were slower.
        **_stages("mxfp8/swiglu@mid_rows", 3), **_stages("mxfp8/swiglu@many_rows", 3),
        **_stages("mxfp8/swiglu@few_rows", 3), **_stages("mxfp8/plain@few_rows", 3),
        **_stages("mxfp8/dual@few_rows", 3),
        # bf16 forward at many rows on the cooperative kernel (each tile's TMA stores under the next tile's MMAs),
        # bits equal: plain on 128 x 256 tiles 0.945-0.972x the time of the persistent Triton kernel (itself
        # 0.79-0.87x the H200's config), SwiGLU gate/up on 4 ring slots 0.938-0.988x the Triton kernel's; with them
        # the compute regime's forward took 0.91-0.96x torch._grouped_mm's time in all four shapes.
        "bf16/plain@many_rows": MMEntry(TritonMM(BM=128, BN=256, BK=64, num_warps=8, num_stages=4, PERSISTENT=True),
                                        CoopMM(BN=256, BK=64, STAGES=3, CONSUMER_REGS=232)),
        "bf16/swiglu@many_rows": MMEntry(_BF16_SWIGLU, CoopMM(BN=128, BK=64, STAGES=4, CONSUMER_REGS=232)),
    },
    # 64-row weight-gradient steps from 80 rows per expert (Kimi K2.7 and Qwen3.5 at EP=2): 0.958-1.004x the time of
    # 32-row steps, faster in 23 of 24 lines; at 64 rows (DeepSeek-V4-Pro EP=2) 0.997-1.019x, so not there.
    wgrad_long_steps=80,
)

# Tables by torch.cuda.get_device_name; any other chip (and the interpreter) reads DEFAULT.
TABLES = MappingProxyType({"NVIDIA H100 80GB HBM3": H100})
DEFAULT = H200


# ----------------------------------------------------------------------------- select


class Selection(NamedTuple):
    kernel: str  # "triton", "warp_specialized" or "cooperative"
    config: MMConfig | WgradConfig
    key: str  # the table entry: "<precision>/<kind>@<tier>" or "wgrad/<config>"

    def __str__(self):
        return f"{self.key}: {self.kernel} {self.config}"


def table_for(chip: str | None) -> ChipTable:
    """The table a chip's launches read (None, Triton's interpreter: DEFAULT's Triton configs)."""
    return TABLES.get(chip, DEFAULT)


def tier_of(rows_per_expert: float, table: ChipTable) -> str:
    if rows_per_expert <= table.few_rows:
        return "few_rows"
    return "many_rows" if rows_per_expert >= table.many_rows else "mid_rows"


def select(kind: str, precision: str, rows_per_expert: float, chip: str | None, *, n: int, k: int,
           contiguous: bool = True, table: ChipTable | None = None) -> Selection:
    """The kernel and tile config of one grouped GEMM.

    Args:
        kind: grouped_mm's "plain", "swiglu", "swiglu_bwd", "dual", or "wgrad".
        precision: "bf16" or "mxfp8" (the weight gradient's configs do not depend on it).
        rows_per_expert: the operand's rows (padding included) / the experts.
        chip: the GPU's name (chip_of), or None where Triton's interpreter runs: the Triton kernel only.
        n, k: the output features and the reduction dim (grouped_mm: B [E, N, K]; wgrad: the gradient [E, N, K]).
        contiguous: grouped_mm's weights are contiguous [E, N, K], not the transposed view of [E, K, N].
        table: the configs to read; None: the chip's (table_for).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"select: precision must be one of {PRECISIONS}, got {precision!r}")
    table = table_for(chip) if table is None else table
    gpu = chip is not None
    if kind == "wgrad":
        if rows_per_expert >= table.wgrad_rows_loop:
            name = "rows_ws" if gpu else "rows"
        elif gpu and (rows_per_expert >= table.wgrad_ws or n > k):
            name = "flat_ws_long" if rows_per_expert >= table.wgrad_long_steps else "flat_ws"
        else:
            name = "flat"
        key, cfg = f"wgrad/{name}", table.wgrad[name]
    elif kind in MM_KINDS:
        key = f"{precision}/{kind}@{tier_of(rows_per_expert, table)}"
        entry = table.mm[key]
        cfg = entry.cuda if gpu and _reads(entry.cuda, n, k, contiguous) else entry.triton
        if isinstance(cfg, GluonMM) and cfg.ROW_BLOCKS > 1 and not contiguous:
            cfg = dataclasses.replace(cfg, ROW_BLOCKS=1)  # two weight row blocks per tile: contiguous weights only
    else:
        raise ValueError(f"select: kind must be one of {MM_KINDS + ('wgrad',)}, got {kind!r}")
    _log.debug("%s %s at %.1f rows per expert, N %d, K %d on %s: %s %s", kind, precision, rows_per_expert, n, k,
               chip or "Triton's interpreter", cfg.KERNEL, cfg)
    return Selection(cfg.KERNEL, cfg, key)


def _reads(cfg: MMConfig, n: int, k: int, contiguous: bool) -> bool:
    """Whether cfg's kernel reads these operands: the warp-specialized kernel loads K in blocks of 32 * KB; the
    cooperative one reads the weights as a contiguous [E, N, K] and stores the output rows by TMA (N a multiple of 8
    bf16); the Triton kernel reads any."""
    if isinstance(cfg, GluonMM):
        return k % (32 * WS_KB) == 0
    if isinstance(cfg, CoopMM):
        return contiguous and n % 8 == 0
    return True


@functools.cache
def _device_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


def chip_of(t: torch.Tensor) -> str | None:
    """The GPU t's launches run on, by name (TABLES' key), or None where Triton's interpreter runs them (CPU
    tensors, TRITON_INTERPRET=1)."""
    return _device_name(t.device.index) if t.is_cuda and not _INTERPRETED else None
