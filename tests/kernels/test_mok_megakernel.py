"""The MoK forward megakernel (kernels/mok_megakernel.py via titan_mok.moe.megakernel) on CPU, in Triton's
interpreter, serialized (publish, then per ring round: pull, gate/up items, down items; waits are assertions), at
virtual EP. Also the item order the kernel decodes, and the per-tile counters phase by phase.

The bits it must give: today's triton path on the same rows, i.e. the reference backend's dispatch, the Triton
grouped FFN (``grouped_swiglu_ffn(use_triton=True)``, in the interpreter too) and the reference combine (the
fused path's slot reduction equals it bit for bit: test_mok_fused.py), computed at EP = 1 on all P ranks'
tokens at once. So each test also holds a token's output independent of P and of the batch. Compared with
torch.equal. GPU (the concurrent launch): test_mok_megakernel_gpu.py.
"""

import dataclasses
import functools
import os
import re
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from tests.torchrun import REPO
from titan_mok.kernels.grouped_ffn import grouped_swiglu_ffn
from titan_mok.kernels.grouped_gemm import grouped_gate_up_swiglu
from titan_mok.kernels.mok_megakernel import (
    MAX_EPOCH,
    PHASE_COMM,
    PHASE_DOWN,
    PHASE_GATE_UP,
    PHASE_PUBLISH,
    TRACE_FIELDS,
    KeptRows,
    SharedFFN,
    _item,
    megakernel_launch,
    megakernel_phase,
    programs_per_sm,
    read_error,
)
from titan_mok.moe import megakernel as mk
from titan_mok.moe.dispatch import build_dispatch_handle, combine, dispatch
from titan_mok.moe.megakernel import MegakernelConfig, megakernel_routed_experts, raise_on_megakernel_error
from titan_mok.moe.megakernel_rank import megakernel_rank_routed_experts, raise_on_megakernel_rank_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small tiles (16 rows: MMAs unlike the GPU configs') and the serialized launches: the interpreter's tests
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the interpreter's serialized mode; on a GPU see test_mok_megakernel_gpu.py")
T, K, E, I = 16, 2, 8, 64
SMALL = MegakernelConfig(comm_programs=1, compute_programs=2, group_tiles=2, lag=1, ring_tiles=4, block_m=16,
                         block_n=32, gemm="ptr")


def routing(kind: str, ranks: int, tokens: int = T, experts: int = E, seed: int = 0) -> torch.Tensor:
    """int64 [P·T, K] top-k ids, distinct per token, rank p's tokens at rows p·T .. p·T + T - 1."""
    g = torch.Generator().manual_seed(seed)
    rows = ranks * tokens
    if kind == "balanced":  # every expert gets P·T·K / E rows
        ids = (torch.arange(rows)[:, None] * K + torch.arange(K)) % experts
    elif kind == "skewed":  # expert e drawn with weight 2^-e
        ids = torch.multinomial(0.5 ** torch.arange(experts, dtype=torch.float).expand(rows, -1), K, generator=g)
    elif kind == "one_expert":  # every token's first slot to expert 0, second to expert 1
        ids = torch.arange(K).repeat(rows, 1)
    elif kind == "empty_experts":  # only the even experts have rows
        ids = 2 * torch.rand(rows, experts // 2, generator=g).argsort(dim=1)[:, :K]
    elif kind == "all_remote":  # rank p's tokens all go to rank p + 1's experts (and p + 2's... when it has < K)
        local = experts // ranks
        span = local if local >= K else experts - local  # never rank p's own experts (P = 1: all are its own)
        first = ((torch.arange(rows) // tokens + 1) % ranks)[:, None] * local
        ids = (first + torch.rand(rows, span, generator=g).argsort(dim=1)[:, :K]) % experts
    else:
        raise ValueError(kind)
    return ids


def layer_inputs(ranks: int, dim_h: int, seed: int = 1, tokens: int = T, dim_i: int = I):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ranks * tokens, dim_h, generator=g).to(torch.bfloat16)
    weights = torch.rand(ranks * tokens, K, generator=g)
    shared = torch.randn(ranks * tokens, dim_h, generator=g).to(torch.bfloat16)
    w_gate = (torch.randn(E, dim_i, dim_h, generator=g) * 0.1).to(torch.bfloat16)
    w_up = (torch.randn(E, dim_i, dim_h, generator=g) * 0.1).to(torch.bfloat16)
    w_down = (torch.randn(E, dim_h, dim_i, generator=g) * 0.1).to(torch.bfloat16)
    return [t.to(DEVICE) for t in (x, weights, shared)], tuple(w.to(DEVICE) for w in (w_gate, w_up, w_down))


def triton_path(x, weights, ids, shared, expert_weights, swiglu_limit=None) -> torch.Tensor:
    """Today's triton path at EP = 1 on all the tokens: reference dispatch → Triton grouped FFN → combine."""
    with torch.no_grad():
        handle = build_dispatch_handle(ids, E, None, None)
        y_RH = grouped_swiglu_ffn(dispatch(x, handle), handle.group_end, *expert_weights, swiglu_limit=swiglu_limit,
                                  use_triton=True)
        return combine(y_RH, weights, shared, handle, torch.bfloat16)


def megakernel(ranks, x, weights, ids, shared, expert_weights, config=SMALL, **kw) -> torch.Tensor:
    """The megakernel at virtual EP = ranks on the same tokens (rank p: the p-th T tokens), outputs concatenated."""
    split = lambda t: list(t.chunk(ranks)) if t is not None else [None] * ranks  # noqa: E731
    with torch.no_grad():
        outs = megakernel_routed_experts(split(x), split(weights), split(ids.to(DEVICE)), split(shared),
                                         expert_weights, num_experts=E, config=config, trap=False, **kw)
    raise_on_megakernel_error()
    return torch.cat(outs)


@pytest.mark.parametrize("kind", ["balanced", "skewed", "one_expert", "empty_experts", "all_remote"])
@pytest.mark.parametrize("ranks", [1, 2, 4])
@interpreted
def test_megakernel_equals_triton_path_bitwise(kind, ranks):
    (x, weights, shared), expert_weights = layer_inputs(ranks, 64)
    ids = routing(kind, ranks, seed=ranks)
    want = triton_path(x, weights, ids.to(DEVICE), shared, expert_weights)
    assert torch.equal(megakernel(ranks, x, weights, ids, shared, expert_weights), want), (kind, ranks)


@interpreted
def test_megakernel_eight_ranks_one_expert_each():
    (x, weights, shared), expert_weights = layer_inputs(8, 64, tokens=8)
    ids = routing("skewed", 8, tokens=8, seed=8)
    want = triton_path(x, weights, ids.to(DEVICE), shared, expert_weights)
    assert torch.equal(megakernel(8, x, weights, ids, shared, expert_weights), want)


@interpreted
def test_smallest_ring_most_skewed_routing_is_dropless_and_bitwise():
    """One ring tile per rank, every row to two experts of rank 0 (each of 32 rows: 2 tiles per expert), two
    programs of each kind: every tile waits for the previous one's slot; nothing dropped, same bits."""
    (x, weights, shared), expert_weights = layer_inputs(2, 64)
    ids = routing("one_expert", 2)
    config = MegakernelConfig(comm_programs=2, compute_programs=2, group_tiles=1, lag=0, ring_tiles=1, block_m=16,
                              block_n=32)
    want = triton_path(x, weights, ids.to(DEVICE), shared, expert_weights)
    assert torch.equal(megakernel(2, x, weights, ids, shared, expert_weights, config), want)


@interpreted
def test_wide_rows_clamp_and_no_shared_expert():
    """H = 96 (a K step past the row's end), the SwiGLU clamp, no shared expert, the default ring (2 x compute)."""
    (x, weights, _), expert_weights = layer_inputs(2, 96, seed=5)
    ids = routing("skewed", 2, seed=6)
    config = MegakernelConfig(comm_programs=1, compute_programs=3, block_m=16, block_n=64)
    want = triton_path(x, weights, ids.to(DEVICE), None, expert_weights, swiglu_limit=0.5)
    got = megakernel(2, x, weights, ids, None, expert_weights, config, swiglu_limit=0.5)
    assert torch.equal(got, want)


@interpreted
def test_column_blocks_not_dividing_hidden_or_ffn_size():
    """H = 96 and I = 80 in 64-column items: each GEMM's last column block is partial (and H's last K step)."""
    (x, weights, shared), expert_weights = layer_inputs(2, 96, seed=15, dim_i=80)
    ids = routing("skewed", 2, seed=16)
    config = MegakernelConfig(comm_programs=1, compute_programs=2, group_tiles=3, lag=1, block_m=16, block_n=64)
    want = triton_path(x, weights, ids.to(DEVICE), shared, expert_weights)
    assert torch.equal(megakernel(2, x, weights, ids, shared, expert_weights, config), want)


@pytest.mark.parametrize("kind", ["skewed", "one_expert", "all_remote"])
@pytest.mark.parametrize("ranks", [1, 2, 4])
@interpreted
def test_tma_loads_give_the_same_bits(kind, ranks):
    """gemm = "tma": the items' GEMMs read through tensor descriptors (zeros past their shapes, other experts' weight
    rows in a block's masked columns) instead of masked pointer loads; H = 96 and I = 80 in 64-column items: partial
    column blocks and a partial K step in both GEMMs."""
    (x, weights, shared), expert_weights = layer_inputs(ranks, 96, seed=40 + ranks, dim_i=80)
    ids = routing(kind, ranks, seed=ranks)
    config = dataclasses.replace(SMALL, block_n=64, gemm="tma")
    want = triton_path(x, weights, ids.to(DEVICE), shared, expert_weights)
    assert torch.equal(megakernel(ranks, x, weights, ids, shared, expert_weights, config), want), (kind, ranks)


@pytest.mark.parametrize("gemm", ["ptr", "tma"])
@interpreted
def test_shared_expert_and_clamp_with_tma_loads(gemm):
    """The shared expert in the launch (20 tokens: its last 16-row tile partial, rows past T from its descriptor's
    end), both SwiGLU clamps, by both loads."""
    (x, weights, _), expert_weights = layer_inputs(2, 64, seed=42, tokens=20)
    ids = routing("skewed", 2, tokens=20, seed=43)
    shared_weights = shared_inputs(64, 80, seed=44)
    want = triton_path(x, weights, ids.to(DEVICE), shared_expert_rows(x, shared_weights, 0.4), expert_weights,
                       swiglu_limit=0.5)
    got = megakernel(2, x, weights, ids, None, expert_weights, dataclasses.replace(SMALL, gemm=gemm),
                     swiglu_limit=0.5, shared_expert=SharedFFN(*shared_weights, swiglu_limit=0.4))
    assert torch.equal(got, want), gemm


@pytest.mark.parametrize("gemm", ["ptr", "tma"])
@pytest.mark.parametrize("kind", ["one_expert", "skewed"])
@interpreted
def test_128_row_tiles_give_the_same_bits(kind, gemm):
    """block_m = 128 (the GPU's tile): 80 tokens per rank, 2 ranks; one_expert: 160 rows for each of experts 0 and
    1, a full and a partial tile each; with the shared expert in the launch (one partial 128-row tile per rank)."""
    (x, weights, _), expert_weights = layer_inputs(2, 64, seed=45, tokens=80)
    ids = routing(kind, 2, tokens=80, seed=46)
    shared_weights = shared_inputs(64, 64, seed=47)
    config = MegakernelConfig(comm_programs=1, compute_programs=2, group_tiles=1, lag=1, ring_tiles=2, block_m=128,
                              block_n=32, gemm=gemm)
    want = triton_path(x, weights, ids.to(DEVICE), shared_expert_rows(x, shared_weights), expert_weights)
    got = megakernel(2, x, weights, ids, None, expert_weights, config, shared_expert=SharedFFN(*shared_weights))
    assert torch.equal(got, want), (kind, gemm)


# Item orders and rings (per rank: T·K = 32 rows in 16-row tiles over 4 local experts, about 4 to 6 tiles)
ORDERS = {
    "lag 0, groups of 1, a ring of 1": dict(group_tiles=1, lag=0, ring_tiles=1),
    "groups across the ring's windows": dict(group_tiles=3, lag=0, ring_tiles=4, comm_programs=2, compute_programs=3),
    "the largest lag the ring allows": dict(group_tiles=1, lag=2, ring_tiles=3),
    "lag past the last tile: every A item first": dict(group_tiles=2, lag=6, ring_tiles=14),
}


@pytest.mark.parametrize("kind", ["skewed", "empty_experts"])
@pytest.mark.parametrize("order", ORDERS)
@interpreted
def test_item_orders_and_rings_give_the_same_bits(order, kind):
    (x, weights, shared), expert_weights = layer_inputs(2, 64, seed=17)
    ids = routing(kind, 2, seed=18)
    config = MegakernelConfig(**{**dict(comm_programs=1, compute_programs=2, block_m=16, block_n=32), **ORDERS[order]})
    want = triton_path(x, weights, ids.to(DEVICE), shared, expert_weights)
    assert torch.equal(megakernel(2, x, weights, ids, shared, expert_weights, config), want), order


@triton.jit
def _item_order_kernel(out_ptr, items, G, LAG, NB_I, NB_H, NB_IS, SG, BLOCK: tl.constexpr):
    j = tl.arange(0, BLOCK)
    is_a, tile, block = _item(j, G, LAG, NB_I, NB_H, NB_IS, SG)
    ok = j < items
    tl.store(out_ptr + 3 * j, is_a.to(tl.int32), mask=ok)
    tl.store(out_ptr + 3 * j + 1, tile, mask=ok)
    tl.store(out_ptr + 3 * j + 2, block, mask=ok)


@pytest.mark.parametrize("shared_groups", [0, 2])
@pytest.mark.parametrize("group, lag, ring", [(1, 0, 1), (3, 1, 6), (3, 1, 7), (2, 4, 10), (3, 1, 5), (2, 1, 3)])
@interpreted
def test_item_order_puts_every_wait_on_earlier_work(group, lag, ring, shared_groups):
    """The kernel's own item decoding (``_item``) for 7 routed tiles, 3 + 2 column blocks, after shared_groups
    groups of shared-expert tiles (4 + 2 column blocks): every item once; A items column block major within their
    group; every B item after its tile's A items; a group's first item after the B items of the tiles whose ring
    slots its tiles take (the pulls' waits), which holds exactly when (lag + 1)·G <= Q."""
    tiles, nb_i, nb_h, nb_is = 7, 3, 2, 4
    first = shared_groups * group  # the routed tiles' first in the order
    items = shared_groups * group * (nb_is + nb_h) + (triton.cdiv(tiles, group) + lag) * group * (nb_i + nb_h)
    out = torch.zeros(items, 3, dtype=torch.int32, device=DEVICE)
    _item_order_kernel[(1,)](out, items, group, lag, nb_i, nb_h, nb_is, shared_groups,
                             BLOCK=triton.next_power_of_2(items))
    is_a, tile, block = out.cpu().unbind(1)
    real = (tile >= 0) & (tile < first + tiles)
    done = sorted(zip(is_a[real].tolist(), tile[real].tolist(), block[real].tolist()))
    a_blocks = [nb_is] * first + [nb_i] * tiles
    assert done == sorted([(1, u, b) for u in range(first + tiles) for b in range(a_blocks[u])] +
                          [(0, u, c) for u in range(first + tiles) for c in range(nb_h)])
    where = {key: j for j, key in enumerate(zip(is_a.tolist(), tile.tolist(), block.tolist())) if real[j]}
    for u in range(first + tiles):
        assert max(where[1, u, b] for b in range(a_blocks[u])) < min(where[0, u, c] for c in range(nb_h))
        if u % group:  # column block major: block b of tile u right after block b of the tile before it
            assert all(where[1, u, b] == where[1, u - 1, b] + 1 for b in range(a_blocks[u]))
    pulls_wait_on_earlier_work = all(
        max(where[0, first + i - ring, c] for c in range(nb_h))
        < min(where[1, first + i // group * group, b] for b in range(nb_i))
        for i in range(ring, tiles))
    assert pulls_wait_on_earlier_work == ((lag + 1) * group <= ring or tiles <= ring)


@interpreted
def test_a_lag_the_ring_cannot_hold_is_refused():
    (x, weights, shared), expert_weights = layer_inputs(2, 64)
    ids = routing("balanced", 2)
    config = MegakernelConfig(comm_programs=1, compute_programs=2, group_tiles=2, lag=2, ring_tiles=5, block_m=16,
                              block_n=32)
    with pytest.raises(ValueError, match=r"ring_tiles = 5 must be >= \(lag \+ 1\) x group_tiles = \(2 \+ 1\) x 2 = 6"):
        megakernel(2, x, weights, ids, shared, expert_weights, config)


@interpreted
def test_counters_rearm_and_flags_agree_after_a_call():
    """After a call every per-slot item count and the item counter are back at 0, and every ring slot used holds
    this call's stamps in ready, h_ready and consumed alike (its tile pulled, its gate/up done, its down done); with
    the shared expert in the launch (20 tokens: 2 tiles, a group of 2), its two flag slots hold stamp(e, 0)."""
    (x, weights, _), expert_weights = layer_inputs(2, 64, seed=19, tokens=20)
    ids = routing("skewed", 2, tokens=20, seed=20)
    megakernel(2, x, weights, ids, None, expert_weights, shared_expert=SharedFFN(*shared_inputs(64, 32, seed=33)))
    ws = mk._WORKSPACES[(torch.device(DEVICE), 2, 20, K, 64, I, E // 2, SMALL, 32, "bf16")]
    bufs, ring = ws.bufs, SMALL.ring_tiles
    for count in (bufs.gate_up_done_VF, bufs.down_done_VF, bufs.next_item_V, bufs.programs_done_V):
        assert not count.any(), count
    for flags in (bufs.h_ready_VF, bufs.consumed_VF):
        assert torch.equal(flags[:, :ring], bufs.ready_VQ)
        assert flags[:, ring:].tolist() == [[ws.epoch << 32] * 2] * 2
    assert (bufs.ready_VQ >> 32 == ws.epoch).any()


@interpreted
def test_trace_counts_every_pull_and_item_once():
    """A traced call (serialized: counts, no clock) at P = 2 with the shared expert in the launch: per rank, its
    communication programs pulled each routed tile once and its compute programs ran each tile's A and B items
    once; the output is the untraced call's."""
    (x, weights, _), expert_weights = layer_inputs(2, 64, seed=19, tokens=20)
    ids = routing("skewed", 2, tokens=20, seed=20)
    shared_expert = SharedFFN(*shared_inputs(64, 32, seed=33))
    want = megakernel(2, x, weights, ids, None, expert_weights, shared_expert=shared_expert)
    per_rank = SMALL.comm_programs + SMALL.compute_programs
    trace = torch.full((2 * per_rank, len(TRACE_FIELDS)), -1, dtype=torch.int64, device=DEVICE)
    got = megakernel(2, x, weights, ids, None, expert_weights, shared_expert=shared_expert, trace=trace)
    assert torch.equal(got, want)
    field = {name: trace[:, f].reshape(2, per_rank) for f, name in enumerate(TRACE_FIELDS)}
    assert field["role"].tolist() == [[0] * SMALL.comm_programs + [1] * SMALL.compute_programs] * 2
    for name in ("start_ns", "end_ns", "wait_ns", "a_ns", "b_ns"):
        assert not field[name].any(), name
    _, tile_end, _ = mk.tile_schedules(list(ids.to(DEVICE).chunk(2)), E // 2, E, SMALL.block_m)
    routed = tile_end[:, -1]  # per rank
    shared_tiles = triton.cdiv(20, SMALL.block_m)
    blocks = lambda d: triton.cdiv(d, SMALL.block_n)  # noqa: E731
    comm, compute = slice(0, SMALL.comm_programs), slice(SMALL.comm_programs, per_rank)
    assert torch.equal(field["a_items"][:, comm].sum(1), routed)
    assert not field["b_items"][:, comm].any()
    assert torch.equal(field["a_items"][:, compute].sum(1), routed * blocks(I) + shared_tiles * blocks(32))
    assert torch.equal(field["b_items"][:, compute].sum(1), (routed + shared_tiles) * blocks(64))


@interpreted
def test_a_tile_is_published_by_its_last_item_only():
    """The serialized phases by hand over parts of the item order (SMALL: groups of 2 tiles, lag 1, 2 + 2 column
    blocks; step 0: A(0, 0), A(1, 0), A(0, 1), A(1, 1); step 1: A(2..3, ·), then B(0, 0), B(1, 0), B(0, 1), B(1, 1)):
    h_ready only once every A item of the tile ran, consumed and the arrivals only once every B item did."""
    (x, weights, shared), expert_weights = layer_inputs(1, 64, seed=22)
    ids = routing("balanced", 1)  # 4 rows per expert: tile i is expert i's
    megakernel(1, x, weights, ids, shared, expert_weights)  # allocates the workspace
    ws = mk._WORKSPACES[(torch.device(DEVICE), 1, T, K, 64, I, E, SMALL, 0, "bf16")]
    bufs = ws.bufs
    schedule = mk.tile_schedules([ids.to(DEVICE)], E, E, SMALL.block_m)
    epoch = ws.next_epoch()
    run = functools.partial(megakernel_phase, bufs, schedule, expert_weights, ws.shape, epoch=epoch,
                            swiglu_limit=None, tiles=(0, SMALL.ring_tiles))
    stamp = epoch << 32  # round 0
    arrivals = ws.symmetric["arrivals_T"][0]
    arrived = arrivals.sum().item()
    run(PHASE_PUBLISH)
    run(PHASE_COMM)
    run(PHASE_GATE_UP, items=(0, 1))
    assert bufs.gate_up_done_VF[0, :2].tolist() == [1, 0] and (bufs.h_ready_VF[0, :2] != stamp).all()
    run(PHASE_GATE_UP, items=(1, 3))
    assert bufs.gate_up_done_VF[0, :2].tolist() == [0, 1] and bufs.h_ready_VF[0, :2].tolist()[0] == stamp
    assert bufs.h_ready_VF[0, 1] != stamp
    run(PHASE_GATE_UP, items=(3, 8))
    assert bufs.h_ready_VF[0, :2].tolist() == [stamp, stamp] and not bufs.gate_up_done_VF.any()
    run(PHASE_DOWN, items=(12, 15))
    assert bufs.down_done_VF[0, :2].tolist() == [0, 1] and bufs.consumed_VF[0, 0] == stamp
    assert bufs.consumed_VF[0, 1] != stamp and arrivals.sum().item() == arrived + 4  # tile 0: expert 0's 4 rows
    run(PHASE_DOWN, items=(15, 16))
    assert bufs.consumed_VF[0, :2].tolist() == [stamp, stamp] and arrivals.sum().item() == arrived + 8
    assert not bufs.down_done_VF.any() and read_error(bufs.errors) is None
    ws.reset()  # the call was left unfinished (only the first window ran): its tokens' arrivals are short


@pytest.mark.parametrize("skipped, wait", [
    ("communication", "ring ready: rank 0's compute program waited for ring tile 0 to be pulled"),
    ("gate/up", "h ready: rank 0's compute program waited for the gate/up items of ring tile 0"),
])
@interpreted
def test_a_missing_phase_is_a_named_error_then_the_workspace_recovers(skipped, wait):
    """The serialized phases run by hand, one left out: the wait that needed it ends in the named error."""
    (x, weights, shared), expert_weights = layer_inputs(1, 64, seed=21)
    ids = routing("balanced", 1)
    want = triton_path(x, weights, ids.to(DEVICE), shared, expert_weights)
    assert torch.equal(megakernel(1, x, weights, ids, shared, expert_weights), want)  # allocates the workspace
    ws = mk._WORKSPACES[(torch.device(DEVICE), 1, T, K, 64, I, E, SMALL, 0, "bf16")]
    schedule = mk.tile_schedules([ids.to(DEVICE)], E, E, SMALL.block_m)
    run = functools.partial(megakernel_phase, ws.bufs, schedule, expert_weights, ws.shape, epoch=ws.next_epoch(),
                            swiglu_limit=None)
    window = (0, SMALL.ring_tiles)
    run(PHASE_PUBLISH)
    if skipped != "communication":
        run(PHASE_COMM, tiles=window)
    if skipped != "gate/up":
        run(PHASE_GATE_UP, tiles=window)
    run(PHASE_DOWN, tiles=window)
    with pytest.raises(RuntimeError, match=re.escape(f"mok megakernel: timed out: {wait} ")):
        raise_on_megakernel_error()
    assert torch.equal(megakernel(1, x, weights, ids, shared, expert_weights), want)


@interpreted
def test_single_rank_call_and_ep_degree_invariance():
    """One rank alone (``megakernel_rank_routed_experts`` without a group: its launch hosts rank 0 of 1, its buffers
    the mok workspace's) on all tokens equals virtual EP = 4 on the same tokens."""
    (x, weights, shared), expert_weights = layer_inputs(4, 64, seed=9)
    ids = routing("skewed", 4, seed=10)
    with torch.no_grad():
        single = megakernel_rank_routed_experts(x, weights, ids.to(DEVICE), shared, expert_weights, num_experts=E,
                                                config=SMALL, trap=False)
    raise_on_megakernel_rank_error()
    assert torch.equal(single, megakernel(4, x, weights, ids, shared, expert_weights))


@interpreted
def test_run_to_run_and_epochs_wrap_without_stale_flags():
    """Calls on one workspace advance its epoch (flags never reset); the same call gives the same bits, also across
    the reset at MAX_EPOCH, and a different routing after it is not fooled by flags the earlier call left."""
    (x, weights, shared), expert_weights = layer_inputs(2, 64, seed=11)
    ids, other_ids = routing("skewed", 2, seed=12), routing("balanced", 2)
    first = megakernel(2, x, weights, ids, shared, expert_weights)
    assert torch.equal(megakernel(2, x, weights, ids, shared, expert_weights), first)
    ws = mk._WORKSPACES[(torch.device(DEVICE), 2, T, K, 64, I, E // 2, SMALL, 0, "bf16")]
    assert ws.epoch >= 2
    ws.epoch = MAX_EPOCH  # the next call zeroes every flag and starts over at epoch 1
    assert torch.equal(megakernel(2, x, weights, ids, shared, expert_weights), first)
    assert ws.epoch == 1
    want = triton_path(x, weights, other_ids.to(DEVICE), shared, expert_weights)
    assert torch.equal(megakernel(2, x, weights, other_ids, shared, expert_weights), want)


@interpreted
def test_stalled_rank_is_a_named_error_then_the_workspace_recovers():
    (x, weights, shared), expert_weights = layer_inputs(2, 64, seed=13)
    ids = routing("balanced", 2).to(DEVICE)
    split = lambda t: list(t.chunk(2))  # noqa: E731
    with torch.no_grad():
        megakernel_routed_experts(split(x), split(weights), split(ids), split(shared), expert_weights, num_experts=E,
                                  config=SMALL, trap=False, stall_rank=1)
    with pytest.raises(RuntimeError, match="x_ready: rank 0's communication program waited for rank 1 "):
        raise_on_megakernel_error()
    want = triton_path(x, weights, ids, shared, expert_weights)
    assert torch.equal(megakernel(2, x, weights, ids, shared, expert_weights), want)


@interpreted
def test_bad_inputs_are_named():
    (x, weights, shared), expert_weights = layer_inputs(2, 64)
    ids = routing("balanced", 2).to(DEVICE)
    call = lambda **kw: megakernel_routed_experts(  # noqa: E731
        **{**dict(x_TH=list(x.chunk(2)), weights_TK=list(weights.chunk(2)), topk_idx_TK=list(ids.chunk(2)),
                  shared_TH=list(shared.chunk(2)), expert_weights=expert_weights, num_experts=E, config=SMALL), **kw})
    with pytest.raises(NotImplementedError, match="forward-only"):
        call(x_TH=[t.clone().requires_grad_() for t in x.chunk(2)])
    with pytest.raises(ValueError, match="num_experts = 6 must be a multiple"):
        call(num_experts=6)
    with pytest.raises(ValueError, match="weights_TK of rank 1"):
        call(weights_TK=[weights[:T], weights[T:].double()])
    with pytest.raises(TypeError, match="must be a list"):
        call(weights_TK=weights)
    with pytest.raises(ValueError, match="w_down_EHI must be a contiguous bfloat16"):
        call(expert_weights=(*expert_weights[:2], expert_weights[2].float()))
    with pytest.raises(ValueError, match="ring_tiles = 0"):
        call(config=MegakernelConfig(comm_programs=1, compute_programs=1, ring_tiles=0, block_m=16))
    with pytest.raises(ValueError, match="stall_rank = 2"):
        call(stall_rank=2)
    with pytest.raises(ValueError, match=r"MegakernelConfig.gemm = 'wgmma' must be one of \('ptr', 'tma'\)"):
        call(config=dataclasses.replace(SMALL, gemm="wgmma"))
    (x60, _, shared60), weights60 = layer_inputs(2, 60)
    with pytest.raises(ValueError, match="16-byte rows: H = 60 must be a multiple of 8"):
        call(x_TH=list(x60.chunk(2)), shared_TH=list(shared60.chunk(2)), expert_weights=weights60,
             config=dataclasses.replace(SMALL, gemm="tma"))
    w_down = expert_weights[2]  # the same values 4 elements into a buffer: 8 bytes past an aligned start
    moved = torch.empty(w_down.numel() + 4, dtype=w_down.dtype, device=DEVICE)[4:].view(w_down.shape).copy_(w_down)
    with pytest.raises(ValueError, match="gemm = 'tma' reads w_down by TMA, which needs a 16-byte aligned start: its "
                                         "data starts 8 bytes past one"):
        call(expert_weights=(*expert_weights[:2], moved), config=dataclasses.replace(SMALL, gemm="tma"))
    if os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.raises(ValueError, match="spin forever"):
            call(serialized=False)


def shared_inputs(dim_h: int, dim_s: int, seed: int) -> SharedFFN:
    g = torch.Generator().manual_seed(seed)
    w_gate, w_up = ((torch.randn(dim_s, dim_h, generator=g) * 0.1).to(torch.bfloat16) for _ in range(2))
    w_down = (torch.randn(dim_h, dim_s, generator=g) * 0.1).to(torch.bfloat16)
    return tuple(w.to(DEVICE) for w in (w_gate, w_up, w_down))


def shared_expert_rows(x, shared_weights, swiglu_limit=None) -> torch.Tensor:
    """SharedExpert(use_triton=True)'s output (titan_mok/moe/experts.py; on the CPU its module takes another path):
    the Triton grouped FFN with one expert holding every row."""
    with torch.no_grad():
        group_end = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
        return grouped_swiglu_ffn(x, group_end, *(w[None] for w in shared_weights), swiglu_limit=swiglu_limit,
                                  use_triton=True)


# tokens per rank not a multiple of the 16-row tiles: the shared expert's last tile is partial
SHARED_CASES = {
    "groups of 2, lag 1": (dict(), 20, 80, None),
    "groups of 3 (a padding tile), clamped": (dict(group_tiles=3, lag=0, ring_tiles=3), 20, 64, 0.4),
    "groups of 1, lag 2: shared down items among routed gate/up": (dict(group_tiles=1, lag=2, ring_tiles=3), 40, 80,
                                                                   None),
}


@pytest.mark.parametrize("case, ranks", [(case, ranks) for ranks, case in zip((1, 4, 2), SHARED_CASES)]
                         + [(next(iter(SHARED_CASES)), 2)])
@interpreted
def test_shared_expert_in_the_launch_gives_the_triton_paths_bits(case, ranks):
    """The shared expert as items of the launch (its I_S = 80 or 64 in 32-column items) equals SharedExpert's
    Triton FFN added by the combine; twice on one workspace (its arrivals grow by K + 1 per call)."""
    sizes, tokens, dim_s, shared_limit = SHARED_CASES[case]
    (x, weights, _), expert_weights = layer_inputs(ranks, 64, seed=23, tokens=tokens)
    ids = routing("skewed", ranks, tokens=tokens, seed=24)
    shared_weights = shared_inputs(64, dim_s, seed=25)
    config = MegakernelConfig(**{**SMALL.__dict__, **sizes})
    want = triton_path(x, weights, ids.to(DEVICE), shared_expert_rows(x, shared_weights, shared_limit),
                       expert_weights, swiglu_limit=0.5)
    shared_expert = SharedFFN(*shared_weights, swiglu_limit=shared_limit)
    for _ in range(2):
        got = megakernel(ranks, x, weights, ids, None, expert_weights, config, swiglu_limit=0.5,
                         shared_expert=shared_expert)
        assert torch.equal(got, want), case


@interpreted
def test_shared_expert_scaled_per_token_like_the_output_gate():
    """Qwen3.5's gated shared expert: SharedExpert returns y.float() · sigmoid(x · w), which the combine adds in fp32;
    the launch's shared rows times the same fp32 scale, in the finish."""
    (x, weights, _), expert_weights = layer_inputs(2, 64, seed=26)
    ids = routing("skewed", 2, seed=27)
    shared_weights = shared_inputs(64, 64, seed=28)
    scale_T1 = torch.sigmoid(torch.randn(2 * T, 1, generator=torch.Generator().manual_seed(29))).to(DEVICE)
    shared_TH = shared_expert_rows(x, shared_weights).float() * scale_T1
    want = triton_path(x, weights, ids.to(DEVICE), shared_TH, expert_weights)
    got = megakernel(2, x, weights, ids, None, expert_weights, shared_expert=SharedFFN(*shared_weights),
                     shared_scale_T1=list(scale_T1.chunk(2)))
    assert torch.equal(got, want)


@interpreted
def test_shared_expert_missing_gate_up_is_a_named_error():
    """The serialized phases by hand: the shared expert's down items without its gate/up items."""
    (x, weights, _), expert_weights = layer_inputs(1, 64, seed=30)
    ids = routing("balanced", 1)
    shared_expert = SharedFFN(*shared_inputs(64, 64, seed=31))
    megakernel(1, x, weights, ids, None, expert_weights, shared_expert=shared_expert)  # allocates the workspace
    ws = mk._WORKSPACES[(torch.device(DEVICE), 1, T, K, 64, I, E, SMALL, 64, "bf16")]
    schedule = mk.tile_schedules([ids.to(DEVICE)], E, E, SMALL.block_m)
    run = functools.partial(megakernel_phase, ws.bufs, schedule, expert_weights, ws.shape, epoch=ws.next_epoch(),
                            swiglu_limit=None, shared=shared_expert)
    run(PHASE_PUBLISH)
    run(PHASE_DOWN, tiles=(0, SMALL.group_tiles))
    wait = "shared h ready: rank 0's compute program waited for the shared expert's gate/up items of its token tile 0 "
    with pytest.raises(RuntimeError, match=re.escape(f"mok megakernel: timed out: {wait}")):
        raise_on_megakernel_error()


def assert_kept_rows_at_virtual_ep(precision: str, seed: int, gate_up) -> None:
    """A training launch (kept rows) at virtual EP = 2, skewed (rank 1's experts get fewer than T rows), the shared
    expert (bf16) in the launch: each rank's kept g, u, h on its schedule's rows are gate_up(x rows, group ends, the
    rank's w_gate and w_up) bit for bit; the rows past its schedule's end keep what they held (no tile row past its
    expert's end, and none of the shared expert's rows, which would land in [0, T), is written)."""
    (x, weights, _), expert_weights = layer_inputs(2, 64, seed=seed)
    ids = routing("skewed", 2, seed=seed + 1)
    shared_expert = SharedFFN(*shared_inputs(64, 32, seed=seed + 2))
    # the workspace, x published
    megakernel(2, x, weights, ids, None, expert_weights, shared_expert=shared_expert, precision=precision)
    ws = mk._WORKSPACES[(torch.device(DEVICE), 2, T, K, 64, I, E // 2, SMALL, 32, precision)]
    schedule = mk.tile_schedules([i.to(DEVICE) for i in ids.chunk(2)], E // 2, E, SMALL.block_m)
    group_end_PL, _, row_slot_PR = schedule
    rows = 2 * T * K
    kept = KeptRows(*(torch.full((2, rows, I), float("nan"), dtype=torch.bfloat16, device=DEVICE) for _ in range(3)))
    megakernel_launch(ws.bufs, schedule, mk.launch_weights(expert_weights, precision), ws.shape,
                      epoch=ws.next_epoch(), swiglu_limit=None, serialized=True, shared=shared_expert, kept=kept)
    ws.reset()  # no finish ran: the arrivals are ahead of the workspace's count
    sizes = torch.diff(group_end_PL, dim=1, prepend=group_end_PL.new_zeros(2, 1))
    assert group_end_PL[1, -1] < T and (sizes % SMALL.block_m != 0).any(), group_end_PL
    local = E // 2
    for p in range(2):
        end = int(group_end_PL[p, -1])
        s = row_slot_PR[p, :end].long()  # gathered slot: rank s // N, token (s % N) // K
        x_RH = torch.zeros(rows, 64, dtype=torch.bfloat16, device=DEVICE)
        x_RH[:end] = x[(s // (T * K)) * T + (s % (T * K)) // K]
        want = gate_up(x_RH, group_end_PL[p], [w[p * local:(p + 1) * local] for w in expert_weights[:2]])
        for name, got_VRI, want_RI in zip(("gate", "up", "h"), kept, want):
            assert torch.equal(got_VRI[p, :end], want_RI[:end]), (p, name)
            assert got_VRI[p, end:].isnan().all(), (p, name)


@interpreted
def test_kept_rows_are_the_real_rows_gate_up_and_never_the_shared_experts():
    """assert_kept_rows_at_virtual_ep, bf16: the rows are ``grouped_gate_up_swiglu``'s."""
    assert_kept_rows_at_virtual_ep("bf16", 40, lambda x_RH, group_end, w: grouped_gate_up_swiglu(x_RH, group_end,
                                                                                                 *w, None))


@interpreted
def test_bad_shared_expert_inputs_are_named():
    (x, weights, shared), expert_weights = layer_inputs(2, 64)
    ids = routing("balanced", 2).to(DEVICE)
    w_gate, w_up, w_down = shared_inputs(64, 64, seed=32)
    call = lambda **kw: megakernel_routed_experts(  # noqa: E731
        **{**dict(x_TH=list(x.chunk(2)), weights_TK=list(weights.chunk(2)), topk_idx_TK=list(ids.chunk(2)),
                  shared_TH=[None, None], expert_weights=expert_weights, num_experts=E, config=SMALL,
                  shared_expert=SharedFFN(w_gate, w_up, w_down)), **kw})
    with pytest.raises(ValueError, match="shared_TH and shared_expert both give"):
        call(shared_TH=list(shared.chunk(2)))
    with pytest.raises(ValueError, match=r"shared_expert.w_down_HI must be a contiguous bfloat16 \(64, 64\)"):
        call(shared_expert=SharedFFN(w_gate, w_up, w_down.t()))
    with pytest.raises(ValueError, match="shared_scale_T1 scales the in-launch shared expert's output"):
        call(shared_expert=None, shared_scale_T1=[torch.ones(T, 1, device=DEVICE)] * 2)
    with pytest.raises(ValueError, match=r"shared_scale_T1 of rank 1 must be \(16, 1\) of torch.float32"):
        call(shared_scale_T1=[torch.ones(T, 1, device=DEVICE), torch.ones(T, device=DEVICE)])


def test_programs_per_sm_counts_registers_shared_memory_and_threads():
    h100 = {"max_num_regs": 65536, "max_shared_mem": 232448}
    assert programs_per_sm(254, 122880, 8, h100) == 1  # 254 registers x 256 threads: one program
    assert programs_per_sm(128, 122880, 4, h100) == 1  # registers allow 4, shared memory 1
    assert programs_per_sm(64, 40000, 4, h100) == 5  # shared memory allows 5, registers 8
    assert programs_per_sm(32, 0, 4, h100) == 16  # threads: 2048 / 128


@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(__import__("triton").__file__), "backends",
                                                    "nvidia", "bin", "cuobjdump")),
                    reason="Triton's wheel has no ptxas/cuobjdump here")
def test_compiles_for_sm90_with_wgmma_and_no_spills():
    """The concurrent launch's kernel at Kimi K2.7's sizes and 64-row tiles, without and with the shared
    expert (I_S 2048) in the launch, and with MXFP8 routed experts (pointer and TMA loads), compiled for sm_90 on the
    CPU (benchmarks/tools/sass.py's stand-in driver; the
    interpreter cannot compile, hence a subprocess): wgmmas, no spill stack, one program per SM at least (the
    occupancy the launch checks)."""
    script = (
        "import json; from benchmarks.tools import sass; from titan_mok.kernels import mok_megakernel as m\n"
        "from titan_mok.moe.megakernel import MegakernelConfig as C\n"
        "for shared, mx, gemm in ((0, False, 'ptr'), (2048, False, 'ptr'), (0, True, 'ptr'), (2048, True, 'tma')):\n"
        "    v = m.KernelVariant(7168, 2048, shared, 48, 64, C.block_n, C.num_warps, C.num_stages, False,\n"
        "                        gemm=gemm, mx=mx)\n"
        "    with sass.compiling_for_sm90():\n"
        "        k = m.compile_megakernel(v)\n"
        "    r = sass.kernel_report('_megakernel', k)\n"
        "    print(json.dumps(dict(hgmma=r['opcodes'].get('HGMMA', 0), stack=r['stack_bytes'],"
        " per_sm=sass.programs_per_sm(r))))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    for line in out.stdout.strip().splitlines()[-4:]:  # each variant
        report = __import__("json").loads(line)
        assert report["hgmma"] > 0 and report["stack"] == 0 and report["per_sm"] >= 1, report
