"""The routed experts' forward through the MoK megakernel (``kernels/mok_megakernel.py``) for P virtual ranks on
one device (virtual EP), and what every host of the megakernel shares: its config, checks and schedules. A rank of
a real EP group (or one rank alone): ``titan_mok.moe.megakernel_rank``.

Legend: P ep degree (virtual ranks on this device), T tokens per rank, K top-k, N = T·K, H hidden,
I expert FFN size, E experts, L = E / P local experts per rank.

Contract of ``fused_routed_experts`` (``titan_mok.moe.fused``), per rank: out[t] = cast(shared[t] +
Σ_j w[t,j]·expert_{e[t,j]}(x[t])), the sum in fp32 in ascending slot order j, cast once to out_dtype;
every expert row is the Triton grouped FFN's (bf16). shared[t] is the caller's ``shared_TH``, or, with
``shared_expert``, the shared expert computed inside the launch (``SharedExpert(use_triton=True)``'s bf16
rows, times ``shared_scale_T1`` if given: Qwen3.5's output gate, computed by the caller). Under virtual EP
rank p holds experts p·L .. p·L + L - 1 and its tokens' rows travel through the other virtual ranks'
buffers exactly as they would between GPUs, so a token's output is the same bits whatever P.

Per call, all on the current stream, no host sync: each rank's x rows into its x buffer; the schedule
(``kernels/mok_schedule.py``, per rank); the megakernel (one launch: pull, FFN, push, and the shared
expert's FFN if given); the finish launch (per token, wait for its rows, then the ordered fp32 reduction
with the shared expert's output). The workspace of a (device, P, T, K, H, I, shared expert size, config,
precision) is allocated at its first call and reused; its flags are never reset between calls (per-call epochs).

MXFP8 (``precision="mxfp8"``): every expert row is the Triton grouped FFN's MXFP8 row
(``grouped_swiglu_ffn(precision="mxfp8", use_triton=True)``): the launch reads that path's MXFP8 weight operands
(``launch_weights``), quantizes each pulled row along H into its ring and h along I (their MXFP8 values, bf16); the
shared expert stays bf16.

Not here: the backward (an input that requires grad raises NotImplementedError; ``[mok] kernels = "megakernel"``
trains through ``titan_mok.moe.megakernel_autograd``, whose backward runs the dgrad launch of
``titan_mok.moe.megakernel_rank``).
"""

from dataclasses import dataclass, replace

import torch

from titan_mok.kernels.grouped_ffn import forward_weight_operands, interpreting
from titan_mok.kernels.mok_megakernel import (
    GEMM_LOADS,
    MAX_EPOCH,
    KernelVariant,
    LaunchShape,
    MegakernelBuffers,
    SharedFFN,
    co_resident_programs,
    megakernel_finish,
    megakernel_launch,
    read_error,
    ring_buffers,
    shared_groups,
)
from titan_mok.kernels.mok_schedule import mok_schedule
from titan_mok.kernels.mxfp8 import BLOCK as MX_BLOCK
from titan_mok.kernels.tile_configs import PRECISIONS


