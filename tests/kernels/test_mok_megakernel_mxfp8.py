"""The MoK forward megakernel with MXFP8 routed experts (``precision = "mxfp8"``), on CPU in Triton's interpreter
(serialized), at virtual EP: the communication programs quantize each pulled row along H into the ring (its MXFP8
values, bf16), the gate/up items read the Triton path's MXFP8 weight operands and store h's MXFP8 values along I, the
down items read those; the shared expert stays bf16.

The bits it must give: the triton path's MXFP8 output on the same rows (reference dispatch, the Triton grouped FFN
with ``precision="mxfp8"``, reference combine) at EP = 1 on all P ranks' tokens, compared with torch.equal. The
reference backend's MXFP8 FFN (fp32 GEMMs on the same operand values) equals the Triton one only up to fp32
summation order (tests/kernels/test_grouped_ffn.py states the tolerance), so it is the bound here, not the bits.
GPU (the concurrent launch): test_mok_megakernel_gpu.py.
"""

import dataclasses

import pytest
import torch

from tests.kernels.test_mok_megakernel import (
    DEVICE,
    SMALL,
    E,
    T,
    assert_kept_rows_at_virtual_ep,
    interpreted,
    layer_inputs,
    megakernel,
    routing,
    shared_expert_rows,
    shared_inputs,
)
from titan_mok.kernels import weight_cache
from titan_mok.kernels.grouped_ffn import grouped_swiglu_ffn, weight_operand
from titan_mok.kernels.grouped_gemm import grouped_gate_up_swiglu
from titan_mok.kernels.mok_megakernel import SharedFFN
from titan_mok.kernels.mxfp8_gathered import GatheredOperands, MXFP8GatheredWeight
from titan_mok.kernels.mxfp8_quant import ref_mxfp8_fake_quantize
from titan_mok.moe import megakernel as mk
from titan_mok.moe.dispatch import build_dispatch_handle, combine, dispatch
from titan_mok.moe.fused import fused_dispatch
from titan_mok.moe.megakernel import MegakernelConfig
from titan_mok.moe.megakernel_rank import megakernel_rank_forward


NAMES = ("w_gate_EIH", "w_up_EIH", "w_down_EHI")


def ffn_path(x, weights, ids, shared, expert_weights, swiglu_limit=None, use_triton=True) -> torch.Tensor:
    """The MXFP8 FFN at EP = 1 on all the tokens: reference dispatch → grouped FFN (Triton, or the reference
    backend's) → combine."""
    with torch.no_grad():
        handle = build_dispatch_handle(ids.to(DEVICE), E, None, None)
        y_RH = grouped_swiglu_ffn(dispatch(x, handle), handle.group_end, *expert_weights, swiglu_limit=swiglu_limit,
                                  use_triton=use_triton, precision="mxfp8")
        return combine(y_RH, weights, shared, handle, torch.bfloat16)


def mx_megakernel(ranks, x, weights, ids, shared, expert_weights, config=SMALL, **kw) -> torch.Tensor:
    return megakernel(ranks, x, weights, ids, shared, expert_weights, config, precision="mxfp8", **kw)


@pytest.mark.parametrize("ranks, kind", [(1, "skewed"), (2, "one_expert"), (2, "empty_experts"), (4, "all_remote")])
@interpreted
def test_mxfp8_megakernel_equals_triton_path_bitwise(ranks, kind):
    (x, weights, shared), expert_weights = layer_inputs(ranks, 64, seed=60 + ranks)
    ids = routing(kind, ranks, seed=ranks)
    want = ffn_path(x, weights, ids, shared, expert_weights)
    got = mx_megakernel(ranks, x, weights, ids, shared, expert_weights)
    assert torch.equal(got, want), (ranks, kind)
    # the reference backend's MXFP8 FFN: the same operand values, fp32 sums in another order
    reference = ffn_path(x, weights, ids, shared, expert_weights, use_triton=False)
    torch.testing.assert_close(got.float(), reference.float(), atol=2e-2, rtol=2e-2)


