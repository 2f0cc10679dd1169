"""The routed experts' forward through the MoK megakernel (``kernels/mok_megakernel.py``), and their input gradient
through its dgrad launch (``kernels/mok_megakernel_bwd.py``), on one rank of an expert-parallel group, one GPU each
(or on one rank alone): each rank's launches host only itself (``first_rank = rank``, ``hosted_ranks = 1``) and
reach its peers through symmetric memory.

Legend: P ep degree, T tokens per rank, K top-k, N = T·K slots per rank, H hidden, I expert FFN size, E experts,
L = E / P local experts, R = P·N grouped rows per rank (the most its schedule holds).

Contract: ``megakernel_routed_experts``'s (``titan_mok.moe.megakernel``), per rank: out[t] = cast(shared[t] +
Σ_j w[t,j]·expert_{e[t,j]}(x[t])), the sum in fp32 in ascending slot order j; bitwise the ``"triton"`` path's at the
same EP degree, and a token's output does not depend on P. The dgrad: ``megakernel_routed_dgrad``'s
(``titan_mok.moe.megakernel_bwd``), on the forward call's schedule.

Buffers. The peers touch this rank's x_TH, slots_NH, arrivals_T, x_ready (and ids_N), and for the dgrad dy_NH,
dy_ready: they are the group's mok workspace (``titan_mok.moe.workspace``: one symmetric allocation per (group, T,
K, H, dtype), made collectively at its first call and shared with the ``"triton"`` path, which the backward's row
pull reuses), its int64 [P] address tables the launches' peer tables. The dgrad launch pushes its input-gradient
rows into slots_NH (its ``dx_slots_NH``) and counts them in arrivals_T, as the forward its expert rows. Local to the
rank, allocated at the first call of a (launch, group, T, K, H, I, L, config, shared expert size) and reused by
every layer of that shape: the ring, h, flags and counters of one hosted rank.

Per forward call, all on the current stream, no host sync: x → own x_TH, ids → own ids_N | group barrier | every
rank's ids gathered (peer loads), this rank's schedule (``kernels/mok_schedule.py``, as the ``"triton"`` path's);
the megakernel (pull from the source ranks' x_TH, FFN, push into their slots and arrival counters); the finish (per
token, wait for its K rows, then the ordered fp32 reduction). The one barrier orders the ids: a rank rewrites ids_N
for the next call only after its finish, which waited for a row that a peer pulled after every rank had published
x_ready for this call, so after every rank gathered (kernels/mok_megakernel.py, "Across calls", for x_TH and the
slots).

Dgrad. Per call, on the forward call's schedule (no ids gathered again): w·dY → own dy_NH (``slot_scale``); the
launch (pull w·dY rows from the source ranks' dy_NH, down dgrad through the SwiGLU backward, gate/up dgrad, push
each row's dx into its source's slots_NH and arrival counter); the finish (per token, its K rows summed in fp32,
ascending slot). No barrier: the epochs order it against the forward calls and the fused path's barriers as the
forward's (kernels/mok_megakernel_bwd.py, "Across calls").

Epochs: every rank of the group makes the same megakernel calls, forward and dgrad, in the same order (the same
layers, forward, recomputation and backward, on the same batch shape: the workspace's requirement), so a count kept
per workspace (``MokWorkspace.megakernel_calls``) is the same epoch on every rank, with no exchange; it also keeps
the arrival counters' running total, which both finishes wait for. Before the epoch would leave ``MAX_EPOCH``,
every rank zeroes its flags (both launches') between two group barriers and the count starts over.

Serialized mode (Triton's interpreter): each launch's phases one after another, with the group's barrier after the
publish and after the last round (``megakernel_launch``'s and ``megakernel_bwd_launch``'s phase_barrier), so that
the pull and the finish find their peers' flags already set.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_mok.kernels.mok_combine import slot_scale
from titan_mok.kernels.mok_megakernel import (
    MAX_EPOCH,
    KeptRows,
    LaunchShape,
    MegakernelBuffers,
    SharedFFN,
    megakernel_finish,
    megakernel_launch,
    read_error,
    ring_buffers,
    shared_groups,
)
from titan_mok.kernels.mok_megakernel_bwd import (
    BackwardBuffers,
    GroupedRows,
    megakernel_bwd_finish,
    megakernel_bwd_launch,
)
from titan_mok.kernels.mok_megakernel_bwd import read_error as read_dgrad_error
from titan_mok.kernels.mok_schedule import mok_schedule
from titan_mok.moe.fused import FusedHandle
from titan_mok.moe.megakernel import MegakernelConfig, check_call, launch_shape, launch_weights, tile_ends
from titan_mok.moe.megakernel_bwd import RoutedDgrad, backward_buffers, check_dgrad_call, dgrad_launch_weights
from titan_mok.moe.workspace import MokWorkspace, get_workspace


@dataclass
class _RankWorkspace:
    shape: LaunchShape
    bufs: MegakernelBuffers | BackwardBuffers
    """The hosted rank's (V = 1) ring, flags and counters of one launch kind; its tables are the group workspace's."""
    group_ws: MokWorkspace
    read_error: Callable[[torch.Tensor], str | None]
    """The launch kind's words for its error record."""

    def zero_flags(self) -> None:
        for flag in self.bufs.flags:
            flag.zero_()
        self.bufs.errors.zero_()


