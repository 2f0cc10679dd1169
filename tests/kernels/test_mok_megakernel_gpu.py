"""The MoK forward megakernel on one GPU: the concurrent launch (communication and compute programs spinning on
each other's flags) at virtual EP 1, 2, 4, 8.

Claims, compared bit for bit: the concurrent launch equals the serialized one (the interpreter's mode, here
compiled) and today's triton path on the same tokens (reference dispatch, the Triton grouped FFN on the GPU,
reference combine, at EP = 1), for every routing of the CPU tests, the smallest ring and the CPU tests' item
orders, and with the shared expert in the launch (against the SharedExpert module, gated too), also with TMA loads
and on 128-row tiles (K loops longer than the pipeline too); it repeats its bits;
a rank that never publishes ends in the bounded device error (recorded, or with ``trap`` an assertion naming
the wait) within a few timeouts; a launch the device cannot hold at once is refused; no host sync.
"""

import os
import subprocess
import sys
import time

import pytest
import torch

from tests.cuda_sync import run_without_host_sync
from tests.kernels.test_mok_megakernel import ORDERS, E, layer_inputs, megakernel, routing, triton_path
from titan_mok.kernels.grouped_ffn import grouped_swiglu_ffn
from titan_mok.kernels.mok_megakernel import SharedFFN
from titan_mok.kernels.row_tiles import pointwise_padded, row_invariant_linear
from titan_mok.moe.experts import SharedExpert
from titan_mok.moe.megakernel import MegakernelConfig, megakernel_routed_experts, raise_on_megakernel_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, TOKENS = 256, 64
DEFAULT = MegakernelConfig()  # the device's co-resident programs, split among the ranks


def _inputs(ranks: int, kind: str, seed: int = 0):
    (x, weights, shared), expert_weights = layer_inputs(ranks, H, seed=seed, tokens=TOKENS)
    return x, weights, routing(kind, ranks, tokens=TOKENS, seed=seed).cuda(), shared, expert_weights


@pytest.mark.parametrize("kind", ["balanced", "skewed", "one_expert", "empty_experts", "all_remote"])
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_concurrent_equals_serialized_and_triton_path(ranks, kind):
    x, weights, ids, shared, expert_weights = _inputs(ranks, kind, seed=ranks)
    want = triton_path(x, weights, ids, shared, expert_weights)
    first = megakernel(ranks, x, weights, ids, shared, expert_weights, DEFAULT)
    assert torch.equal(megakernel(ranks, x, weights, ids, shared, expert_weights, DEFAULT), first), "run-to-run"
    assert torch.equal(megakernel(ranks, x, weights, ids, shared, expert_weights, DEFAULT, serialized=True), first)
    assert torch.equal(first, want), f"{ranks} ranks, {kind}: differs from the triton path"


@pytest.mark.parametrize("ranks", [2, 8])
def test_smallest_ring_under_the_most_skewed_routing(ranks):
    """One ring tile per rank and two programs of each kind: every tile waits for its slot's previous tile."""
    x, weights, ids, shared, expert_weights = _inputs(ranks, "one_expert", seed=3)
    config = MegakernelConfig(comm_programs=2, compute_programs=2, group_tiles=1, lag=0, ring_tiles=1)
    want = triton_path(x, weights, ids, shared, expert_weights)
    assert torch.equal(megakernel(ranks, x, weights, ids, shared, expert_weights, config), want)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("ranks", [1, 8])
