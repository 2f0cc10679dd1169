"""The MoK megakernel's dgrad launch on one GPU: the concurrent launch (communication and compute programs spinning
on each other's flags) at virtual EP 1, 2, 4, 8.

Claims, compared bit for bit: the concurrent launch equals the serialized one (the interpreter's mode, here
compiled) and the "triton" path's dgrad kernels on the same tokens at EP = 1 (dx, and the grouped dy, dgate, dup
rows), for every routing of the CPU tests and the smallest ring, in bf16 and MXFP8 (the Triton path's MXFP8 dgrad on
the GPU), by pointer and by TMA loads; it repeats its bits; a rank that never publishes ends in the bounded device
error (recorded, or with ``trap`` an assertion naming the wait); a launch the device cannot hold at once is refused;
no host sync.
"""

import os
import subprocess
import sys

import pytest
import torch

from tests.cuda_sync import run_without_host_sync
from tests.kernels.test_mok_megakernel import E, routing
from tests.kernels.test_mok_megakernel_bwd import assert_bitwise, backward_inputs, megakernel_dgrad, rank_rows
from titan_mok.moe.megakernel import MegakernelConfig
from titan_mok.moe.megakernel_bwd import megakernel_routed_dgrad

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, TOKENS = 256, 64
DEFAULT = MegakernelConfig()  # the device's co-resident programs, split among the ranks


def _inputs(ranks: int, kind: str, seed: int = 0):
    (x, dout, weights), expert_weights = backward_inputs(ranks, H, seed=seed, tokens=TOKENS)
    return x, dout, weights, routing(kind, ranks, tokens=TOKENS, seed=seed), expert_weights


@pytest.mark.parametrize("kind", ["balanced", "skewed", "one_expert", "empty_experts", "all_remote"])
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("precision, block_m, gemm", [("bf16", None, None), ("mxfp8", 64, None), ("mxfp8", 128, None),
                                                      ("bf16", 128, "tma"), ("mxfp8", 128, "tma")])
def test_concurrent_equals_serialized_and_triton_path(precision, block_m, gemm, ranks, kind):
    """The default config (bf16), the MX variant on 64- and 128-row tiles, and both by TMA loads on 128-row tiles."""
    x, dout, weights, ids, expert_weights = _inputs(ranks, kind, seed=ranks)
    config = MegakernelConfig(block_m=block_m, gemm=gemm)
    run = lambda **kw: megakernel_dgrad(ranks, x, dout, weights, ids, expert_weights, config,  # noqa: E731
                                        precision=precision, **kw)
    want, first, index = run()
    _, again, _ = run()
    _, serial, _ = run(serialized=True)
    for a, b, c in zip(first, again, serial):
        assert torch.equal(a.dx_TH, b.dx_TH) and torch.equal(a.dx_TH, c.dx_TH)
    assert_bitwise(want, first, index)


@pytest.mark.parametrize("ranks", [2, 8])
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("gemm", ["ptr", "tma"])
def test_smallest_ring_under_the_most_skewed_routing(gemm, precision, ranks):
    """One ring tile per rank (MXFP8: every tile's D1 also waits for the previous tile's D2 items to free the slot's
    dgate, dup tiles; TMA: every D1 item reads by TMA the rows the previous pull stored into the slot)."""
    x, dout, weights, ids, expert_weights = _inputs(ranks, "one_expert", seed=3)
    config = MegakernelConfig(comm_programs=2, compute_programs=2, group_tiles=1, lag=0, ring_tiles=1, gemm=gemm)
    assert_bitwise(*megakernel_dgrad(ranks, x, dout, weights, ids, expert_weights, config, swiglu_limit=0.5,
                                     precision=precision))