@dataclass(frozen=True)
class MegakernelConfig:
    """Sizes of the megakernel's launch (per rank: each rank of a virtual-EP launch gets the same).

    Defaults at Kimi K2.7's sizes (H 7168, I 2048, 384 experts, K 8) on an H100 (132 SMs, one program per SM):
    P = 1 runs 16 communication + 116 compute programs, P = 8 2 + 14 per rank. A step of the item order is 8 tiles
    (8 x 72 items): one step's A items (128) alone outnumber the compute programs, and at P = 8 (3 to 6 tiles per
    expert) an expert's tiles read each weight block side by side. Lag 1: a group's B items come after the next
    group's A items, by when their own A items have long finished. The ring holds 32 tiles per rank (8 x (1 + 3): the
    groups from B to A, and two pulled ahead), 37.7 MB per rank on 64-row tiles, 75.5 MB on 128-row ones (the default
    at P = 8: 341 rows per expert) (kernels/mok_megakernel.py: Q·M·(H + I)·2 bytes)."""

    comm_programs: int | None = None
    """Communication programs per rank. None: an eighth of the rank's share of the programs the device runs
    at once (at least 1); 1 under Triton's interpreter."""
    compute_programs: int | None = None
    """Compute programs per rank. None: the rest of the rank's share; 2 under Triton's interpreter."""
    group_tiles: int = 8
    """Tiles per step of the item order (G): their A items, column block major, then the B items of the group lag
    steps back."""
    lag: int = 1
    """Groups by which A items run ahead of the B items that read their output; (lag + 1) x group_tiles <=
    ring_tiles (deadlock freedom)."""
    ring_tiles: int | None = None
    """Ring tiles per rank (each block_m rows of H, and their block_m rows of I). None: group_tiles x (lag + 3).
    Any size >= (lag + 1) x group_tiles takes any routing (tiles are recycled)."""
    block_m: int | None = None
    """Rows per tile (the GEMMs' M): 64, or 128 (the ring's bytes double; at Kimi K2.7's sizes and the default 32
    tiles 75.5 MB per rank). None: 128 where the rank's local experts average at least 128 rows per call
    (T·K / L >= 128), else 64. Measured at Kimi K2.7's sizes on an H100 (docs/performance.md): at 341 rows per
    expert 128-row tiles took 35.3 ms against 43.3, at 43 rows 15.7 against 13.9 (mostly padding rows). The dgrad
    launch: the same under bf16 (at 341 rows 41.6 ms against 53.4, TMA loads); MXFP8: 64."""
    block_n: int = 128
    """Output columns per work item (the GEMMs' N)."""
    num_warps: int = 8
    """Warps per program."""
    num_stages: int = 4
    """Software-pipeline depth of the GEMMs' K loops: shared memory per program is num_stages x the operand tiles
    of one gate/up K step (40 KB at the defaults: 160 KB, one program per SM; ptxas for sm_90: 255 registers, no
    spills, at Kimi K2.7's sizes; block_m 128: 48 KB, 192 KB; ``python -m benchmarks.tools.sass --megakernel``
    lists every variant's)."""
    timeout_ms: float = 10_000.0
    """Bound of every wait on another program; then a device error naming the wait."""
    gemm: str | None = None
    """How the launch's item GEMMs read their operands: "ptr" (masked pointer loads) or "tma" (TMA loads through
    tensor descriptors each compute program makes once; the weights' data 16-byte aligned). The same bits. The
    forward: H, I and I_S multiples of 8; None: "tma" where they allow it (as fast at 64-row tiles, faster at 128:
    docs/performance.md), else "ptr". The dgrad launch: H and I multiples of its K step (bf16 64, MXFP8 32:
    kernels/mok_megakernel_bwd.py, GEMM loads); None: bf16 "tma" where they allow it (as fast at 64-row tiles,
    faster at 128), else "ptr"; MXFP8 "ptr" (its TMA loads were slower: docs/performance.md)."""


@dataclass
class _Workspace:
    shape: LaunchShape
    bufs: MegakernelBuffers
    symmetric: dict[str, list[torch.Tensor]]
    """Each rank's symmetric buffers by name (``bufs.tables`` holds their addresses)."""
    flags: list[torch.Tensor]
    """Everything a reset zeroes: ring flags, item counters, arrival counters, x_ready."""
    timeout_ms: float
    epoch: int = 0

    def next_epoch(self) -> int:
        """This call's epoch; before e·K would leave int32, every flag is zeroed and the epochs start over."""
        if self.epoch >= MAX_EPOCH:
            self.reset()
        self.epoch += 1
        return self.epoch

    def reset(self) -> None:
        for flag in self.flags:
            flag.zero_()
        self.bufs.errors.zero_()
        self.epoch = 0


_WORKSPACES: dict[tuple, _Workspace] = {}


