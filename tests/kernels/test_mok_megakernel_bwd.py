"""The MoK megakernel's dgrad launch (kernels/mok_megakernel_bwd.py via titan_mok.moe.megakernel_bwd) on CPU, in
Triton's interpreter, serialized (publish, then per ring round: pull, D1 items, D2 items; waits are assertions), at
virtual EP.

The bits it must give: the "triton" path's dgrad kernels on the same rows, computed at EP = 1 on all P ranks'
tokens at once: w·dY by ``slot_scale``, the grouped rows by the schedule, g and u by ``grouped_gate_up_swiglu``,
dgate and dup by ``grouped_down_dgrad_swiglu``, the rows' dx by ``grouped_mm_sum``, a token's dx by
``slot_reduce``. A grouped row of rank p's schedule is matched with the EP = 1 row of the same gathered slot
(p'·N + t·K + j is the slot's index among all P·N). So each test also holds the gradients independent of P and of
the batch. Compared with torch.equal. GPU (the concurrent launch): test_mok_megakernel_bwd_gpu.py.
"""

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.torchrun import REPO
from tests.kernels.test_mok_megakernel import DEVICE, E, I, K, ORDERS, SMALL, T, routing
from titan_mok.kernels import weight_cache
from titan_mok.kernels.grouped_ffn import weight_operand
from titan_mok.kernels.grouped_gemm import grouped_down_dgrad_swiglu, grouped_gate_up_swiglu, grouped_mm_sum
from titan_mok.kernels.mok_combine import slot_reduce, slot_scale
from titan_mok.kernels.mok_megakernel_bwd import (
    PHASE_COMM,
    PHASE_D1,
    PHASE_D2,
    PHASE_PUBLISH,
    GroupedRows,
    megakernel_bwd_phase,
    read_error,
)
from titan_mok.kernels.mok_schedule import mok_schedule
from titan_mok.kernels.mxfp8_gathered import GatheredOperands, MXFP8GatheredWeight
from titan_mok.moe import megakernel_bwd as mkb
from titan_mok.moe.megakernel import MegakernelConfig, tile_schedules
from titan_mok.moe.megakernel_bwd import dgrad_launch_weights, megakernel_routed_dgrad, raise_on_megakernel_bwd_error

NAMES = ("w_gate_EIH", "w_up_EIH", "w_down_EHI")
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the interpreter's serialized mode; on a GPU see test_mok_megakernel_bwd_gpu.py")