_WORKSPACES: dict[tuple, _RankWorkspace] = {}
"""The rank workspaces of this process, forward and dgrad, by (launch kind, device, group, sizes, config)."""


def _rank_workspace(key: tuple, allocate: Callable[[], _RankWorkspace]) -> _RankWorkspace:
    if key not in _WORKSPACES:
        _WORKSPACES[key] = allocate()
    return _WORKSPACES[key]


def _allocate_forward(group_ws: MokWorkspace, num_tokens, top_k, dim_h, dim_i, shared_dim, num_local,
                      cfg: MegakernelConfig, device) -> _RankWorkspace:
    ring, rows = cfg.ring_tiles, cfg.block_m
    groups = shared_groups(num_tokens, rows, cfg.group_tiles) if shared_dim else 0
    slots_f = ring + groups * cfg.group_tiles  # flag slots: the ring's, then the shared expert's tiles'
    bf16 = dict(dtype=torch.bfloat16, device=device)
    flag = lambda *shape, dtype: torch.zeros(1, *shape, dtype=dtype, device=device)  # noqa: E731
    tables = {name: group_ws.tables[name] for name in ("x_TH", "slots_NH", "arrivals_T", "x_ready")}
    bufs = MegakernelBuffers(
        **ring_buffers(1, ring, rows, dim_h, dim_i, device),
        ready_VQ=flag(ring, dtype=torch.int64),
        h_ready_VF=flag(slots_f, dtype=torch.int64),
        consumed_VF=flag(slots_f, dtype=torch.int64),
        gate_up_done_VF=flag(slots_f, dtype=torch.int32),
        down_done_VF=flag(slots_f, dtype=torch.int32),
        next_item_V=flag(dtype=torch.int32),
        programs_done_V=flag(dtype=torch.int32),
        tables=tables,
        errors=torch.zeros(6, dtype=torch.int64, device=device),
        shared_h_VRI=torch.zeros(1, groups * cfg.group_tiles * rows, shared_dim, **bf16) if groups else None,
        shared_out_VTH=torch.zeros(1, num_tokens, dim_h, **bf16) if groups else None,
    )
    shape = launch_shape(cfg, group_ws.ep_degree, num_tokens, top_k, num_local, groups, rank=group_ws.ep_rank)
    return _RankWorkspace(shape, bufs, group_ws, read_error)


def _allocate_dgrad(group_ws: MokWorkspace, num_tokens, top_k, dim_h, dim_i, num_local, precision,
                    cfg: MegakernelConfig, device) -> _RankWorkspace:
    # the input-gradient rows go where the forward's expert rows went (slots_NH), counted by the same arrival
    # counters: the calls' epochs and running total are the workspace's, whichever launch makes them
    tables = {"dy_NH": group_ws.tables["dy_NH"], "dx_slots_NH": group_ws.tables["slots_NH"],
              "arrivals_T": group_ws.tables["arrivals_T"], "dy_ready": group_ws.tables["dy_ready"]}
    bufs = backward_buffers(1, cfg.ring_tiles, cfg.block_m, dim_h, dim_i, precision, tables, device)
    shape = launch_shape(cfg, group_ws.ep_degree, num_tokens, top_k, num_local, rank=group_ws.ep_rank)
    return _RankWorkspace(shape, bufs, group_ws, read_dgrad_error)