def _resolve(config: MegakernelConfig, ranks: int, dim_h: int, dim_i: int, num_local: int, has_limit: bool,
             shared: SharedFFN | None, device: torch.device, serialized: bool,
             co_resident=co_resident_programs, mx: bool = False, rows_per_expert: float = 0.0,
             tma_dims: tuple[int, ...] | None = None) -> MegakernelConfig:
    """Fill the config's None sizes (module docstring of MegakernelConfig); a concurrent launch the device cannot
    hold at once is refused here, before anything is allocated (the launcher checks it again). co_resident: the
    launch's kernel's count of programs the device runs at once (the forward's, or the backward's). mx: the
    forward's routed experts in MXFP8. rows_per_expert: T·K / L, for block_m None. tma_dims: the dims TMA would read
    rows of (None: a launch that reads by pointer only), for gemm None."""
    if config.block_m is None:
        config = replace(config, block_m=128 if rows_per_expert >= 128 else 64)
    if config.gemm is None:
        config = replace(config, gemm="tma" if tma_dims is not None and all(d % 8 == 0 for d in tma_dims) else "ptr")
    if config.gemm not in GEMM_LOADS:
        raise ValueError(f"MegakernelConfig.gemm = {config.gemm!r} must be one of {GEMM_LOADS}")
    comm, compute = config.comm_programs, config.compute_programs
    total = None
    if not interpreting():
        variant = KernelVariant(dim_h, dim_i, 0 if shared is None else shared.dim, num_local, config.block_m,
                                config.block_n, config.num_warps, config.num_stages, has_limit,
                                shared is not None and shared.swiglu_limit is not None, config.gemm, mx)
        total = co_resident(device.index, variant)
    if comm is None or compute is None:
        per_rank = (comm or 1) + (compute or 2) if total is None else total // ranks
        comm = comm if comm is not None else max(1, per_rank // 8)
        compute = compute if compute is not None else per_rank - comm
    if comm < 1 or compute < 1:
        raise ValueError(f"MegakernelConfig: {ranks} ranks need at least one communication and one compute program "
                         f"each, got comm_programs = {comm}, compute_programs = {compute}")
    if total is not None and not serialized and ranks * (comm + compute) > total:
        raise RuntimeError(f"mok megakernel: {ranks} ranks x ({comm} communication + {compute} compute) programs "
                           f"exceed the {total} this device runs at once, so its spin-waits could deadlock: use fewer")
    if config.group_tiles < 1 or config.lag < 0 or config.num_stages < 1:
        raise ValueError(f"MegakernelConfig: group_tiles = {config.group_tiles} must be >= 1, lag = {config.lag} >= 0 "
                         f"and num_stages = {config.num_stages} >= 1")
    in_flight = (config.lag + 1) * config.group_tiles
    ring = config.ring_tiles if config.ring_tiles is not None else config.group_tiles * (config.lag + 3)
    if ring < in_flight:
        raise ValueError(f"MegakernelConfig.ring_tiles = {ring} must be >= (lag + 1) x group_tiles = ({config.lag} "
                         f"+ 1) x {config.group_tiles} = {in_flight}: a group's tiles take the ring slots that the "
                         "B items lag + 1 groups back free, which come before them in the item order only then (a "
                         "wait on later work could deadlock)")
    if config.block_m < 16 or config.block_m & (config.block_m - 1) or config.block_n < 16 or (
            config.block_n & (config.block_n - 1)):
        raise ValueError(f"MegakernelConfig: block_m = {config.block_m} and block_n = {config.block_n} must be "
                         "powers of two >= 16 (tl.dot tiles)")
    if mx and config.block_n < MX_BLOCK:
        raise ValueError(f"MegakernelConfig.block_n = {config.block_n}: precision 'mxfp8' stores h in {MX_BLOCK}-column"
                         f" MXFP8 blocks per item, so block_n must be >= {MX_BLOCK}")
    return replace(config, comm_programs=comm, compute_programs=compute, ring_tiles=ring)


def virtual_symmetric(ranks: int, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], device):
    """Each virtual rank's symmetric buffers, zeroed, by name ({name: (shape, dtype)}), and their int64 [P] address
    tables: every rank's buffer is an allocation of its own, reached through the tables as peers' symmetric
    memory is. (symmetric {name: [P tensors]}, tables {name: int64 [P]})."""
    symmetric = {name: [torch.zeros(shape, dtype=dtype, device=device) for _ in range(ranks)]
                 for name, (shape, dtype) in specs.items()}
    tables = {name: torch.tensor([b.data_ptr() for b in per_rank], dtype=torch.int64, device=device)
              for name, per_rank in symmetric.items()}
    return symmetric, tables