def test_item_orders_and_rings_concurrently(ranks, order):
    """The CPU tests' item orders and rings (their group, lag and ring; the device's programs), run concurrently:
    B items racing the A items they need, pulls racing the B items that free their slots."""
    x, weights, ids, shared, expert_weights = _inputs(ranks, "skewed", seed=6)
    sizes = {k: v for k, v in ORDERS[order].items() if k in ("group_tiles", "lag", "ring_tiles")}
    want = triton_path(x, weights, ids, shared, expert_weights)
    first = megakernel(ranks, x, weights, ids, shared, expert_weights, MegakernelConfig(**sizes))
    assert torch.equal(megakernel(ranks, x, weights, ids, shared, expert_weights, MegakernelConfig(**sizes)), first)
    assert torch.equal(first, want), f"{ranks} ranks, {order}: differs from the triton path"


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_shared_expert_in_the_launch_equals_the_shared_expert_module(ranks, gated):
    """The shared expert as items of the launch equals ``SharedExpert(use_triton=True)`` (its Triton FFN on the GPU)
    added by the combine; gated (Qwen3.5): its output gate as the finish's per-token scale. Concurrent, twice, and
    serialized, alike."""
    x, weights, ids, _, expert_weights = _inputs(ranks, "skewed", seed=7)
    torch.manual_seed(7)
    module = SharedExpert(H, 192, gated, None, use_triton=True).cuda()
    with torch.no_grad():
        want = triton_path(x, weights, ids, module(x), expert_weights)
        shared_expert = SharedFFN(*(linear.weight.to(torch.bfloat16).contiguous()
                                    for linear in (module.w_gate, module.w_up, module.w_down)))
        scale_T1 = pointwise_padded(torch.sigmoid, row_invariant_linear(x.float(), module.output_gate.weight.float())
                                    ) if gated else None
    kw = dict(shared_expert=shared_expert, shared_scale_T1=list(scale_T1.chunk(ranks)) if gated else None)
    first = megakernel(ranks, x, weights, ids, None, expert_weights, DEFAULT, **kw)
    assert torch.equal(megakernel(ranks, x, weights, ids, None, expert_weights, DEFAULT, **kw), first), "run-to-run"
    assert torch.equal(megakernel(ranks, x, weights, ids, None, expert_weights, DEFAULT, serialized=True, **kw), first)
    assert torch.equal(first, want), f"{ranks} ranks: differs from SharedExpert + the triton path"


def test_stalled_rank_ends_in_the_bounded_error_and_the_workspace_recovers():
    x, weights, ids, shared, expert_weights = _inputs(2, "balanced", seed=4)
    split = lambda t: list(t.chunk(2))  # noqa: E731
    timeout_ms = 500.0
    config = MegakernelConfig(timeout_ms=timeout_ms)
    megakernel(2, x, weights, ids, shared, expert_weights, config)  # compiled and allocated
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        megakernel_routed_experts(split(x), split(weights), split(ids), split(shared), expert_weights, num_experts=E,
                                  config=config, trap=False, stall_rank=1)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    with pytest.raises(RuntimeError, match="x_ready: rank 0's communication program waited for rank 1 |ring ready: "
                                           "rank 1's compute program"):
        raise_on_megakernel_error()
    # one timeout, then the others see the recorded error and stop (margin: GPU time-sliced with other processes)
    assert elapsed < 3 * timeout_ms / 1000 + 1.0, f"the stalled call took {elapsed:.3f} s"
    want = triton_path(x, weights, ids, shared, expert_weights)
    assert torch.equal(megakernel(2, x, weights, ids, shared, expert_weights, config), want)