def backward_inputs(ranks: int, dim_h: int, seed: int = 1, tokens: int = T, dim_i: int = I):
    """x, dout bf16 [P·T, H], combine weights fp32 [P·T, K]; expert weights (w_gate, w_up, w_down) bf16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ranks * tokens, dim_h, generator=g).to(torch.bfloat16)
    dout = torch.randn(ranks * tokens, dim_h, generator=g).to(torch.bfloat16)
    weights = torch.rand(ranks * tokens, K, generator=g)
    w_gate = (torch.randn(E, dim_i, dim_h, generator=g) * 0.1).to(torch.bfloat16)
    w_up = (torch.randn(E, dim_i, dim_h, generator=g) * 0.1).to(torch.bfloat16)
    w_down = (torch.randn(E, dim_h, dim_i, generator=g) * 0.1).to(torch.bfloat16)
    return [t.to(DEVICE) for t in (x, dout, weights)], tuple(w.contiguous().to(DEVICE) for w in (w_gate, w_up, w_down))


def triton_dgrad(x, dout, weights, ids, expert_weights, swiglu_limit=None, precision="bf16") -> dict:
    """The "triton" path's dgrad at EP = 1 on all the tokens, as its grouped FFN's backward runs it in
    ``precision`` (the forward's g, u; the weights' dgrad operands): its grouped rows (by the schedule) and dx."""
    forward = [weight_operand(w, precision, 2, n) for w, n in zip(expert_weights, NAMES)]
    w_gate, w_up, w_down = (weight_operand(w, precision, 1, n) for w, n in zip(expert_weights, NAMES))
    num_tokens, dim_h = x.shape
    group_end, row_slot = mok_schedule(ids.reshape(1, -1).to(torch.int32).contiguous(), 0, E, E)
    gate, up, _ = grouped_gate_up_swiglu(x.index_select(0, row_slot // K), group_end, *forward[:2], swiglu_limit)
    dy_TKH = torch.empty(num_tokens, K, dim_h, dtype=torch.bfloat16, device=x.device)
    slot_scale(weights, dout, dy_TKH)
    dy = dy_TKH.view(-1, dim_h).index_select(0, row_slot)
    dgate, dup = grouped_down_dgrad_swiglu(dy, group_end, w_down, gate, up, swiglu_limit)
    dx_rows = grouped_mm_sum(dgate, dup, group_end, w_gate, w_up)
    rows_of_slots = torch.empty_like(row_slot).scatter_(0, row_slot.long(), torch.arange(
        row_slot.numel(), dtype=row_slot.dtype, device=row_slot.device))
    dx = slot_reduce(dx_rows.index_select(0, rows_of_slots).view(num_tokens, K, dim_h), None, None, torch.bfloat16)
    return dict(gate=gate, up=up, dy=dy, dgate=dgate, dup=dup, dx=dx, rows_of_slots=rows_of_slots)


def rank_rows(want: dict, ranks: int, ids: torch.Tensor):
    """Per rank: its schedule's real rows as EP = 1 rows (index [R_p]) and its g, u inputs [P·N, I] (zero past
    R_p)."""
    _, dim_i = want["gate"].shape
    # the rows' order only: any tile height gives the same schedule (its tile ends go unused here)
    group_end_PL, _, row_slot_PR = tile_schedules(list(ids.to(DEVICE).chunk(ranks)), E // ranks, E, block_m=64)
    index, gates, ups = [], [], []
    for p in range(ranks):
        real = int(group_end_PL[p, -1])
        ep1 = want["rows_of_slots"].index_select(0, row_slot_PR[p, :real])
        index.append(ep1)
        for out, name in ((gates, "gate"), (ups, "up")):
            rows = torch.zeros(row_slot_PR.shape[1], dim_i, dtype=torch.bfloat16, device=DEVICE)
            rows[:real] = want[name].index_select(0, ep1)
            out.append(rows)
    return index, gates, ups


def megakernel_dgrad(ranks, x, dout, weights, ids, expert_weights, config=SMALL, swiglu_limit=None,
                     precision="bf16", **kw):
    """(want, got): the triton path's and the megakernel's at virtual EP = ranks (rank p: the p-th T tokens)."""
    want = triton_dgrad(x, dout, weights, ids.to(DEVICE), expert_weights, swiglu_limit, precision)
    index, gates, ups = rank_rows(want, ranks, ids)
    got = megakernel_routed_dgrad(list(dout.chunk(ranks)), list(weights.chunk(ranks)),
                                  list(ids.to(DEVICE).chunk(ranks)), gates, ups, expert_weights, num_experts=E,
                                  config=config, trap=False, swiglu_limit=swiglu_limit, precision=precision, **kw)
    raise_on_megakernel_bwd_error()
    return want, got, index


def assert_bitwise(want, got, index):
    assert torch.equal(torch.cat([g.dx_TH for g in got]), want["dx"])
    for p, (g, rows) in enumerate(zip(got, index)):
        real = rows.numel()
        assert int(g.group_end_L[-1]) == real
        for name, mine in (("dy", g.dy_RH), ("dgate", g.dgate_RI), ("dup", g.dup_RI)):
            assert torch.equal(mine[:real], want[name].index_select(0, rows)), (p, name)


@pytest.mark.parametrize("kind", ["balanced", "skewed", "one_expert", "empty_experts", "all_remote"])
@pytest.mark.parametrize("ranks", [1, 2, 4])
@interpreted
def test_dgrad_equals_triton_path_bitwise(kind, ranks):
    (x, dout, weights), expert_weights = backward_inputs(ranks, 64)
    ids = routing(kind, ranks, seed=ranks)
    assert_bitwise(*megakernel_dgrad(ranks, x, dout, weights, ids, expert_weights))


@interpreted
def test_dgrad_eight_ranks_one_expert_each():
    (x, dout, weights), expert_weights = backward_inputs(8, 64, tokens=8)
    ids = routing("skewed", 8, tokens=8, seed=8)
    assert_bitwise(*megakernel_dgrad(8, x, dout, weights, ids, expert_weights))


@interpreted
def test_partial_blocks_clamp_and_smallest_ring():
    """H = 96 and I = 80 in 64-column items (each GEMM's last column block and K step partial), the SwiGLU clamp
    (gradients only where it did not clip), one ring tile per rank with every row to two experts of rank 0."""
    (x, dout, weights), expert_weights = backward_inputs(2, 96, seed=15, dim_i=80)
    config = MegakernelConfig(comm_programs=2, compute_programs=2, group_tiles=1, lag=0, ring_tiles=1, block_m=16,
                              block_n=64)
    for kind in ("skewed", "one_expert"):
        ids = routing(kind, 2, seed=16)
        assert_bitwise(*megakernel_dgrad(2, x, dout, weights, ids, expert_weights, config, swiglu_limit=0.5))


@pytest.mark.parametrize("ranks, kind, block_m", [(1, "skewed", 16), (2, "empty_experts", 32), (4, "one_expert", 16)])
@interpreted
def test_tma_loads_give_the_same_bits(ranks, kind, block_m, monkeypatch):
    """gemm = "tma" (bf16): the items' GEMMs read through tensor descriptors instead of masked pointer loads, the same
    bits. 128-column items on H = I = 64: each GEMM's one column block half past its row (zeros); D2's A rows past a
    tile's expert's end come from the next expert's rows or past R (stores skip them). Every float buffer torch.empty
    makes during the call starts as NaN, so a read of rows nobody wrote that reached a stored value would show."""
    (x, dout, weights), expert_weights = backward_inputs(ranks, 64, seed=50 + ranks)
    ids = routing(kind, ranks, seed=ranks)
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    config = dataclasses.replace(SMALL, block_m=block_m, block_n=128, gemm="tma")
    assert_bitwise(*megakernel_dgrad(ranks, x, dout, weights, ids, expert_weights, config))


@pytest.mark.parametrize("ranks, kind, gemm", [(1, "skewed", "ptr"), (2, "one_expert", "ptr"),
                                               (2, "empty_experts", "ptr"), (4, "all_remote", "ptr"),
                                               (1, "skewed", "tma"), (2, "empty_experts", "tma")])
@interpreted
def test_mxfp8_dgrad_equals_triton_path_bitwise(ranks, kind, gemm):
    """precision = "mxfp8": the Triton grouped FFN's MXFP8 dgrad (dy's MXFP8 values along H in the ring, dgate's
    and dup's along I in the slots' tiles, the weights' dgrad operands dequantized per 32-wide K step), its bits:
    dgate, dup, dy (as pulled) and each row's dx, and dX after the finish; by pointer and by TMA loads."""
    (x, dout, weights), expert_weights = backward_inputs(ranks, 64, seed=30 + ranks)
    ids = routing(kind, ranks, seed=ranks)
    config = dataclasses.replace(SMALL, gemm=gemm)
    assert_bitwise(*megakernel_dgrad(ranks, x, dout, weights, ids, expert_weights, config, precision="mxfp8"))


@pytest.mark.parametrize("gemm", ["ptr", "tma"])
@interpreted
def test_mxfp8_partial_blocks_clamp_and_smallest_ring(gemm):
    """mxfp8 with H = 96 and I = 96 in 64-column items (each GEMM's last column block half past the row: its last
    32-block of dgate, dup never stored; TMA: that half of a weight block the next expert's rows), the SwiGLU clamp,
    one ring tile per rank (every tile waits for the previous one's slot and its dgate, dup tiles) with every row to
    two experts of rank 0."""
    (x, dout, weights), expert_weights = backward_inputs(2, 96, seed=35, dim_i=96)
    config = MegakernelConfig(comm_programs=2, compute_programs=2, group_tiles=1, lag=0, ring_tiles=1, block_m=16,
                              block_n=64, gemm=gemm)
    for kind in ("skewed", "one_expert"):
        ids = routing(kind, 2, seed=36)
        assert_bitwise(*megakernel_dgrad(2, x, dout, weights, ids, expert_weights, config, swiglu_limit=0.5,
                                         precision="mxfp8"))


@interpreted
def test_mxfp8_dgrad_reads_the_kept_dgrad_operands_or_the_gathered_ones():
    """With an owner and sources, the launch reads the weights' MXFP8 dgrad operands kept for the Triton FFN's
    backward (made once per weight version, along dim 1) and quantizes none again; given FSDP's MXFP8-gathered
    weights, their dgrad operands as gathered: the same bits."""
    (x, dout, weights), expert_weights = backward_inputs(1, 64, seed=37)
    ids = routing("skewed", 1, seed=38)
    owner = torch.nn.Module()
    want, first, index = megakernel_dgrad(1, x, dout, weights, ids, expert_weights, precision="mxfp8",
                                          weights_owner=owner, weight_sources=expert_weights)
    assert_bitwise(want, first, index)
    kept = dict(weight_cache._kept[owner])
    assert sorted(kept) == [(n, 1) for n in ("w_down_EHI", "w_gate_EIH", "w_up_EIH")]
    operands = dgrad_launch_weights(expert_weights, "mxfp8", owner, expert_weights)
    assert [o is kept[(n, 1)].operand for o, n in zip(operands, NAMES)] == [True] * 3
    gathered = tuple(MXFP8GatheredWeight(GatheredOperands({1: kept[(n, 1)].operand}), w.shape, w.dtype, w.device)
                     for w, n in zip(expert_weights, NAMES))
    _, gates, ups = rank_rows(want, 1, ids)
    again = megakernel_routed_dgrad(dout, weights, ids.to(DEVICE), gates[0], ups[0], gathered, num_experts=E,
                                    config=SMALL, trap=False, precision="mxfp8")
    raise_on_megakernel_bwd_error()
    assert_bitwise(want, [again], index)
    assert all(weight_cache._kept[owner][key].operand is entry.operand for key, entry in kept.items())


@pytest.mark.parametrize("order", ORDERS)
@interpreted
def test_item_orders_and_rings_give_the_same_bits(order):
    """The forward tests' item orders and rings (groups across ring windows, the largest lag a ring allows, a lag
    past the last tile, a ring of one tile) under skewed routing."""
    (x, dout, weights), expert_weights = backward_inputs(2, 64, seed=17)
    ids = routing("skewed", 2, seed=18)
    config = MegakernelConfig(**{**dict(comm_programs=1, compute_programs=2, block_m=16, block_n=32), **ORDERS[order]})
    assert_bitwise(*megakernel_dgrad(2, x, dout, weights, ids, expert_weights, config))


@interpreted
def test_run_to_run_and_ep_degree_invariance():
    """The same call twice on one workspace (a later epoch: flags never reset) gives the same bits, and the one-rank
    form (tensors, not lists) on all tokens gives the dx of virtual EP = 4."""
    (x, dout, weights), expert_weights = backward_inputs(4, 64, seed=9)
    ids = routing("skewed", 4, seed=10)
    want, first, index = megakernel_dgrad(4, x, dout, weights, ids, expert_weights)
    _, again, _ = megakernel_dgrad(4, x, dout, weights, ids, expert_weights)
    for a, b in zip(first, again):
        real = int(a.group_end_L[-1])
        assert torch.equal(a.dx_TH, b.dx_TH) and torch.equal(a.dgate_RI[:real], b.dgate_RI[:real])
    _, gates, ups = rank_rows(want, 1, ids)
    single = megakernel_routed_dgrad(dout, weights, ids.to(DEVICE), gates[0], ups[0], expert_weights, num_experts=E,
                                     config=SMALL, trap=False)
    raise_on_megakernel_bwd_error()
    assert torch.equal(single.dx_TH, torch.cat([a.dx_TH for a in first]))


@interpreted
def test_stalled_rank_is_a_named_error_then_the_workspace_recovers():
    (x, dout, weights), expert_weights = backward_inputs(2, 64, seed=13)
    ids = routing("balanced", 2)
    with pytest.raises(RuntimeError, match="dy_ready: rank 0's communication program waited for rank 1 "):
        megakernel_dgrad(2, x, dout, weights, ids, expert_weights, stall_rank=1)
    assert_bitwise(*megakernel_dgrad(2, x, dout, weights, ids, expert_weights))


@pytest.mark.parametrize("skipped, wait", [
    ("communication", "ring ready: rank 0's compute program waited for ring tile 0 to be pulled"),
    ("D1", "dgrad ready: rank 0's compute program waited for the D1 items of ring tile 0"),
])
@interpreted
def test_a_missing_phase_is_a_named_error(skipped, wait):
    """The serialized phases run by hand, one left out: the wait that needed it ends in the named error; a tile's
    dgrad_ready only once every D1 item of it ran."""
    (x, dout, weights), expert_weights = backward_inputs(1, 64, seed=21)
    ids = routing("balanced", 1)
    want, got, index = megakernel_dgrad(1, x, dout, weights, ids, expert_weights)  # allocates the workspace
    assert_bitwise(want, got, index)
    ws = next(w for key, w in mkb._WORKSPACES.items() if key[1:3] == (1, T) and key[-2:] == (SMALL, "bf16"))
    schedule = tile_schedules([ids.to(DEVICE)], E, E, SMALL.block_m)
    _, gates, ups = rank_rows(want, 1, ids)
    rows = GroupedRows(torch.stack(gates), torch.stack(ups), torch.empty_like(torch.stack(gates)),
                       torch.empty_like(torch.stack(gates)), torch.empty(1, T * K, 64, dtype=torch.bfloat16))
    epoch = ws.next_epoch()
    run = functools.partial(megakernel_bwd_phase, ws.bufs, schedule, expert_weights, rows, ws.shape, epoch=epoch,
                            swiglu_limit=None, tiles=(0, SMALL.ring_tiles))
    run(PHASE_PUBLISH)
    if skipped == "communication":
        run(PHASE_D1)
    else:
        run(PHASE_COMM)
        run(PHASE_D1, items=(0, 1))  # SMALL: D1(0, 0), the first of tile 0's 2 column blocks
        assert ws.bufs.d1_done_VQ[0, 0] == 1 and ws.bufs.dgrad_ready_VQ[0, 0] != epoch << 32
        if skipped != "D1":
            run(PHASE_D1, items=(1, 2**31 - 1))
            assert ws.bufs.dgrad_ready_VQ[0, 0] == epoch << 32 and not ws.bufs.d1_done_VQ.any()
        assert read_error(ws.bufs.errors) is None
    run(PHASE_D2)
    with pytest.raises(RuntimeError, match=re.escape(f"mok megakernel backward: timed out: {wait} ")):
        raise_on_megakernel_bwd_error()
    assert_bitwise(*megakernel_dgrad(1, x, dout, weights, ids, expert_weights))


@interpreted
def test_bad_inputs_are_named():
    (x, dout, weights), expert_weights = backward_inputs(2, 64)
    ids = routing("balanced", 2).to(DEVICE)
    gate = torch.zeros(2 * T * K, I, dtype=torch.bfloat16, device=DEVICE)
    call = lambda **kw: megakernel_routed_dgrad(  # noqa: E731
        **{**dict(dout_TH=list(dout.chunk(2)), weights_TK=list(weights.chunk(2)), topk_idx_TK=list(ids.chunk(2)),
                  gate_RI=[gate, gate], up_RI=[gate, gate], expert_weights=expert_weights, num_experts=E,
                  config=SMALL), **kw})
    with pytest.raises(ValueError, match=r"gate_RI of rank 1 must be \(64, 64\) of torch.bfloat16"):
        call(gate_RI=[gate, gate[:T]])
    with pytest.raises(ValueError, match="num_experts = 6 must be a multiple"):
        call(num_experts=6)
    with pytest.raises(TypeError, match="up_RI must be a list"):
        call(up_RI=gate)
    with pytest.raises(ValueError, match="w_down_EHI must be a contiguous bfloat16"):
        call(expert_weights=(*expert_weights[:2], expert_weights[2].float()))
    with pytest.raises(ValueError, match="stall_rank = 2"):
        call(stall_rank=2)
    with pytest.raises(ValueError, match=r"MegakernelConfig.gemm = 'wgmma' must be one of \('ptr', 'tma'\)"):
        call(config=dataclasses.replace(SMALL, gemm="wgmma"))
    w_down = expert_weights[2]  # the same values 4 elements into a buffer: 8 bytes past an aligned start
    moved = torch.empty(w_down.numel() + 4, dtype=w_down.dtype, device=DEVICE)[4:].view(w_down.shape).copy_(w_down)
    with pytest.raises(ValueError, match="gemm = 'tma' reads w_down by TMA, which needs a 16-byte aligned start: its "
                                         "data starts 8 bytes past one"):
        call(expert_weights=(*expert_weights[:2], moved), config=dataclasses.replace(SMALL, gemm="tma"))
    with pytest.raises(ValueError, match="spin forever"):
        call(serialized=False)
    with pytest.raises(ValueError, match=r"precision = 'fp8' must be one of \('bf16', 'mxfp8'\)"):
        call(precision="fp8")
    (_, dout80, _), weights80 = backward_inputs(2, 80)
    with pytest.raises(ValueError, match=r"MegakernelConfig.gemm = 'tma' reads the dgrad launch's operands by TMA in "
                                         r"64-wide K steps, none past an expert's rows: H \(80\) and I \(64\) must "
                                         r"be multiples of 64 \(bf16\), else use MegakernelConfig.gemm = 'ptr'"):
        call(dout_TH=list(dout80.chunk(2)), expert_weights=weights80, config=dataclasses.replace(SMALL, gemm="tma"))
    with pytest.raises(ValueError, match=r"precision 'mxfp8' needs H \(80\) and I \(64\) to be multiples of 32"):
        call(dout_TH=list(dout80.chunk(2)), expert_weights=weights80, precision="mxfp8")
    with pytest.raises(ValueError, match=r"block_n = 16: precision 'mxfp8'"):
        call(config=dataclasses.replace(SMALL, block_n=16), precision="mxfp8")


@interpreted
@pytest.mark.parametrize("precision, dim_h, rows_per_expert, block_m, gemm", [
    ("bf16", 64, 4, 64, "tma"), ("bf16", 64, 128, 128, "tma"), ("bf16", 80, 128, 128, "ptr"),
    ("mxfp8", 64, 128, 64, "ptr")])
def test_config_defaults_are_the_fastest_measured(precision, dim_h, rows_per_expert, block_m, gemm):
    """None sizes (docs/performance.md, the backward megakernel): bf16 as the forward's (TMA loads where the K-step
    rule allows them, 128-row tiles from 128 rows per expert), MXFP8 pointer loads on 64-row tiles."""
    tokens = rows_per_expert * E // K
    (_, dout, weights), expert_weights = backward_inputs(1, dim_h, tokens=tokens)
    gate = torch.zeros(tokens * K, I, dtype=torch.bfloat16, device=DEVICE)
    checked = mkb.check_dgrad_call("test", [dout], [weights], [gate], [gate], expert_weights, num_experts=E,
                                   ep_degree=1, swiglu_limit=None, config=MegakernelConfig(), serialized=None,
                                   stall_rank=None, precision=precision)
    assert (checked.config.block_m, checked.config.gemm) == (block_m, gemm)


@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(__import__("triton").__file__), "backends",
                                                    "nvidia", "bin", "cuobjdump")),
                    reason="Triton's wheel has no ptxas/cuobjdump here")