def test_mxfp8_long_k_loops_through_a_small_ring():
    """H 1024, I 512 (32 and 16 MXFP8 K steps per item), 256 tokens per rank at virtual EP 8 under skewed routing
    through a 4-tile ring."""
    (x, dout, weights), expert_weights = backward_inputs(8, 1024, seed=9, tokens=256, dim_i=512)
    ids = routing("skewed", 8, tokens=256, seed=9)
    config = MegakernelConfig(ring_tiles=4, group_tiles=2, lag=1)
    assert_bitwise(*megakernel_dgrad(8, x, dout, weights, ids, expert_weights, config, precision="mxfp8"))


def test_stalled_rank_ends_in_the_bounded_error_and_the_workspace_recovers():
    x, dout, weights, ids, expert_weights = _inputs(2, "balanced", seed=4)
    config = MegakernelConfig(timeout_ms=500.0)
    megakernel_dgrad(2, x, dout, weights, ids, expert_weights, config)  # compiled and allocated
    # every wait downstream of the stall runs out; which one first depends on when each began (and on other
    # processes' kernels time-slicing the GPU), so any of them names it
    with pytest.raises(RuntimeError, match="timed out: (dy_ready: rank 0's communication program waited for rank 1 |"
                                           "(ring|dgrad) ready: rank [01]'s compute program)"):
        megakernel_dgrad(2, x, dout, weights, ids, expert_weights, config, stall_rank=1)
    assert_bitwise(*megakernel_dgrad(2, x, dout, weights, ids, expert_weights, config))


def test_stalled_rank_with_trap_stops_the_device_naming_the_wait():
    """trap=True (the default): the finish launch's device assertion names the wait; the CUDA context dies, so
    in a process of its own."""
    script = (
        "import torch\n"
        "from tests.kernels.test_mok_megakernel import E, routing\n"
        "from tests.kernels.test_mok_megakernel_bwd import backward_inputs, rank_rows, triton_dgrad\n"
        "from titan_mok.moe.megakernel import MegakernelConfig\n"
        "from titan_mok.moe.megakernel_bwd import megakernel_routed_dgrad\n"
        f"(x, d, w), ew = backward_inputs(2, {H}, tokens={TOKENS})\n"
        f"ids = routing('balanced', 2, tokens={TOKENS})\n"
        "cfg = MegakernelConfig(timeout_ms=100.0)\n"
        "_, g, u = rank_rows(triton_dgrad(x, d, w, ids.cuda(), ew), 2, ids)\n"
        "sp = lambda t: list(t.cuda().chunk(2))\n"
        "megakernel_routed_dgrad(sp(d), sp(w), sp(ids), g, u, ew, num_experts=E, config=cfg, stall_rank=1)\n"
        "torch.cuda.synchronize()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-2000:]
    assert "mok megakernel backward: timed out waiting for" in text, text[-2000:]


def test_too_many_programs_are_refused():
    x, dout, weights, ids, expert_weights = _inputs(2, "balanced")
    with pytest.raises(RuntimeError, match="exceed the .* this device runs at once"):
        megakernel_dgrad(2, x, dout, weights, ids, expert_weights,
                         MegakernelConfig(comm_programs=1, compute_programs=10_000))


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_no_host_sync(precision):
    """The launch and the finish; under mxfp8 with the weights' dgrad operands kept under an owner (made at the first
    call)."""
    x, dout, weights, ids, expert_weights = _inputs(4, "skewed", seed=5)
    owner = torch.nn.Module()
    kept = dict(weights_owner=owner, weight_sources=expert_weights) if precision == "mxfp8" else {}
    want, _, _ = megakernel_dgrad(4, x, dout, weights, ids, expert_weights, DEFAULT, precision=precision,
                                  **kept)  # compiled and allocated
    _, gates, ups = rank_rows(want, 4, ids)
    dout_P, weights_P, ids_P = (list(t.cuda().chunk(4)) for t in (dout, weights, ids))  # copies sync: before
    run_without_host_sync(lambda: megakernel_routed_dgrad(dout_P, weights_P, ids_P, gates, ups, expert_weights,
                                                          num_experts=E, config=DEFAULT, precision=precision,
                                                          **kept))
