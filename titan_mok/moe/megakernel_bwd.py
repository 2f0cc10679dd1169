"""The routed experts' input gradient (dgrad) through the MoK megakernel's backward launch
(``kernels/mok_megakernel_bwd.py``) for P virtual ranks on one device (virtual EP), and what every host of the dgrad
launch shares: its checks and buffers. A rank of a real EP group (or one rank alone; training's path):
``titan_mok.moe.megakernel_rank.megakernel_rank_dgrad``.

Legend: P ep degree (virtual ranks on this device), T tokens per rank, K top-k, N = T·K, R = P·N grouped rows
per rank (the most its schedule holds), H hidden, I expert FFN size, E experts, L = E / P local experts per rank.

Contract of ``megakernel_routed_dgrad``, per rank, given the layer's output gradient dout and the forward's g, u
rows in the order of the rank's schedule (``kernels/mok_schedule.py``, the forward megakernel's: per local expert,
(source rank, token, slot) order): dy[t, j] = cast(w[t,j]·dout[t]) (``mok_combine.slot_scale``), then per grouped
row the down projection's dgrad through the SwiGLU backward (dgate, dup) and the gate/up dgrad (dx row), and dx[t] =
cast(Σ_j dx_row(t, j)) in fp32, ascending j: bitwise the ``"triton"`` path's (``grouped_down_dgrad_swiglu``,
``grouped_mm_sum``, ``slot_reduce``) whatever P; with ``precision="mxfp8"`` that path's MXFP8 dgrad (dy quantized
along H, dgate and dup along I, the weights' dgrad operands kept under ``weights_owner`` as the Triton grouped FFN
keeps them, or FSDP's MXFP8-gathered weights as gathered). Under virtual EP rank p holds experts p·L .. p·L + L - 1
and the rows travel through the other virtual ranks' buffers as between GPUs.

Per call, all on the current stream, no host sync: each rank's w·dY slots into its dy buffer (``slot_scale``); the
schedule; the backward launch (pull, D1, D2, push); the finish (per token, wait for its K rows, then the ordered
fp32 sum). The workspace of a (device, P, T, K, H, I, config, precision) is allocated at its first call and reused
(per-call epochs, as the forward's). The grouped rows dy, dgate, dup come back for the weight gradients
(``grouped_gemm.grouped_wgrads``); rows past a rank's last expert's end are not written.

Not here: the weight gradients, the combine weights' gradient.
"""

from dataclasses import dataclass

import torch

from titan_mok.kernels.grouped_ffn import dgrad_weight_operands, interpreting
from titan_mok.kernels.mok_combine import slot_scale
from titan_mok.kernels.mok_megakernel_bwd import (
    BackwardBuffers,
    GroupedRows,
    check_tma_loads,
    co_resident_programs_bwd,
    megakernel_bwd_finish,
    megakernel_bwd_launch,
    read_error,
    tma_loads_fit,
)
from titan_mok.kernels.mxfp8 import BLOCK as MX_BLOCK
from titan_mok.kernels.tile_configs import PRECISIONS
from titan_mok.moe.megakernel import (
    MegakernelConfig,
    _resolve,
    _Workspace,
    launch_shape,
    tile_schedules,
    virtual_symmetric,
)


@dataclass(frozen=True)
class RoutedDgrad:
    """One rank's input gradient and the grouped rows its weight gradients read (row r: its schedule's row r)."""

    dx_TH: torch.Tensor
    """bf16 [T, H]: the gradient of the rank's token rows through the routed experts."""
    dy_RH: torch.Tensor
    """bf16 [R, H]: w·dY of each grouped row (w_down's weight gradient: dy.T @ h)."""
    dgate_RI: torch.Tensor
    """bf16 [R, I] (w_gate's: dgate.T @ x)."""
    dup_RI: torch.Tensor
    """bf16 [R, I] (w_up's: dup.T @ x)."""
    group_end_L: torch.Tensor
    """int32 [L]: the rank's schedule's cumulative rows per local expert."""


_WORKSPACES: dict[tuple, _Workspace] = {}