def _restart_epochs(group_ws: MokWorkspace, *, synchronized: bool) -> None:
    """Zero the group workspace's megakernel flags, and those of every rank workspace on it; epochs start over.
    synchronized: between two group barriers (every rank calls it at the same call): no peer's launch still reads
    this rank's flags, and none reads them before they are zero."""
    if synchronized:
        group_ws.barrier()
    group_ws.arrivals_T.zero_()
    group_ws.x_ready.zero_()
    group_ws.dy_ready.zero_()
    for ws in _WORKSPACES.values():
        if ws.group_ws is group_ws:
            ws.zero_flags()
    group_ws.megakernel_calls.epoch = group_ws.megakernel_calls.arrivals = 0
    if synchronized:
        group_ws.barrier()


def _next_call(ws: _RankWorkspace) -> tuple[int, int]:
    """(epoch, arrivals) of this call: the same on every rank (module docstring, Epochs)."""
    calls = ws.group_ws.megakernel_calls
    if calls.epoch >= MAX_EPOCH:  # arrivals <= epoch·(K + 1) stays inside int32 (K <= 64) below it
        _restart_epochs(ws.group_ws, synchronized=True)
    calls.epoch += 1
    calls.arrivals += ws.shape.arrivals_per_call
    return calls.epoch, calls.arrivals


def raise_on_megakernel_rank_error() -> None:
    """Raise RuntimeError naming the wait that ran out in any rank workspace of this process, forward or dgrad (then
    zero its flags and restart its epochs, without barriers: at EP > 1 a peer's call is left unfinished too, so the
    group cannot go on unless every rank restarts at the same point). For calls made with ``trap=False``. NOTE: host
    sync."""
    for ws in _WORKSPACES.values():
        message = ws.read_error(ws.bufs.errors)
        if message is not None:
            _restart_epochs(ws.group_ws, synchronized=False)
            raise RuntimeError(message)


