"""The MoK forward megakernel with MXFP8 routed experts on one GPU: the concurrent launch at virtual EP 1, 2, 4, 8.

Claims, compared bit for bit: the concurrent launch equals the serialized one and the triton path's MXFP8 output on
the same tokens (reference dispatch, the Triton grouped FFN with ``precision="mxfp8"`` on the GPU, its
warp-specialized or TMA kernels as tile_configs picks them, reference combine, at EP = 1), for the CPU tests'
routings, by pointer and TMA loads on 64- and 128-row tiles, through the smallest ring, with the bf16 shared expert
in the launch, on K loops longer than the pipeline; it repeats its bits; no host sync. The training launch's kept g,
u, h rows are the Triton MXFP8 forward's (h unquantized). CPU (the interpreter's serialized mode):
test_mok_megakernel_mxfp8.py.
"""

import pytest
import torch

from tests.cuda_sync import run_without_host_sync
from tests.kernels.test_mok_megakernel import E, layer_inputs, megakernel, routing
from tests.kernels.test_mok_megakernel_mxfp8 import ffn_path
from titan_mok.kernels.grouped_ffn import grouped_swiglu_ffn
from titan_mok.kernels.mok_megakernel import SharedFFN
from titan_mok.moe.megakernel import MegakernelConfig, megakernel_routed_experts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, TOKENS = 256, 64
VARIANTS = {"ptr M64": dict(gemm="ptr", block_m=64), "tma M64": dict(gemm="tma", block_m=64),
            "ptr M128": dict(gemm="ptr", block_m=128), "tma M128": dict(gemm="tma", block_m=128)}


def _inputs(ranks: int, kind: str, seed: int = 0, dim_h: int = H, tokens: int = TOKENS, dim_i: int = 64):
    (x, weights, shared), expert_weights = layer_inputs(ranks, dim_h, seed=seed, tokens=tokens, dim_i=dim_i)
    return x, weights, routing(kind, ranks, tokens=tokens, seed=seed).cuda(), shared, expert_weights


def mx(ranks, x, weights, ids, shared, expert_weights, config, **kw):
    return megakernel(ranks, x, weights, ids, shared, expert_weights, config, precision="mxfp8", **kw)


@pytest.mark.parametrize("kind", ["balanced", "skewed", "one_expert", "empty_experts", "all_remote"])
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("variant", VARIANTS)
def test_mxfp8_concurrent_equals_serialized_and_triton_path(variant, ranks, kind):
    x, weights, ids, shared, expert_weights = _inputs(ranks, kind, seed=ranks)
    config = MegakernelConfig(**VARIANTS[variant])
    want = ffn_path(x, weights, ids, shared, expert_weights)
    first = mx(ranks, x, weights, ids, shared, expert_weights, config)
    assert torch.equal(mx(ranks, x, weights, ids, shared, expert_weights, config), first), "run-to-run"
    assert torch.equal(mx(ranks, x, weights, ids, shared, expert_weights, config, serialized=True), first)
    assert torch.equal(first, want), f"{variant}, {ranks} ranks, {kind}: differs from the triton path's MXFP8"