def test_compiles_for_sm90_with_wgmma_and_no_spills():
    """The concurrent launch's kernel at Kimi K2.7's sizes and the default config, bf16 and MXFP8, at 64- and 128-row
    tiles, by pointer and by TMA loads, compiled for sm_90 on the CPU (benchmarks/tools/sass.py's stand-in driver;
    the interpreter cannot compile, hence a subprocess): wgmmas, TMA loads exactly in the TMA variants, one program per
    SM at least (the occupancy the launch checks), and at 64-row tiles at most the 80 bytes of spill stack
    (loop-invariant values, reloaded per item) ptxas gives the bf16 kernel today at 255 registers (two loops for D2,
    or int64 offsets in D1's epilogue, gave 400+; MXFP8: 0). No spill inside a K loop, but for MXFP8 by TMA at
    128-row tiles: ptxas reloads a loop-invariant value from the stack twice per step of D1's K loop (no spill store;
    D2's TMA descriptors, held across the item loop, take the registers: made per D2 item instead, they left D1's
    loop spill-free, at more stack elsewhere and four descriptor writes per item)."""
    # k_loop_stores: the K loops' spill stores alone (their loads masked out of the SASS)
    script = (
        "import json; from benchmarks.tools import sass; from titan_mok.kernels import mok_megakernel_bwd as m\n"
        "from titan_mok.kernels.mok_megakernel import KernelVariant\n"
        "from titan_mok.moe.megakernel import MegakernelConfig as C\n"
        "for gemm in ('ptr', 'tma'):\n"
        "    for mx in (False, True):\n"
        "        for block_m in (64, 128):\n"
        "            with sass.compiling_for_sm90():\n"
        "                k = m.compile_megakernel_bwd(KernelVariant(7168, 2048, 0, 48, block_m, C.block_n, C.num_warps,"
        " C.num_stages, False, gemm=gemm, mx=mx))\n"
        "            r = sass.kernel_report('_megakernel_bwd', k)\n"
        "            print(json.dumps(dict(gemm=gemm, mx=mx, block_m=block_m, hgmma=r['opcodes'].get('HGMMA', 0),"
        " tma_loads=r['opcodes'].get('UTMALDG', 0), stack=r['stack_bytes'],"
        " k_loop_spills=sass.k_loop_spills(r['sass']),"
        " k_loop_stores=sass.k_loop_spills(r['sass'].replace('LDL', 'NOP')), per_sm=sass.programs_per_sm(r))))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    reports = [json.loads(line) for line in out.stdout.strip().splitlines()[-8:]]  # each variant
    assert [(r["gemm"], r["mx"], r["block_m"]) for r in reports] == [
        (gemm, mx, block_m) for gemm in ("ptr", "tma") for mx in (False, True) for block_m in (64, 128)]
    for report in reports:
        assert report["hgmma"] > 0 and report["per_sm"] >= 1, report
        assert (report["tma_loads"] > 0) == (report["gemm"] == "tma"), report
        assert report["block_m"] == 128 or report["stack"] <= 80, report
        reloads = 2 if (report["gemm"], report["mx"], report["block_m"]) == ("tma", True, 128) else 0
        assert report["k_loop_stores"] == 0 and report["k_loop_spills"] <= reloads, report