def megakernel_rank_forward(
    x_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    shared_TH: torch.Tensor | None,
    expert_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    num_experts: int,
    group: dist.ProcessGroup | None,
    swiglu_limit: float | None = None,
    out_dtype: torch.dtype | None = None,
    config: MegakernelConfig = MegakernelConfig(),
    serialized: bool | None = None,
    trap: bool = True,
    stall_rank: int | None = None,
    shared_expert: SharedFFN | None = None,
    shared_scale_T1: torch.Tensor | None = None,
    precision: str = "bf16",
    weights_owner: object = None,
    weight_sources: tuple | None = None,
    keep_rows: bool = False,
) -> tuple[torch.Tensor, FusedHandle, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """(out_TH, this call's schedule as the ``"triton"`` path's handle: its rows, on the same workspace, and with
    keep_rows its rows' g, u, h), for the backward (``titan_mok.moe.megakernel_autograd``). Arguments:
    ``megakernel_rank_routed_experts``'s; keep_rows: the launch also stores each schedule row's g, u and h, bf16
    [R, I] each (R = P·T·K, row r: schedule row r, rows past the schedule's end unwritten), the bits
    ``grouped_gate_up_swiglu`` gives on the schedule's rows (MXFP8: h before its quantization); allocated per call,
    3·R·I·2 bytes."""
    ep_degree = 1 if group is None else dist.get_world_size(group)
    caller = "megakernel_rank_routed_experts"
    call = check_call(caller, [x_TH], [weights_TK], [topk_idx_TK], [shared_TH], [shared_scale_T1], expert_weights,
                      shared_expert, num_experts=num_experts, ep_degree=ep_degree, swiglu_limit=swiglu_limit,
                      config=config, serialized=serialized, stall_rank=stall_rank, precision=precision)
    cfg, num_tokens, top_k, dim_h = call.config, call.num_tokens, call.top_k, call.dim_h
    device = x_TH.device
    num_local = num_experts // ep_degree
    group_ws = get_workspace(group, num_tokens, top_k, dim_h, torch.bfloat16, device)
    key = ("forward", device, None if group is None else group.group_name, num_tokens, top_k, dim_h, call.dim_i,
           num_local, cfg, call.shared_dim, precision)
    ws = _rank_workspace(key, lambda: _allocate_forward(group_ws, num_tokens, top_k, dim_h, call.dim_i,
                                                        call.shared_dim, num_local, cfg, device))

    group_ws.x_TH.copy_(x_TH)
    group_ws.ids_N.copy_(topk_idx_TK.reshape(-1))  # int64 → int32, slot t·K + j
    ids_PN = torch.empty(ep_degree, num_tokens * top_k, dtype=torch.int32, device=device)
    group_ws.barrier()
    group_ws.gather_ids(ids_PN)
    group_end_L, row_slot_R = mok_schedule(ids_PN, group_ws.ep_rank, num_local, num_experts)
    schedule = (group_end_L[None], tile_ends(group_end_L[None], cfg.block_m), row_slot_R[None])
    epoch, arrivals = _next_call(ws)
    operands = launch_weights(expert_weights, precision, weights_owner, weight_sources)
    kept = None
    if keep_rows:
        rows = ep_degree * num_tokens * top_k
        kept = KeptRows(*(torch.empty(1, rows, call.dim_i, dtype=torch.bfloat16, device=device) for _ in range(3)))
    megakernel_launch(ws.bufs, schedule, operands, ws.shape, epoch=epoch, swiglu_limit=swiglu_limit,
                      serialized=call.serialized, shared=shared_expert, kept=kept, stall_rank=stall_rank,
                      timeout_ms=cfg.timeout_ms, phase_barrier=group_ws.barrier)
    out_1TH = torch.empty(1, num_tokens, dim_h, dtype=out_dtype or x_TH.dtype, device=device)
    megakernel_finish(ws.bufs, weights_TK[None], None if shared_TH is None else shared_TH[None], out_1TH, ws.shape,
                      arrivals=arrivals, serialized=call.serialized, trap=trap,
                      shared_scale_VT=None if shared_scale_T1 is None else shared_scale_T1.reshape(1, num_tokens),
                      timeout_ms=cfg.timeout_ms)
    kept_rows = None if kept is None else tuple(t[0] for t in kept)
    return out_1TH[0], FusedHandle(num_tokens, top_k, row_slot_R, group_end_L, group_ws), kept_rows


def megakernel_rank_routed_experts(
    x_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    shared_TH: torch.Tensor | None,
    expert_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    **options,
) -> torch.Tensor:
    """Routed experts' forward of this rank: [T, H] → [T, H] in out_dtype (None: x's dtype) (module docstring).
    Every rank of ``group`` calls it with the same T, K, H and options, in the same order (its calls are
    collective).

    Args:
        x_TH, weights_TK, topk_idx_TK, shared_TH: this rank's x bf16 [T, H], combine weights fp32 [T, K], ids int
            [T, K] in [0, E), shared output bf16/fp32 [T, H] or None.
        expert_weights: (w_gate [L, I, H], w_up [L, I, H], w_down [L, H, I]) bf16 contiguous: this rank's
            experts, rank·L .. rank·L + L - 1 (all E with no group).
        group: the expert-parallel group (None: this rank alone, P = 1).
        options: ``megakernel_routed_experts``'s swiglu_limit, out_dtype, config, serialized, trap (False: then
            ``raise_on_megakernel_rank_error()`` names the wait), stall_rank (a rank whose launch publishes
            nothing), shared_expert, shared_scale_T1 (fp32 [T, 1]), precision ("bf16" or "mxfp8"), weights_owner
            and weight_sources (mxfp8: where the weight operands are kept).
    """
    out_TH, _, _ = megakernel_rank_forward(x_TH, weights_TK, topk_idx_TK, shared_TH, expert_weights,
                                        num_experts=num_experts, group=group, **options)
    return out_TH



def megakernel_rank_dgrad(
    dout_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_RI: torch.Tensor,
    up_RI: torch.Tensor,
    expert_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    schedule: FusedHandle,
    *,
    num_experts: int,
    group: dist.ProcessGroup | None,
    swiglu_limit: float | None = None,
    config: MegakernelConfig = MegakernelConfig(),
    serialized: bool | None = None,
    trap: bool = True,
    stall_rank: int | None = None,
    precision: str = "bf16",
    weights_owner: object = None,
    weight_sources: tuple | None = None,
) -> RoutedDgrad:
    """This rank's input gradient through the dgrad launch (module docstring, Dgrad; ``megakernel_bwd``'s contract:
    bitwise the ``"triton"`` path's) and the grouped rows its weight gradients read. Not differentiable (a backward's
    piece). Every rank of ``group`` calls it in the same order as its other megakernel calls (they are collective).

    Args:
        dout_TH, weights_TK: this rank's output gradient bf16 or fp32 [T, H] and combine weights fp32 [T, K].
        gate_RI, up_RI: the forward's g and u rows bf16 [R, I] (R = P·T·K) in the order of its schedule (rows past
            its end: any values): ``megakernel_rank_forward(keep_rows=True)``'s.
        expert_weights: (w_gate [L, I, H], w_up [L, I, H], w_down [L, H, I]) bf16 contiguous: this rank's experts
            (under mxfp8 also FSDP's MXFP8-gathered weights).
        schedule: the forward call's (``megakernel_rank_forward``'s handle): its rows, on the group's workspace.
        group: the expert-parallel group (None: this rank alone, P = 1).
        config: the launch's sizes (the layer's, as the forward call's); its ``gemm`` and ``block_m`` for the
            dgrad launch, None its measured defaults: ``MegakernelConfig.gemm``, ``MegakernelConfig.block_m``.
        serialized, trap, stall_rank: as ``megakernel_rank_routed_experts``'s (``raise_on_megakernel_rank_error()``
            names a wait of either launch).
        precision, weights_owner, weight_sources: ``megakernel_routed_dgrad``'s (mxfp8: the Triton grouped FFN's
            MXFP8 dgrad, on the dgrad operands kept under weights_owner or gathered).
    """
    ep_degree = 1 if group is None else dist.get_world_size(group)
    call = check_dgrad_call("megakernel_rank_dgrad", [dout_TH], [weights_TK], [gate_RI], [up_RI], expert_weights,
                            num_experts=num_experts, ep_degree=ep_degree, swiglu_limit=swiglu_limit, config=config,
                            serialized=serialized, stall_rank=stall_rank, precision=precision)
    cfg, num_tokens, top_k, dim_h, dim_i = call.config, call.num_tokens, call.top_k, call.dim_h, call.dim_i
    device = dout_TH.device
    num_local, rows = num_experts // ep_degree, ep_degree * num_tokens * top_k
    group_ws = get_workspace(group, num_tokens, top_k, dim_h, torch.bfloat16, device)
    if schedule.workspace is not group_ws or schedule.group_end.shape != (num_local,) or (
            schedule.row_slot_R.shape != (rows,)):
        raise ValueError(f"megakernel_rank_dgrad: schedule must be the forward call's on this group's workspace, "
                         f"with group_end [{num_local}] and row_slot_R [{rows}], got "
                         f"{tuple(schedule.group_end.shape)} and {tuple(schedule.row_slot_R.shape)}"
                         f"{'' if schedule.workspace is group_ws else ' on another workspace'}")
    key = ("dgrad", device, None if group is None else group.group_name, num_tokens, top_k, dim_h, dim_i, num_local,
           cfg, precision)
    ws = _rank_workspace(key, lambda: _allocate_dgrad(group_ws, num_tokens, top_k, dim_h, dim_i, num_local, precision,
                                                      cfg, device))

    slot_scale(weights_TK.contiguous(), dout_TH.contiguous(), group_ws.dy_NH.view(num_tokens, top_k, dim_h))
    group_end_1L = schedule.group_end[None]
    tiles = (group_end_1L, tile_ends(group_end_1L, cfg.block_m), schedule.row_slot_R[None])
    grouped = lambda n: torch.empty(1, rows, n, dtype=torch.bfloat16, device=device)  # noqa: E731
    grouped_rows = GroupedRows(gate_RI.contiguous()[None], up_RI.contiguous()[None], grouped(dim_i), grouped(dim_i),
                               grouped(dim_h))
    epoch, arrivals = _next_call(ws)
    operands = dgrad_launch_weights(expert_weights, precision, weights_owner, weight_sources)
    megakernel_bwd_launch(ws.bufs, tiles, operands, grouped_rows, ws.shape, epoch=epoch,
                          swiglu_limit=swiglu_limit, serialized=call.serialized, stall_rank=stall_rank,
                          timeout_ms=cfg.timeout_ms, phase_barrier=group_ws.barrier)
    dx_1TH = torch.empty(1, num_tokens, dim_h, dtype=torch.bfloat16, device=device)
    megakernel_bwd_finish(ws.bufs, dx_1TH, ws.shape, arrivals=arrivals, serialized=call.serialized, trap=trap,
                          timeout_ms=cfg.timeout_ms)
    return RoutedDgrad(dx_1TH[0], grouped_rows.dy_VRH[0], grouped_rows.dgate_VRI[0], grouped_rows.dup_VRI[0],
                       schedule.group_end)