def launch_shape(cfg: MegakernelConfig, ep_degree: int, num_tokens: int, top_k: int, num_local: int,
                 shared_groups: int = 0, *, rank: int | None = None) -> LaunchShape:
    """The fixed sizes of a launch, from a resolved config (``_resolve``): the forward's and the dgrad launch's. It
    hosts all ``ep_degree`` virtual ranks of this device, or with ``rank`` that rank of a real group only."""
    first_rank, hosted = (0, ep_degree) if rank is None else (rank, 1)
    return LaunchShape(ep_degree, first_rank, hosted, num_tokens, top_k, num_local, cfg.comm_programs,
                       cfg.compute_programs, cfg.group_tiles, cfg.lag, cfg.block_n, cfg.num_warps, cfg.num_stages,
                       shared_groups, cfg.gemm)


def _allocate(ranks, num_tokens, top_k, dim_h, dim_i, shared_dim, num_local, cfg: MegakernelConfig,
              device) -> _Workspace:
    slots = num_tokens * top_k
    bf16 = dict(dtype=torch.bfloat16, device=device)
    symmetric, tables = virtual_symmetric(ranks, {
        "x_TH": ((num_tokens, dim_h), torch.bfloat16), "slots_NH": ((slots, dim_h), torch.bfloat16),
        "arrivals_T": ((num_tokens,), torch.int32), "x_ready": ((1,), torch.int64)}, device)
    ring, rows = cfg.ring_tiles, cfg.block_m
    groups = shared_groups(num_tokens, rows, cfg.group_tiles) if shared_dim else 0
    slots_f = ring + groups * cfg.group_tiles  # flag slots: the ring's, then the shared expert's tiles'
    flag = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
    bufs = MegakernelBuffers(
        **ring_buffers(ranks, ring, rows, dim_h, dim_i, device),
        ready_VQ=flag(ranks, ring, dtype=torch.int64),
        h_ready_VF=flag(ranks, slots_f, dtype=torch.int64),
        consumed_VF=flag(ranks, slots_f, dtype=torch.int64),
        gate_up_done_VF=flag(ranks, slots_f, dtype=torch.int32),
        down_done_VF=flag(ranks, slots_f, dtype=torch.int32),
        next_item_V=flag(ranks, dtype=torch.int32),
        programs_done_V=flag(ranks, dtype=torch.int32),
        tables=tables,
        errors=torch.zeros(6, dtype=torch.int64, device=device),
        shared_h_VRI=torch.zeros(ranks, groups * cfg.group_tiles * rows, shared_dim, **bf16) if groups else None,
        shared_out_VTH=torch.zeros(ranks, num_tokens, dim_h, **bf16) if groups else None,
    )
    shape = launch_shape(cfg, ranks, num_tokens, top_k, num_local, groups)
    return _Workspace(shape, bufs, symmetric, [*bufs.flags, *symmetric["arrivals_T"], *symmetric["x_ready"]],
                      cfg.timeout_ms)


def launch_weights(expert_weights: tuple, precision: str, weights_owner: object = None,
                   weight_sources: tuple | None = None) -> tuple:
    """The routed weights as the launch reads them: bf16 as given, or under mxfp8 the very operands the Triton
    grouped FFN's forward reads (``grouped_ffn.forward_weight_operands``: MXFP8 along K in MMA order, kept under
    ``weights_owner`` per weight version). The launch
    quantizes no weight."""
    if precision == "bf16":
        return tuple(expert_weights)
    return forward_weight_operands(tuple(expert_weights), precision, weights_owner=weights_owner,
                                   weight_sources=weight_sources)