def backward_buffers(ranks: int, ring_tiles: int, block_m: int, dim_h: int, dim_i: int, precision: str,
                     tables: dict[str, torch.Tensor], device) -> BackwardBuffers:
    """The dgrad launch's buffers of ``ranks`` hosted ranks, zeroed, on the given symmetric buffers' address
    tables ("dy_NH", "dx_slots_NH", "arrivals_T", "dy_ready"); under mxfp8 with the slots' dgate, dup tiles of
    MXFP8 values (2·Q·M·I·2 bytes per rank more)."""
    flag = lambda *shape, dtype: torch.zeros(ranks, *shape, dtype=dtype, device=device)  # noqa: E731
    mx_tile = lambda: (torch.zeros(ranks, ring_tiles, block_m, dim_i, dtype=torch.bfloat16, device=device)  # noqa: E731
                       if precision == "mxfp8" else None)
    return BackwardBuffers(
        ring_VQMH=torch.zeros(ranks, ring_tiles, block_m, dim_h, dtype=torch.bfloat16, device=device),
        ready_VQ=flag(ring_tiles, dtype=torch.int64),
        dgrad_ready_VQ=flag(ring_tiles, dtype=torch.int64),
        consumed_VQ=flag(ring_tiles, dtype=torch.int64),
        d1_done_VQ=flag(ring_tiles, dtype=torch.int32),
        d2_done_VQ=flag(ring_tiles, dtype=torch.int32),
        next_item_V=flag(dtype=torch.int32),
        programs_done_V=flag(dtype=torch.int32),
        tables=tables,
        errors=torch.zeros(6, dtype=torch.int64, device=device),
        dgate_mx_VQMI=mx_tile(),
        dup_mx_VQMI=mx_tile(),
    )


def _allocate(ranks, num_tokens, top_k, dim_h, dim_i, num_local, precision, cfg: MegakernelConfig,
              device) -> _Workspace:
    slots = num_tokens * top_k
    symmetric, tables = virtual_symmetric(ranks, {
        "dy_NH": ((slots, dim_h), torch.bfloat16), "dx_slots_NH": ((slots, dim_h), torch.bfloat16),
        "arrivals_T": ((num_tokens,), torch.int32), "dy_ready": ((1,), torch.int64)}, device)
    bufs = backward_buffers(ranks, cfg.ring_tiles, cfg.block_m, dim_h, dim_i, precision, tables, device)
    shape = launch_shape(cfg, ranks, num_tokens, top_k, num_local)
    return _Workspace(shape, bufs, symmetric, [*bufs.flags, *symmetric["arrivals_T"], *symmetric["dy_ready"]],
                      cfg.timeout_ms)


def dgrad_launch_weights(expert_weights: tuple, precision: str, weights_owner: object = None,
                         weight_sources: tuple | None = None) -> tuple:
    """The routed weights as the dgrad launch reads them: bf16 as given (it reads them transposed), or under mxfp8
    the very dgrad operands the Triton grouped FFN's backward reads (``grouped_ffn.dgrad_weight_operands``: kept
    under ``weights_owner`` per weight version; FSDP's MXFP8-gathered weights as gathered). The launch quantizes no
    weight."""
    if precision == "bf16":
        return tuple(expert_weights)
    return dgrad_weight_operands(tuple(expert_weights), precision, weights_owner=weights_owner,
                                 weight_sources=weight_sources)


def raise_on_megakernel_bwd_error() -> None:
    """Raise RuntimeError naming the wait that ran out in any backward workspace of this process (then reset it so
    that it can run again). For calls made with ``trap=False``. NOTE: host sync (reads the error records)."""
    for ws in _WORKSPACES.values():
        message = read_error(ws.bufs.errors)
        if message is not None:
            ws.reset()
            raise RuntimeError(message)


def _listed(name: str, t, ranks: int | None, virtual: bool) -> list:
    if virtual != isinstance(t, (list, tuple)):
        raise TypeError(f"megakernel_routed_dgrad: {name} must be a list (one per virtual rank) exactly when "
                        "dout_TH is")
    items = list(t) if virtual else [t]
    if ranks is not None and len(items) != ranks:
        raise ValueError(f"megakernel_routed_dgrad: {name} has {len(items)} entries, dout_TH {ranks}")
    return items


@dataclass(frozen=True)
class CheckedDgrad:
    """A dgrad call's sizes, after its inputs were checked (``check_dgrad_call``)."""

    num_tokens: int
    top_k: int
    dim_h: int
    dim_i: int
    serialized: bool
    config: MegakernelConfig
    """Its None sizes filled (``_resolve``, for the dgrad launch's kernel)."""


