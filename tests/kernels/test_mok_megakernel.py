"""The MoK forward megakernel (kernels/mok_megakernel.py via titan_mok.moe.megakernel) on CPU, in Triton's
interpreter, serialized (publish, then per ring round: pull, compute; waits are assertions), at virtual EP.

The bits it must give: today's triton path on the same rows, i.e. the reference backend's dispatch, the Triton
grouped FFN (``grouped_swiglu_ffn(use_triton=True)``, in the interpreter too) and the reference combine (the
fused path's slot reduction equals it bit for bit: test_mok_fused.py), computed at EP = 1 on all P ranks'
tokens at once. So each test also holds a token's output independent of P and of the batch. Compared with
torch.equal. GPU (the concurrent launch): test_mok_megakernel_gpu.py.
"""

import os
import subprocess
import sys

import pytest
import torch

from tests.torchrun import REPO
from titan_mok.kernels.grouped_ffn import grouped_swiglu_ffn
from titan_mok.kernels.mok_megakernel import MAX_EPOCH, programs_per_sm
from titan_mok.moe import megakernel as mk
from titan_mok.moe.dispatch import build_dispatch_handle, combine, dispatch
from titan_mok.moe.megakernel import MegakernelConfig, megakernel_routed_experts, raise_on_megakernel_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small tiles (16 rows: MMAs unlike the GPU configs') and the serialized launches: the interpreter's tests
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the interpreter's serialized mode; on a GPU see test_mok_megakernel_gpu.py")
T, K, E, I = 16, 2, 8, 64
SMALL = MegakernelConfig(comm_programs=1, compute_programs=2, ring_tiles=3, block_m=16, block_n=32)


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
    elif kind == "all_remote":  # rank p's tokens all go to rank p + 1's experts
        local = experts // ranks
        owner = ((torch.arange(rows) // tokens + 1) % ranks)[:, None]
        ids = owner * local + torch.rand(rows, local, generator=g).argsort(dim=1)[:, :K]
    else:
        raise ValueError(kind)
    return ids


def layer_inputs(ranks: int, dim_h: int, seed: int = 1, tokens: int = T):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ranks * tokens, dim_h, generator=g).to(torch.bfloat16)
    weights = torch.rand(ranks * tokens, K, generator=g)
    shared = torch.randn(ranks * tokens, dim_h, generator=g).to(torch.bfloat16)
    w_gate = (torch.randn(E, I, dim_h, generator=g) * 0.1).to(torch.bfloat16)
    w_up = (torch.randn(E, I, dim_h, generator=g) * 0.1).to(torch.bfloat16)
    w_down = (torch.randn(E, dim_h, I, generator=g) * 0.1).to(torch.bfloat16)
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
    config = MegakernelConfig(comm_programs=2, compute_programs=2, ring_tiles=1, block_m=16, block_n=32)
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
def test_single_rank_call_and_ep_degree_invariance():
    """The one-rank form (tensors, not lists) on all tokens equals virtual EP = 4 on the same tokens."""
    (x, weights, shared), expert_weights = layer_inputs(4, 64, seed=9)
    ids = routing("skewed", 4, seed=10)
    with torch.no_grad():
        single = megakernel_routed_experts(x, weights, ids.to(DEVICE), shared, expert_weights, num_experts=E,
                                           config=SMALL, trap=False)
    raise_on_megakernel_error()
    assert torch.equal(single, megakernel(4, x, weights, ids, shared, expert_weights))


@interpreted
def test_run_to_run_and_epochs_wrap_without_stale_flags():
    """Calls on one workspace advance its epoch (flags never reset); the same call gives the same bits, also across
    the reset at MAX_EPOCH, and a different routing after it is not fooled by flags the earlier call left."""
    (x, weights, shared), expert_weights = layer_inputs(2, 64, seed=11)
    ids, other_ids = routing("skewed", 2, seed=12), routing("balanced", 2)
    first = megakernel(2, x, weights, ids, shared, expert_weights)
    assert torch.equal(megakernel(2, x, weights, ids, shared, expert_weights), first)
    ws = mk._WORKSPACES[(torch.device(DEVICE), 2, T, K, 64, I, E // 2, SMALL)]
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
    if os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.raises(ValueError, match="spin forever"):
            call(serialized=False)


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
    """The concurrent launch's kernel at Kimi K2.7's sizes, compiled for sm_90 on the CPU (titan_mok.bench.sass's
    stand-in driver; the interpreter cannot compile, hence a subprocess): wgmmas, no spill stack, one program per
    SM at least (the occupancy the launch checks)."""
    script = (
        "import json, torch; from benchmarks.tools import sass; from titan_mok.kernels import mok_megakernel as m\n"
        "ptrs = [torch.bfloat16, torch.int64, torch.int64, torch.bfloat16, *[torch.int64] * 4, *[torch.int32] * 3,"
        " *[torch.bfloat16] * 3, torch.int64]\n"
        "ints = [2] * 6 + [0.0] + [2] * 4 + [7168, 2048] + [2] * 3\n"
        "c = dict(PHASE=0, HAS_LIMIT=False, LOG_L=2, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, BLOCK_H=256, DOT_F32=False,"
        " num_warps=8)\n"
        "with sass.compiling_for_sm90():\n"
        "    k = m._megakernel.warmup(*ptrs, *ints, grid=(1,), **c)\n"
        "r = sass.kernel_report('_megakernel', k)\n"
        "print(json.dumps(dict(hgmma=r['opcodes'].get('HGMMA', 0), stack=r['stack_bytes'],"
        " per_sm=sass.programs_per_sm(r))))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    report = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert report["hgmma"] > 0 and report["stack"] == 0 and report["per_sm"] >= 1, report