def raise_on_megakernel_error() -> None:
    """Raise RuntimeError naming the wait that ran out in any megakernel workspace of this process (then reset it
    so that it can run again). For calls made with ``trap=False``. NOTE: host sync (reads the error records)."""
    for ws in _WORKSPACES.values():
        message = read_error(ws.bufs.errors)
        if message is not None:
            ws.reset()
            raise RuntimeError(message)


def tile_schedules(ids: list[torch.Tensor], num_local: int, num_experts: int, block_m: int):
    """Every rank's schedule (``kernels/mok_schedule.py``) and tile ends: (group_end_PL, tile_end_PL, row_slot_PR)
    int32, from each rank's top-k ids [T, K] (on the device, no host sync)."""
    ranks = len(ids)
    ids_PN = torch.stack([i.reshape(-1) for i in ids]).to(torch.int32)  # slot t·K + j of rank p
    schedules = [mok_schedule(ids_PN, rank, num_local, num_experts) for rank in range(ranks)]
    group_end_PL = torch.stack([group_end for group_end, _ in schedules])
    row_slot_PR = torch.stack([row_slot for _, row_slot in schedules])
    return group_end_PL, tile_ends(group_end_PL, block_m), row_slot_PR


def tile_ends(group_end_VL: torch.Tensor, block_m: int) -> torch.Tensor:
    """int32 [V, L]: cumulative block_m-row tiles per local expert of each schedule's cumulative rows."""
    counts_VL = torch.diff(group_end_VL, dim=1, prepend=group_end_VL.new_zeros(group_end_VL.shape[0], 1))
    return torch.div(counts_VL + block_m - 1, block_m, rounding_mode="floor").cumsum(1).to(torch.int32)


def _as_list(name: str, t, ranks: int | None) -> list:
    if not isinstance(t, (list, tuple)):
        raise TypeError(f"megakernel_routed_experts: {name} must be a list (one per virtual rank), as x_TH; one rank "
                        "of a group (or one alone) calls titan_mok.moe.megakernel_rank.megakernel_rank_routed_experts")
    items = list(t)
    if ranks is not None and len(items) != ranks:
        raise ValueError(f"megakernel_routed_experts: {name} has {len(items)} entries, x_TH {ranks}")
    return items