def check_dgrad_call(caller: str, douts, weights, gates, ups, expert_weights, *, num_experts: int, ep_degree: int,
                     swiglu_limit: float | None, config: MegakernelConfig, serialized: bool | None,
                     stall_rank: int | None, precision: str = "bf16") -> CheckedDgrad:
    """Every check of a dgrad call, of one rank (douts etc. one entry) or of every virtual rank (P entries); the
    expert weights: all E experts when every rank is given, else the L = E / ep_degree of the rank (under mxfp8
    also FSDP's MXFP8-gathered weights)."""
    if precision not in PRECISIONS:
        raise ValueError(f"{caller}: precision = {precision!r} must be one of {PRECISIONS}")
    num_tokens, dim_h = douts[0].shape if douts[0].dim() == 2 else (-1, -1)
    top_k = weights[0].shape[1] if weights[0].dim() == 2 else -1
    device = douts[0].device
    if not 1 <= top_k <= 64:
        raise ValueError(f"{caller}: top_k = {top_k} (weights_TK's second dim) must be in [1, 64] (arrival counts in "
                         "int32)")
    w_gate_EIH, w_up_EIH, w_down_EHI = expert_weights
    held = num_experts if len(douts) == ep_degree else num_experts // ep_degree  # all experts, or the rank's
    if num_experts % ep_degree or w_gate_EIH.dim() != 3 or w_gate_EIH.shape[0] != held:
        raise ValueError(f"{caller}: num_experts = {num_experts} must be a multiple of the {ep_degree} ranks, and the "
                         f"weights' first dim (w_gate_EIH {tuple(w_gate_EIH.shape)}) {held}: "
                         f"{'all experts' if held == num_experts else 'the experts of the rank'}")
    dim_i = w_gate_EIH.shape[1]
    for name, w, shape in (("w_gate_EIH", w_gate_EIH, (held, dim_i, dim_h)),
                           ("w_up_EIH", w_up_EIH, (held, dim_i, dim_h)),
                           ("w_down_EHI", w_down_EHI, (held, dim_h, dim_i))):
        if tuple(w.shape) != shape or w.dtype != torch.bfloat16 or not w.is_contiguous() or w.device != device:
            raise ValueError(f"{caller}: {name} must be a contiguous bfloat16 {shape} on {device}, "
                             f"got {w.dtype} {tuple(w.shape)} on {w.device} (contiguous: {w.is_contiguous()})")
    rows = ep_degree * num_tokens * top_k
    for p in range(len(douts)):
        # dout: the layer's output dtype (fp32 under AMP with a gated shared expert); w·dY is rounded to bf16
        for name, t, shape, dtypes in (("dout_TH", douts[p], (num_tokens, dim_h), (torch.bfloat16, torch.float32)),
                                       ("weights_TK", weights[p], (num_tokens, top_k), (torch.float32,)),
                                       ("gate_RI", gates[p], (rows, dim_i), (torch.bfloat16,)),
                                       ("up_RI", ups[p], (rows, dim_i), (torch.bfloat16,))):
            if tuple(t.shape) != shape or t.dtype not in dtypes or t.device != device:
                raise ValueError(f"{caller}: {name} of rank {p} must be {shape} of "
                                 f"{' or '.join(map(str, dtypes))} on {device}, got {tuple(t.shape)} {t.dtype} on "
                                 f"{t.device}")
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"{caller} needs CUDA tensors (or TRITON_INTERPRET=1)")
    serialized = interpreting() if serialized is None else serialized
    if interpreting() and not serialized:
        raise ValueError(f"{caller}: Triton's interpreter runs programs one at a time, so the concurrent launch "
                         "would spin forever; use serialized=True (or None)")
    if stall_rank is not None and not 0 <= stall_rank < ep_degree:
        raise ValueError(f"{caller}: stall_rank = {stall_rank} is not a rank of {ep_degree}")
    if precision == "mxfp8" and (dim_h % MX_BLOCK or dim_i % MX_BLOCK):
        raise ValueError(f"{caller}: precision 'mxfp8' needs H ({dim_h}) and I ({dim_i}) to be multiples of "
                         f"{MX_BLOCK} (the MXFP8 block)")
    mx = precision == "mxfp8"
    if config.gemm == "tma":
        check_tma_loads(caller, "MegakernelConfig.gemm", dim_h, dim_i, mx)
    # None sizes, the fastest measured (docs/performance.md, the backward megakernel): bf16 as the forward's (TMA
    # loads where the K-step rule allows them, 128-row tiles from 128 rows per expert); MXFP8 pointer loads on
    # 64-row tiles (its TMA and 128-row variants were slower at 2,048 and 8,192 tokens per GPU)
    cfg = _resolve(config, len(douts), dim_h, dim_i, num_experts // ep_degree, swiglu_limit is not None, None, device,
                   serialized, co_resident=co_resident_programs_bwd, mx=mx,
                   rows_per_expert=0.0 if mx else num_tokens * top_k * ep_degree / num_experts,
                   tma_dims=(dim_h, dim_i) if not mx and tma_loads_fit(dim_h, dim_i, mx) else None)
    return CheckedDgrad(num_tokens, top_k, dim_h, dim_i, serialized, cfg)