def test_stalled_rank_with_trap_stops_the_device_naming_the_wait():
    """trap=True (the default): the finish launch's device assertion names the wait; the CUDA context dies, so
    in a process of its own."""
    script = (
        "import torch\n"
        "from tests.kernels.test_mok_megakernel import E, layer_inputs, routing\n"
        "from titan_mok.moe.megakernel import MegakernelConfig, megakernel_routed_experts\n"
        f"(x, w, s), ew = layer_inputs(2, {H}, tokens={TOKENS})\n"
        f"ids = routing('balanced', 2, tokens={TOKENS}).cuda()\n"
        "sp = lambda t: list(t.chunk(2))\n"
        "with torch.no_grad():\n"
        "    megakernel_routed_experts(sp(x), sp(w), sp(ids), sp(s), ew, num_experts=E,"
        " config=MegakernelConfig(timeout_ms=100.0), stall_rank=1)\n"
        "torch.cuda.synchronize()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-2000:]
    assert "mok megakernel: timed out waiting for" in text, text[-2000:]


def test_too_many_programs_are_refused():
    x, weights, ids, shared, expert_weights = _inputs(2, "balanced")
    with pytest.raises(RuntimeError, match="exceed the .* this device runs at once"):
        megakernel(2, x, weights, ids, shared, expert_weights, MegakernelConfig(comm_programs=1,
                                                                                compute_programs=10_000))


@pytest.mark.parametrize("config", [DEFAULT, MegakernelConfig(gemm="tma", block_m=128)], ids=["default", "tma M128"])
def test_no_host_sync(config):
    """Also with TMA loads: the descriptors' global scratch comes from Triton's allocator (torch memory), per launch."""
    x, weights, ids, shared, expert_weights = _inputs(4, "skewed", seed=5)
    split = lambda t: list(t.chunk(4))  # noqa: E731

    def call():
        with torch.no_grad():
            return megakernel_routed_experts(split(x), split(weights), split(ids), split(shared), expert_weights,
                                             num_experts=E, config=config)

    call()  # compile the kernels and allocate the workspace
    run_without_host_sync(call)


# The item GEMMs' other variants (the default config's at these sizes: TMA loads on 64-row tiles, above)
VARIANTS = {"ptr M64": dict(gemm="ptr", block_m=64), "ptr M128": dict(gemm="ptr", block_m=128),
            "tma M128": dict(gemm="tma", block_m=128)}


@pytest.mark.parametrize("kind", ["skewed", "one_expert", "empty_experts", "all_remote"])
@pytest.mark.parametrize("ranks", [1, 2, 8])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gemm_variants_concurrent_equal_serialized_and_triton_path(variant, ranks, kind):
    """TMA loads and 128-row tiles, concurrently (TMA reads of rows other programs stored, behind the proxy fence):
    the triton path's bits, run to run and serialized alike."""
    x, weights, ids, shared, expert_weights = _inputs(ranks, kind, seed=ranks)
    config = MegakernelConfig(**VARIANTS[variant])
    want = triton_path(x, weights, ids, shared, expert_weights)
    first = megakernel(ranks, x, weights, ids, shared, expert_weights, config)
    assert torch.equal(megakernel(ranks, x, weights, ids, shared, expert_weights, config), first), "run-to-run"
    assert torch.equal(megakernel(ranks, x, weights, ids, shared, expert_weights, config, serialized=True), first)
    assert torch.equal(first, want), f"{variant}, {ranks} ranks, {kind}: differs from the triton path"


@pytest.mark.parametrize("ranks", [1, 8])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gemm_variants_smallest_ring_and_shared_expert(variant, ranks):
    """The variants with one ring tile per rank (every pull waits for its slot's previous tile's B items) and with
    the gated shared expert in the launch."""
    x, weights, ids, _, expert_weights = _inputs(ranks, "one_expert", seed=9)
    tight = MegakernelConfig(comm_programs=2, compute_programs=2, group_tiles=1, lag=0, ring_tiles=1,
                             **VARIANTS[variant])
    torch.manual_seed(9)
    module = SharedExpert(H, 192, True, None, use_triton=True).cuda()
    with torch.no_grad():
        shared_TH = module(x)
        shared_expert = SharedFFN(*(linear.weight.to(torch.bfloat16).contiguous()
                                    for linear in (module.w_gate, module.w_up, module.w_down)))
        scale_T1 = pointwise_padded(torch.sigmoid, row_invariant_linear(x.float(), module.output_gate.weight.float()))
    want = triton_path(x, weights, ids, shared_TH, expert_weights)
    assert torch.equal(megakernel(ranks, x, weights, ids, shared_TH, expert_weights, tight), want), "smallest ring"
    got = megakernel(ranks, x, weights, ids, None, expert_weights, MegakernelConfig(**VARIANTS[variant]),
                     shared_expert=shared_expert, shared_scale_T1=list(scale_T1.chunk(ranks)))
    assert torch.equal(got, want), f"{variant}, {ranks} ranks: differs from SharedExpert + the triton path"


@pytest.mark.parametrize("variant", VARIANTS)
def test_gemm_variants_on_long_k_loops_through_a_small_ring(variant):
    """K loops longer than the pipeline (H 1024, I 512: 16 and 8 steps of 64, the other tests' at most 4) in steady
    state across items and rounds: 256 tokens per rank at virtual EP 8 under skewed routing (rank 0's expert holds
    about half of all rows: ~16 full 128-row tiles) through a 4-tile ring, the shared expert (I_S 384) in the
    launch; three calls on one workspace."""
    ranks, tokens = 8, 256
    (x, weights, _), expert_weights = layer_inputs(ranks, 1024, seed=9, tokens=tokens, dim_i=512)
    ids = routing("skewed", ranks, tokens=tokens, seed=9).cuda()
    g = torch.Generator(device="cuda").manual_seed(10)
    shared_weights = tuple((torch.randn(*shape, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
                           for shape in ((384, 1024), (384, 1024), (1024, 384)))
    with torch.no_grad():  # SharedExpert(use_triton=True)'s rows: the Triton FFN, every row in one expert's group
        group_end = torch.full((1,), x.shape[0], dtype=torch.int32, device="cuda")
        shared_TH = grouped_swiglu_ffn(x, group_end, *(w[None] for w in shared_weights), use_triton=True)
    want = triton_path(x, weights, ids, shared_TH, expert_weights)
    config = MegakernelConfig(group_tiles=2, lag=1, ring_tiles=4, **VARIANTS[variant])
    for call in range(3):
        got = megakernel(ranks, x, weights, ids, None, expert_weights, config, shared_expert=SharedFFN(*shared_weights))
        assert torch.equal(got, want), f"{variant}, call {call}"