@interpreted
def test_mxfp8_smallest_ring_most_skewed_routing_and_run_to_run():
    """One ring tile per rank, every row to two experts of rank 0, two programs of each kind (every tile waits for
    the previous one's slot): the triton path's bits, twice in a row."""
    (x, weights, shared), expert_weights = layer_inputs(2, 64, seed=70)
    ids = routing("one_expert", 2)
    config = MegakernelConfig(comm_programs=2, compute_programs=2, group_tiles=1, lag=0, ring_tiles=1, block_m=16,
                              block_n=32)
    want = ffn_path(x, weights, ids, shared, expert_weights)
    first = mx_megakernel(2, x, weights, ids, shared, expert_weights, config)
    assert torch.equal(first, want)
    assert torch.equal(mx_megakernel(2, x, weights, ids, shared, expert_weights, config), first)


@interpreted
def test_mxfp8_tma_loads_clamp_and_bf16_shared_expert_in_the_launch():
    """gemm = "tma" (the ring's and h's bf16 rows and the weights' E4M3 rows by tensor descriptors in 32-column
    blocks; scales by pointer), H = 96 and I = 96 in 64-column items (a partial column block of both GEMMs, its
    last 32 columns past the row), the SwiGLU clamps, the shared expert (bf16) in the same launch."""
    (x, weights, _), expert_weights = layer_inputs(2, 96, seed=72, tokens=20, dim_i=96)
    ids = routing("skewed", 2, tokens=20, seed=73)
    shared_weights = shared_inputs(96, 64, seed=74)
    want = ffn_path(x, weights, ids, shared_expert_rows(x, shared_weights, 0.4), expert_weights, swiglu_limit=0.5)
    config = dataclasses.replace(SMALL, block_n=64, gemm="tma")
    got = mx_megakernel(2, x, weights, ids, None, expert_weights, config, swiglu_limit=0.5,
                        shared_expert=SharedFFN(*shared_weights, swiglu_limit=0.4))
    assert torch.equal(got, want)


@interpreted
def test_mxfp8_ring_holds_the_rows_mxfp8_values():
    """After a call at one rank with every row in one tile per expert, each ring slot holds its tile's rows as the
    Triton FFN's A operand: the bf16 values of their MXFP8 quantization along H, bit for bit the reference's (zeros
    past the expert's rows), in a ring as large as the bf16 launch's."""
    (x, weights, shared), expert_weights = layer_inputs(1, 64, seed=75)
    ids = routing("balanced", 1)  # 4 rows per expert: ring slot q ends holding expert (last tiles)'s rows
    mx_megakernel(1, x, weights, ids, shared, expert_weights)
    ws = mk._WORKSPACES[(torch.device(DEVICE), 1, 16, 2, 64, 64, E, SMALL, 0, "mxfp8")]
    bufs = ws.bufs
    assert bufs.ring_VQMH.dtype == torch.bfloat16 and bufs.ring_VQMH.shape == (1, SMALL.ring_tiles, 16, 64)
    handle = build_dispatch_handle(ids.to(DEVICE), E, None, None)
    x_RH = dispatch(x, handle)
    for q in range(SMALL.ring_tiles):
        expert = E - SMALL.ring_tiles + q  # 8 tiles in a ring of 4: the second round's
        rows_MH = torch.zeros(16, 64, dtype=torch.bfloat16, device=DEVICE)
        rows_MH[:4] = x_RH[4 * expert:4 * expert + 4]
        assert torch.equal(bufs.ring_VQMH[0, q], ref_mxfp8_fake_quantize(rows_MH)), q


@interpreted
def test_mxfp8_reads_the_kept_weight_operands_or_the_gathered_ones():
    """With an owner and sources, the launch reads the MXFP8 operands kept for the Triton FFN (made once per
    weight version) and quantizes none again; given FSDP's
    MXFP8-gathered weights, their operands as gathered: the same bits."""
    (x, weights, shared), expert_weights = layer_inputs(1, 64, seed=77)
    ids = routing("skewed", 1, seed=78)
    owner = torch.nn.Module()
    first = mx_megakernel(1, x, weights, ids, shared, expert_weights, weights_owner=owner,
                          weight_sources=expert_weights)
    kept = dict(weight_cache._kept[owner])
    assert sorted(kept) == [(n, 2) for n in ("w_down_EHI", "w_gate_EIH", "w_up_EIH")]
    operands = mk.launch_weights(expert_weights, "mxfp8", owner, expert_weights)
    assert [o is kept[(n, 2)].operand for o, n in zip(operands, NAMES)] == [True] * 3
    gathered = [MXFP8GatheredWeight(GatheredOperands({2: kept[(n, 2)].operand}), w.shape, w.dtype, w.device)
                for w, n in zip(expert_weights, NAMES)]
    assert torch.equal(mx_megakernel(1, x, weights, ids, shared, tuple(gathered)), first)
    assert all(weight_cache._kept[owner][key].operand is entry.operand for key, entry in kept.items())