@pytest.mark.parametrize("ranks", [2, 8])
@pytest.mark.parametrize("variant", VARIANTS)
def test_mxfp8_smallest_ring_and_bf16_shared_expert_in_the_launch(variant, ranks):
    """One ring tile per rank under the most skewed routing (every pull waits for its slot's previous tile), then
    the clamped bf16 shared expert in the launch beside the MXFP8 routed experts."""
    x, weights, ids, shared, expert_weights = _inputs(ranks, "one_expert", seed=3)
    tight = MegakernelConfig(comm_programs=2, compute_programs=2, group_tiles=1, lag=0, ring_tiles=1,
                             **VARIANTS[variant])
    assert torch.equal(mx(ranks, x, weights, ids, shared, expert_weights, tight),
                       ffn_path(x, weights, ids, shared, expert_weights)), "smallest ring"
    g = torch.Generator(device="cuda").manual_seed(4)
    shared_weights = tuple((torch.randn(*shape, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
                           for shape in ((192, H), (192, H), (H, 192)))
    with torch.no_grad():  # SharedExpert(use_triton=True)'s rows: the bf16 Triton FFN, every row in one group
        group_end = torch.full((1,), x.shape[0], dtype=torch.int32, device="cuda")
        shared_TH = grouped_swiglu_ffn(x, group_end, *(w[None] for w in shared_weights), use_triton=True,
                                       swiglu_limit=0.4)
    got = mx(ranks, x, weights, ids, None, expert_weights, MegakernelConfig(**VARIANTS[variant]), swiglu_limit=0.5,
             shared_expert=SharedFFN(*shared_weights, swiglu_limit=0.4))
    assert torch.equal(got, ffn_path(x, weights, ids, shared_TH, expert_weights, swiglu_limit=0.5)), variant


@pytest.mark.parametrize("variant", VARIANTS)
def test_mxfp8_long_k_loops_through_a_small_ring(variant):
    """H 1024, I 512 (32 and 16 MXFP8 K steps), 256 tokens per rank at virtual EP 8 under skewed routing through a
    4-tile ring; three calls on one workspace."""
    x, weights, ids, shared, expert_weights = _inputs(8, "skewed", seed=9, dim_h=1024, tokens=256, dim_i=512)
    config = MegakernelConfig(ring_tiles=4, group_tiles=2, lag=1, **VARIANTS[variant])
    want = ffn_path(x, weights, ids, shared, expert_weights)
    for call in range(3):
        assert torch.equal(mx(8, x, weights, ids, shared, expert_weights, config), want), (variant, call)


@pytest.mark.parametrize("kind", ["skewed", "one_expert", "empty_experts"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_mxfp8_kept_rows_are_the_triton_forwards(variant, kind):
    """One rank, ``megakernel_rank_forward(keep_rows=True)``: the kept g, u, h on the schedule's rows are the Triton
    MXFP8 forward's ``grouped_gate_up_swiglu`` on those x rows, and the output is the launch's without kept rows."""
    from tests.kernels.test_mok_megakernel_mxfp8 import triton_gate_up
    from titan_mok.moe.fused import fused_dispatch
    from titan_mok.moe.megakernel_rank import megakernel_rank_forward

    x, weights, ids, shared, expert_weights = _inputs(1, kind, seed=6)
    config = MegakernelConfig(**VARIANTS[variant])
    call = lambda keep: megakernel_rank_forward(  # noqa: E731
        x, weights, ids, shared, expert_weights, num_experts=E, group=None, config=config, precision="mxfp8",
        keep_rows=keep)
    with torch.no_grad():
        plain, _, _ = call(False)
        out, handle, kept = call(True)
        want = triton_gate_up(fused_dispatch(x, handle), handle.group_end, expert_weights)
    assert torch.equal(out, plain)
    rows = int(handle.group_end[-1])
    for name, got_RI, want_RI in zip(("gate", "up", "h"), kept, want):
        assert torch.equal(got_RI[:rows], want_RI[:rows]), (variant, kind, name)


def test_mxfp8_no_host_sync():
    """The launch, its weight operands (kept under an owner: made at the first call) and the finish."""
    x, weights, ids, shared, expert_weights = _inputs(2, "skewed", seed=5)
    split = lambda t: list(t.chunk(2))  # noqa: E731
    owner = torch.nn.Module()

    def call():
        with torch.no_grad():
            return megakernel_routed_experts(split(x), split(weights), split(ids), split(shared), expert_weights,
                                             num_experts=E, precision="mxfp8", weights_owner=owner,
                                             weight_sources=expert_weights)

    call()  # compile the kernels, allocate the workspace
    run_without_host_sync(call)
