"""``[mok] kernels = "megakernel"`` under FSDP2 (2 processes, gloo; Triton's interpreter, the megakernel's serialized
mode): each rank's MoE layer, sharded over both ranks as TorchTitan's trainer shards it (fp32 parameters gathered
in bf16, gradients reduce-scattered in fp32; the routed experts a unit of their own), runs the megakernel on its
own tokens with the gathered weights; in bf16, and with MXFP8 routed experts (the weights gathered as MXFP8,
``titan_mok.moe.mxfp8_fsdp``, as the trainer gathers them); eager, and wrapped for activation checkpointing (the
forward launch run again in the backward). Its output, input gradient and every parameter's
reduce-scattered gradient shard equal, bit for bit, the same layer's with ``kernels = "triton"`` sharded the same
way; each gradient lands as FSDP keeps it, a shard of its parameter's placement. On two GPUs:
test_mok_megakernel_layer_gpu.py."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from tests.spawned_ranks import rank_file, spawn_ranks
from titan_mok.moe import MoE, MoEArgs
from titan_mok.moe import moe as moe_module
from titan_mok.moe.mxfp8_fsdp import gather_as_mxfp8, gather_layouts

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's serialized "
                                "megakernel on CPU tensors; on GPUs see test_mok_megakernel_layer_gpu.py")
WORLD = 2
H, I, E, K, T = 64, 32, 8, 2, 16
KERNELS = ("megakernel", "triton")
PRECISIONS = ("bf16", "mxfp8")


def _sharded(kernels: str, precision: str, checkpointed: bool) -> torch.nn.Module:
    """The layer with fp32 weights drawn from one seed (the same on both ranks and for both kernels), sharded;
    checkpointed: wrapped for activation checkpointing first, as TorchTitan's apply_ac wraps a block."""
    torch.manual_seed(0)
    moe = MoE(MoEArgs(num_experts=E, top_k=K, expert_dim=I, shared_expert_dim=32, kernels=kernels,
                      precision=precision, route_scale=2.5), H)
    moe.init_weights(0.1, torch.device("cpu"))
    with torch.no_grad():  # weights large enough that routing matters
        for p in moe.parameters():
            p.normal_(0, 0.2)
    mesh = init_device_mesh("cpu", (WORLD,))
    if precision == "mxfp8":  # a block's experts, resharded after forward (titan_mok.parallelize's rule)
        gather_as_mxfp8(moe.experts, WORLD, gather_layouts(reshards_after_forward=True,
                                                            recomputes_forward=checkpointed))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(moe.experts, mesh=mesh, mp_policy=policy)
    experts = moe.experts
    if checkpointed:
        moe = checkpoint_wrapper(moe)
    fully_shard(moe, mesh=mesh, mp_policy=policy)
    experts.weights_gathered = True  # as titan_mok.parallelize says after fully_shard
    return moe


def _step(moe: torch.nn.Module, rank: int) -> dict:
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own tokens
    x = torch.randn(1, T, H, generator=g).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(1, T, H, generator=g).to(torch.bfloat16)
    y = moe(x)
    y.backward(dy)
    params = dict(moe.named_parameters())
    grads = {name: p.grad for name, p in params.items() if p.grad is not None}
    placed = {name: isinstance(g, DTensor) and g.placements == params[name].placements
              and g.to_local().shape == params[name].to_local().shape for name, g in grads.items()}
    return {"y": y.detach(), "dx": x.grad, "grads": {name: g.to_local().clone() for name, g in grads.items()},
            "placed": placed}


def _worker(rank: int, out_dir: str) -> None:
    import tests.conftest  # noqa: F401 - a spawned process needs the session's Triton-interpreter shims too

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    moe_module.has_cuda_capability = lambda major, minor: True  # Hopper's check: the interpreter runs the kernels
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    results = {(kernels, precision, checkpointed): _step(_sharded(kernels, precision, checkpointed), rank)
               for kernels in KERNELS for precision in PRECISIONS for checkpointed in (False, True)}
    torch.save(results, rank_file(out_dir, rank))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(_worker, WORLD, str(tmp_path_factory.mktemp("megakernel_fsdp")))


@pytest.mark.parametrize("checkpointed", [False, True], ids=["eager", "checkpointed"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_sharded_layer_equals_the_triton_path_and_its_gradients_land_as_fsdp_keeps_them(results, precision,
                                                                                        checkpointed):
    for rank, result in enumerate(results):
        got, want = result["megakernel", precision, checkpointed], result["triton", precision, checkpointed]
        assert torch.equal(got["y"], want["y"]), (rank, "output")
        assert torch.equal(got["dx"], want["dx"]), (rank, "input gradient")
        assert got["grads"].keys() == want["grads"].keys() and "experts.w_down" in got["grads"], rank
        for name in want["grads"]:
            assert torch.equal(got["grads"][name], want["grads"][name]), (rank, name)
        assert all(got["placed"].values()), (rank, got["placed"])
    # the two ranks' tokens differ, so their outputs do: each rank ran its own rows
    mine = [result["megakernel", precision, checkpointed]["y"] for result in results]
    assert not torch.equal(*mine)