def _check(xs, weights, ids, shared, expert_weights, num_experts, ep_degree: int, caller: str):
    """(T, K, H, I) after checking one rank's or every virtual rank's inputs (xs etc.: one entry per rank given) and
    the expert weights: all E experts when every rank is given, else the L = E / ep_degree of the rank."""
    num_tokens, dim_h = xs[0].shape
    top_k = ids[0].shape[1] if ids[0].dim() == 2 else -1
    w_gate_EIH, w_up_EIH, w_down_EHI = expert_weights
    for p in range(len(xs)):
        checks = (("x_TH", xs[p], (num_tokens, dim_h), (torch.bfloat16,)),
                  ("weights_TK", weights[p], (num_tokens, top_k), (torch.float32,)),
                  ("topk_idx_TK", ids[p], (num_tokens, top_k), (torch.int32, torch.int64)))
        if shared[p] is not None:
            checks += (("shared_TH", shared[p], (num_tokens, dim_h), (torch.bfloat16, torch.float32)),)
        for name, t, shape, dtypes in checks:
            if tuple(t.shape) != shape or t.dtype not in dtypes or t.device != xs[0].device:
                raise ValueError(f"{caller}: {name} of rank {p} must be {shape} of "
                                 f"{' or '.join(map(str, dtypes))} on {xs[0].device}, got {tuple(t.shape)} "
                                 f"{t.dtype} on {t.device}")
    if not 1 <= top_k <= 64:
        raise ValueError(f"{caller}: top_k = {top_k} must be in [1, 64] (arrival counts in int32)")
    if len({s is None for s in shared}) != 1:
        raise ValueError(f"{caller}: shared_TH must be given for every rank or for none")
    held = num_experts if len(xs) == ep_degree else num_experts // ep_degree  # all experts, or the rank's
    if num_experts % ep_degree or w_gate_EIH.shape[0] != held:
        raise ValueError(f"{caller}: num_experts = {num_experts} must be a multiple of the {ep_degree} ranks, and the "
                         f"weights' first dim ({w_gate_EIH.shape[0]}) {held}: "
                         f"{'all experts' if held == num_experts else 'the experts of the rank'}")
    dim_i = w_gate_EIH.shape[1]
    for name, w, shape in (("w_gate_EIH", w_gate_EIH, (held, dim_i, dim_h)),
                           ("w_up_EIH", w_up_EIH, (held, dim_i, dim_h)),
                           ("w_down_EHI", w_down_EHI, (held, dim_h, dim_i))):
        if tuple(w.shape) != shape or w.dtype != torch.bfloat16 or not w.is_contiguous() or w.device != xs[0].device:
            raise ValueError(f"{caller}: {name} must be a contiguous bfloat16 {shape} on "
                             f"{xs[0].device}, got {w.dtype} {tuple(w.shape)} (contiguous: {w.is_contiguous()})")
    if xs[0].device.type != "cuda" and not interpreting():
        raise ValueError(f"{caller} needs CUDA tensors (or TRITON_INTERPRET=1)")
    return num_tokens, top_k, dim_h, dim_i


def _check_shared_expert(shared_expert, scales, shared, num_tokens, dim_h, device, caller: str) -> int:
    """The in-launch shared expert's size I_S (0: none), after checking it and its per-token scales."""
    if shared_expert is None:
        if any(s is not None for s in scales):
            raise ValueError(f"{caller}: shared_scale_T1 scales the in-launch shared expert's output: "
                             "it needs shared_expert")
        return 0
    if not isinstance(shared_expert, SharedFFN):
        raise TypeError(f"{caller}: shared_expert must be a SharedFFN, got {type(shared_expert)}")
    if any(s is not None for s in shared):
        raise ValueError(f"{caller}: shared_TH and shared_expert both give the shared expert's output: "
                         "pass one of them")
    dim_s = shared_expert.dim
    for name, w, shape in (("w_gate_IH", shared_expert.w_gate_IH, (dim_s, dim_h)),
                           ("w_up_IH", shared_expert.w_up_IH, (dim_s, dim_h)),
                           ("w_down_HI", shared_expert.w_down_HI, (dim_h, dim_s))):
        if tuple(w.shape) != shape or w.dtype != torch.bfloat16 or not w.is_contiguous() or w.device != device:
            raise ValueError(f"{caller}: shared_expert.{name} must be a contiguous bfloat16 {shape} "
                             f"on {device}, got {w.dtype} {tuple(w.shape)} on {w.device} "
                             f"(contiguous: {w.is_contiguous()})")
    if len({s is None for s in scales}) != 1:
        raise ValueError(f"{caller}: shared_scale_T1 must be given for every rank or for none")
    for p, scale in enumerate(scales):
        if scale is not None and (tuple(scale.shape) != (num_tokens, 1) or scale.dtype != torch.float32
                                  or scale.device != device):
            raise ValueError(f"{caller}: shared_scale_T1 of rank {p} must be ({num_tokens}, 1) of "
                             f"torch.float32 on {device}, got {tuple(scale.shape)} {scale.dtype} on {scale.device}")
    return dim_s


@dataclass(frozen=True)
class CheckedCall:
    """A call's sizes, after its inputs were checked (``check_call``)."""

    num_tokens: int
    top_k: int
    dim_h: int
    dim_i: int
    shared_dim: int
    """I_S of the in-launch shared expert; 0: none."""
    serialized: bool
    config: MegakernelConfig
    """Its None sizes filled (``_resolve``)."""
    precision: str = "bf16"
    """The routed experts' GEMM operands: "bf16" or "mxfp8" (the shared expert's stay bf16)."""