def triton_gate_up(x_RH, group_end, expert_weights, swiglu_limit=None):
    """The Triton MXFP8 forward's saved g, u, h on grouped rows (``grouped_gate_up_swiglu`` on the MXFP8 forward
    operands; h before its quantization, as the backward reads it)."""
    operands = [weight_operand(w, "mxfp8", 2, n) for w, n in zip(expert_weights[:2], NAMES)]
    return grouped_gate_up_swiglu(x_RH, group_end, *operands, swiglu_limit)


@pytest.mark.parametrize("kind, tokens, limit", [("skewed", T, None), ("one_expert", T - 3, 0.5)])
@interpreted
def test_mxfp8_kept_rows_are_the_triton_forwards_and_the_output_is_unchanged(kind, tokens, limit):
    """A training launch under mxfp8 (``megakernel_rank_forward(keep_rows=True)``, one rank): its kept g, u, h on
    the schedule's rows are the Triton MXFP8 forward's ``grouped_gate_up_swiglu`` on those x rows bit for bit (h
    unquantized), tiles running past their expert's end and experts without rows included; the output is the
    launch's without kept rows."""
    (x, weights, shared), expert_weights = layer_inputs(1, 64, seed=80, tokens=tokens)
    ids = routing(kind, 1, tokens=tokens, seed=81).to(DEVICE)
    call = lambda keep: megakernel_rank_forward(  # noqa: E731
        x, weights, ids, shared, expert_weights, num_experts=E, group=None, swiglu_limit=limit, config=SMALL,
        precision="mxfp8", keep_rows=keep)
    with torch.no_grad():
        plain, _, none = call(False)
        out, handle, kept = call(True)
        want = triton_gate_up(fused_dispatch(x, handle), handle.group_end, expert_weights, limit)
    assert none is None and torch.equal(out, plain)
    sizes = torch.diff(handle.group_end, prepend=handle.group_end.new_zeros(1))
    assert (sizes % SMALL.block_m != 0).any() and (sizes == 0).any(), sizes
    rows = int(handle.group_end[-1])
    for name, got_RI, want_RI in zip(("gate", "up", "h"), kept, want):
        assert torch.equal(got_RI[:rows], want_RI[:rows]), name
    # h is kept as the SwiGLU gave it: its MXFP8 values (what the down items read) differ
    assert not torch.equal(ref_mxfp8_fake_quantize(kept[2][:rows]), kept[2][:rows])


@interpreted
def test_mxfp8_kept_rows_at_virtual_ep_are_the_real_rows_only():
    """assert_kept_rows_at_virtual_ep, MXFP8: the rows are the Triton MXFP8 forward's (h unquantized)."""
    assert_kept_rows_at_virtual_ep("mxfp8", 82, triton_gate_up)


@interpreted
def test_mxfp8_bad_inputs_are_named():
    (x, weights, shared), expert_weights = layer_inputs(1, 64)
    ids = routing("balanced", 1)
    with pytest.raises(ValueError, match=r"precision = 'fp8' must be one of \('bf16', 'mxfp8'\)"):
        megakernel(1, x, weights, ids, shared, expert_weights, precision="fp8")
    (x80, weights80, shared80), expert_weights80 = layer_inputs(1, 80)
    with pytest.raises(ValueError, match=r"precision 'mxfp8' needs H \(80\) and I \(64\) to be multiples of 32"):
        mx_megakernel(1, x80, weights80, ids, shared80, expert_weights80)
    with pytest.raises(ValueError, match=r"block_n = 16: precision 'mxfp8' stores h in 32-column MXFP8 blocks"):
        mx_megakernel(1, x, weights, ids, shared, expert_weights, dataclasses.replace(SMALL, block_n=16))