def megakernel_routed_dgrad(
    dout_TH,
    weights_TK,
    topk_idx_TK,
    gate_RI,
    up_RI,
    expert_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    num_experts: int,
    swiglu_limit: float | None = None,
    config: MegakernelConfig = MegakernelConfig(),
    serialized: bool | None = None,
    trap: bool = True,
    stall_rank: int | None = None,
    precision: str = "bf16",
    weights_owner: object = None,
    weight_sources: tuple | None = None,
):
    """Routed experts' input gradient, per rank (module docstring). Not differentiable (a backward's piece).

    Args:
        dout_TH, weights_TK, topk_idx_TK, gate_RI, up_RI: one rank's tensors, or lists of P (virtual EP: entry p is
            rank p's): dout bf16 or fp32 [T, H], combine weights fp32 [T, K], ids int [T, K] in [0, E), the
            forward's g and u rows bf16 [R, I] in the rank's schedule's row order (rows past its end: any values).
        expert_weights: (w_gate [E, I, H], w_up [E, I, H], w_down [E, H, I]) bf16 contiguous, all E experts.
        serialized: the interpreter's phase-by-phase launches (None: under TRITON_INTERPRET=1 only).
        trap: a wait that ran out stops the device with an assertion naming it; False: the launch ends and
            ``raise_on_megakernel_bwd_error()`` names it.
        stall_rank: a rank that never publishes (tests the bounded waits).
        precision: the GEMMs' operands, "bf16" or "mxfp8" (the Triton grouped FFN's MXFP8 dgrad: dy quantized
            along H on the pull, dgate and dup along I, the weights' dgrad operands, ``dgrad_weight_operands``).
        weights_owner, weight_sources: under mxfp8, where those operands are kept (``grouped_swiglu_ffn``'s).

    Returns:
        RoutedDgrad, or the list of P of them.
    """
    virtual = isinstance(dout_TH, (list, tuple))
    douts = _listed("dout_TH", dout_TH, None, virtual)
    weights = _listed("weights_TK", weights_TK, len(douts), virtual)
    ids = _listed("topk_idx_TK", topk_idx_TK, len(douts), virtual)
    gates = _listed("gate_RI", gate_RI, len(douts), virtual)
    ups = _listed("up_RI", up_RI, len(douts), virtual)
    ranks = len(douts)
    call = check_dgrad_call("megakernel_routed_dgrad", douts, weights, gates, ups, expert_weights,
                            num_experts=num_experts, ep_degree=ranks, swiglu_limit=swiglu_limit, config=config,
                            serialized=serialized, stall_rank=stall_rank, precision=precision)
    num_tokens, top_k, dim_h, dim_i, serialized, cfg = (call.num_tokens, call.top_k, call.dim_h, call.dim_i,
                                                        call.serialized, call.config)
    for p, t in enumerate(ids):
        if tuple(t.shape) != (num_tokens, top_k) or t.dtype not in (torch.int32, torch.int64) or (
                t.device != douts[0].device):
            raise ValueError(f"megakernel_routed_dgrad: topk_idx_TK of rank {p} must be {(num_tokens, top_k)} of "
                             f"torch.int32 or torch.int64 on {douts[0].device}, got {tuple(t.shape)} {t.dtype} on "
                             f"{t.device}")
    device = douts[0].device
    num_local = num_experts // ranks
    key = (device, ranks, num_tokens, top_k, dim_h, dim_i, num_local, cfg, precision)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = _allocate(ranks, num_tokens, top_k, dim_h, dim_i, num_local, precision, cfg, device)
    ws = _WORKSPACES[key]

    for dy_NH, w_TK, dout in zip(ws.symmetric["dy_NH"], weights, douts):
        slot_scale(w_TK.contiguous(), dout.contiguous(), dy_NH.view(num_tokens, top_k, dim_h))
    schedule = tile_schedules(ids, num_local, num_experts, cfg.block_m)
    rows_per_rank = ranks * num_tokens * top_k
    grouped = lambda n: torch.empty(ranks, rows_per_rank, n, dtype=torch.bfloat16, device=device)  # noqa: E731
    rows = GroupedRows(torch.stack(gates).contiguous(), torch.stack(ups).contiguous(), grouped(dim_i),
                       grouped(dim_i), grouped(dim_h))
    epoch = ws.next_epoch()
    operands = dgrad_launch_weights(expert_weights, precision, weights_owner, weight_sources)
    megakernel_bwd_launch(ws.bufs, schedule, operands, rows, ws.shape, epoch=epoch, swiglu_limit=swiglu_limit,
                          serialized=serialized, stall_rank=stall_rank, timeout_ms=cfg.timeout_ms)
    dx_PTH = torch.empty(ranks, num_tokens, dim_h, dtype=torch.bfloat16, device=device)
    megakernel_bwd_finish(ws.bufs, dx_PTH, ws.shape, arrivals=epoch * top_k, serialized=serialized, trap=trap,
                          timeout_ms=cfg.timeout_ms)
    out = [RoutedDgrad(dx_PTH[p], rows.dy_VRH[p], rows.dgate_VRI[p], rows.dup_VRI[p], schedule[0][p])
           for p in range(ranks)]
    return out if virtual else out[0]