def check_call(caller: str, xs, weights, ids, shared, scales, expert_weights, shared_expert: SharedFFN | None, *,
               num_experts: int, ep_degree: int, swiglu_limit: float | None, config: MegakernelConfig,
               serialized: bool | None, stall_rank: int | None, precision: str = "bf16") -> CheckedCall:
    """Every check of a forward call, of one rank (xs etc. one entry) or of every virtual rank (P entries)."""
    if precision not in PRECISIONS:
        raise ValueError(f"{caller}: precision = {precision!r} must be one of {PRECISIONS}")
    shared_weights = () if shared_expert is None else (shared_expert.w_gate_IH, shared_expert.w_up_IH,
                                                        shared_expert.w_down_HI)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (*xs, *weights, *shared, *scales, *expert_weights, *shared_weights)):
        raise NotImplementedError(f"{caller} is forward-only: call it under torch.no_grad(); training runs it through "
                                  "titan_mok.moe.megakernel_autograd ([mok] kernels = 'megakernel')")
    num_tokens, top_k, dim_h, dim_i = _check(xs, weights, ids, shared, expert_weights, num_experts, ep_degree, caller)
    shared_dim = _check_shared_expert(shared_expert, scales, shared, num_tokens, dim_h, xs[0].device, caller)
    serialized = interpreting() if serialized is None else serialized
    if interpreting() and not serialized:
        raise ValueError(f"{caller}: Triton's interpreter runs programs one at a time, so the "
                         "concurrent launch would spin forever; use serialized=True (or None)")
    if stall_rank is not None and not 0 <= stall_rank < ep_degree:
        raise ValueError(f"{caller}: stall_rank = {stall_rank} is not a rank of {ep_degree}")
    if precision == "mxfp8" and (dim_h % MX_BLOCK or dim_i % MX_BLOCK):
        raise ValueError(f"{caller}: precision 'mxfp8' needs H ({dim_h}) and I ({dim_i}) to be multiples of "
                         f"{MX_BLOCK} (the MXFP8 block)")
    num_local = num_experts // ep_degree
    cfg = _resolve(config, len(xs), dim_h, dim_i, num_local, swiglu_limit is not None, shared_expert,
                   xs[0].device, serialized, mx=precision == "mxfp8", rows_per_expert=num_tokens * top_k / num_local,
                   tma_dims=(dim_h, dim_i, shared_dim))
    return CheckedCall(num_tokens, top_k, dim_h, dim_i, shared_dim, serialized, cfg, precision)


def megakernel_routed_experts(
    x_TH: list[torch.Tensor],
    weights_TK: list[torch.Tensor],
    topk_idx_TK: list[torch.Tensor],
    shared_TH: list[torch.Tensor | None],
    expert_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    num_experts: int,
    swiglu_limit: float | None = None,
    out_dtype: torch.dtype | None = None,
    config: MegakernelConfig = MegakernelConfig(),
    serialized: bool | None = None,
    trap: bool = True,
    stall_rank: int | None = None,
    shared_expert: SharedFFN | None = None,
    shared_scale_T1=None,
    precision: str = "bf16",
    weights_owner: object = None,
    weight_sources: tuple | None = None,
    trace: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Routed experts' forward of P virtual ranks on this device: [T, H] → [T, H] in out_dtype (None: x's dtype),
    per rank (module docstring). One rank of a group, or one alone: ``megakernel_rank.megakernel_rank_routed_experts``.

    Args:
        x_TH, weights_TK, topk_idx_TK, shared_TH: lists of P (entry p is virtual rank p's): x bf16 [T, H], weights
            fp32 [T, K], ids int [T, K] in [0, E), shared bf16/fp32 [T, H] or None.
        expert_weights: (w_gate [E, I, H], w_up [E, I, H], w_down [E, H, I]) bf16 contiguous, all E experts
            (virtual rank p computes experts p·L .. p·L + L - 1).
        serialized: the interpreter's phase-by-phase launches (None: under TRITON_INTERPRET=1 only).
        trap: a wait that ran out stops the device with an assertion naming it; False: the launch ends and
            ``raise_on_megakernel_error()`` names it.
        stall_rank: a rank that never publishes (tests the bounded waits).
        shared_expert: the shared expert's weights (and SwiGLU clamp), to run inside the launch on each rank's own
            tokens (then shared_TH is None); its rows are ``SharedExpert(use_triton=True)``'s bf16 output.
        shared_scale_T1: a list of fp32 [T, 1], or None: the shared expert's output times it, in fp32 (Qwen3.5's
            output gate, sigmoid(x · w_gate), computed by the caller).
        precision: the routed experts' GEMM operands, "bf16" or "mxfp8" (then every expert row is the Triton
            grouped FFN's MXFP8 row: x quantized along H on the pull, h along I; the shared expert stays bf16).
        weights_owner, weight_sources: under mxfp8, ``grouped_swiglu_ffn``'s: the MXFP8 weight operands are kept
            under the owner per version of the sources (``launch_weights``); None: quantized on every call.
        trace: int64 [P·(comm + compute programs), 8]: the launch records each program's timings there (a
            diagnostic: ``kernels/mok_megakernel.py``, Trace; a separately compiled kernel).

    Returns:
        the list of P out_TH.
    """
    xs = _as_list("x_TH", x_TH, None)
    weights = _as_list("weights_TK", weights_TK, len(xs))
    ids = _as_list("topk_idx_TK", topk_idx_TK, len(xs))
    shared = _as_list("shared_TH", shared_TH, len(xs))
    # None: no scale for any rank
    scales = [None] * len(xs) if shared_scale_T1 is None else _as_list("shared_scale_T1", shared_scale_T1, len(xs))
    ranks = len(xs)
    call = check_call("megakernel_routed_experts", xs, weights, ids, shared, scales, expert_weights, shared_expert,
                      num_experts=num_experts, ep_degree=ranks, swiglu_limit=swiglu_limit, config=config,
                      serialized=serialized, stall_rank=stall_rank, precision=precision)
    cfg, num_tokens, dim_h = call.config, call.num_tokens, call.dim_h
    device = xs[0].device
    num_local = num_experts // ranks
    key = (device, ranks, num_tokens, call.top_k, dim_h, call.dim_i, num_local, cfg, call.shared_dim, precision)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = _allocate(ranks, num_tokens, call.top_k, dim_h, call.dim_i, call.shared_dim, num_local,
                                     cfg, device)
    ws = _WORKSPACES[key]

    for x_buf_TH, x in zip(ws.symmetric["x_TH"], xs):
        x_buf_TH.copy_(x)
    schedule = tile_schedules(ids, num_local, num_experts, cfg.block_m)
    epoch = ws.next_epoch()
    operands = launch_weights(expert_weights, precision, weights_owner, weight_sources)
    megakernel_launch(ws.bufs, schedule, operands, ws.shape, epoch=epoch, swiglu_limit=swiglu_limit,
                      serialized=call.serialized, shared=shared_expert, trace=trace, stall_rank=stall_rank,
                      timeout_ms=cfg.timeout_ms)
    out_PTH = torch.empty(ranks, num_tokens, dim_h, dtype=out_dtype or xs[0].dtype, device=device)
    shared_PTH = torch.stack(shared) if shared[0] is not None else None
    scale_PT = torch.stack(scales).reshape(ranks, num_tokens) if scales[0] is not None else None
    megakernel_finish(ws.bufs, torch.stack(weights), shared_PTH, out_PTH, ws.shape,
                      arrivals=epoch * ws.shape.arrivals_per_call, serialized=call.serialized, trap=trap,
                      shared_scale_VT=scale_PT, timeout_ms=cfg.timeout_ms)
    return list(out_PTH.unbind(0))
