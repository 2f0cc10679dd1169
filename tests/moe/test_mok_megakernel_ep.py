"""The forward megakernel on a real expert-parallel group, on CPU: two gloo processes, each launching the megakernel
for its own rank only (``first_rank = rank``, ``hosted_ranks = 1``), in Triton's interpreter (serialized mode).

Symmetric memory is a STAND-IN here (tests/shared_file_symmetric.py): each rank's workspace allocation is a file
mapped shared into both processes, its peer tables hold this process's mappings' addresses of every rank's file,
and the workspace's barrier is a gloo barrier. So the kernels really load and store the other process's memory
(pulled rows, pushed rows, the arrival counters' atomics, the gathered ids) through peer tables, and the host
wiring runs as on GPUs: the collective workspace allocation and its address tables, the ids gather, each rank's
own schedule, the per-workspace epoch that both ranks count alike with no exchange (forward and dgrad launches),
the finishes' running total of arrivals, the epoch restart between barriers, the backward's dgrad launch across
the two ranks. Compared bit for bit (torch.equal):
- the routed output at EP = 2 equals the ``"triton"`` path's at EP = 1 on both ranks' tokens (so it does not depend
  on P), for balanced, skewed, single-expert and all-remote routing, run to run, across the epoch restart; a stalled
  peer is a named error on both ranks, after which both restart and compute the same bits again;
- every gradient of the routed experts and combine (x, the combine weights, the shared output, the rank's expert
  weights) equals the ``"triton"`` path's at EP = 2, with every row remote (bf16 and MXFP8) and with every row on
  rank 0's experts (rank 1's dgrad launch has no tile), through one dgrad launch per backward, also right after the
  epochs' restart;
- the MoE layer with ``kernels = "megakernel"`` at EP = 2 equals ``kernels = "triton"`` at EP = 2 (the fused path
  over the same stand-in): output, input gradient and every parameter's gradient, run to run; its output and input
  gradient equal the megakernel layer's at EP = 1 on the concatenated batch; and under FSDP as the trainer shards
  it on two ranks (experts over the one-rank "efsdp" dim, the layer over both), in bf16 and with the MXFP8 experts'
  weights gathered as MXFP8, every gradient shard too.
What it does not prove: anything of the GPU: symmetric memory over NVLink, the concurrent launch's spinning waits
and their memory ordering between devices, co-residency, the device barrier, timings, host-sync freedom
(test_mok_megakernel_layer_gpu.py's two-GPU tests).
"""

import datetime
import itertools
import os

import pytest
import torch
import torch.distributed as dist

from tests.kernels.test_mok_megakernel import SMALL, E, K, T, layer_inputs, routing, triton_path
from tests.spawned_ranks import rank_file, spawn_ranks

WORLD = 2
KINDS = ("balanced", "skewed", "one_expert", "all_remote")
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's serialized "
                                 "megakernel on CPU tensors; on GPUs see test_mok_megakernel_layer_gpu.py")


def _rank_slice(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t.chunk(WORLD)[rank]


def _routed_calls(rank: int) -> dict:
    """The megakernel of this rank on its T tokens and its E / 2 experts (the inputs of test_mok_megakernel.py)."""
    from titan_mok.kernels.mok_megakernel import MAX_EPOCH
    from titan_mok.moe.megakernel_rank import (
        _WORKSPACES,
        megakernel_rank_routed_experts,
        raise_on_megakernel_rank_error,
    )

    (x, weights, shared), expert_weights = layer_inputs(WORLD, 64)
    local = tuple(_rank_slice(w, rank).contiguous() for w in expert_weights)

    def call(ids, **kw):
        with torch.no_grad():
            return megakernel_rank_routed_experts(
                _rank_slice(x, rank), _rank_slice(weights, rank), _rank_slice(ids, rank), _rank_slice(shared, rank),
                local, num_experts=E, group=dist.group.WORLD, config=SMALL, trap=False, **kw)

    results = {}
    for kind in KINDS:
        ids = routing(kind, WORLD, seed=3)
        results[kind] = [call(ids) for _ in range(2)]  # the second: a new epoch, no flag reset
    raise_on_megakernel_rank_error()
    (ws,) = _WORKSPACES.values()
    results["epoch_before_restart"] = ws.group_ws.megakernel_calls.epoch
    ws.group_ws.megakernel_calls.epoch = MAX_EPOCH  # every rank: the next call restarts between two barriers
    results["after_restart"] = call(routing("skewed", WORLD, seed=3))
    results["epoch_after_restart"] = ws.group_ws.megakernel_calls.epoch
    call(routing("balanced", WORLD, seed=3), stall_rank=1)
    try:
        raise_on_megakernel_rank_error()  # each rank names its own wait; both restart here, at the same call
        results["stall"] = "no error"
    except RuntimeError as e:
        results["stall"] = str(e)
    results["after_stall"] = call(routing("balanced", WORLD, seed=3))
    return results


GRADIENT_CASES = {  # routing, with the shared output, SwiGLU clamp, the routed experts' precision
    "all_remote_shared_clamped": ("all_remote", True, 0.5, "bf16"),  # every row crosses to the other rank and back
    "rank_0_only": ("one_expert", False, None, "bf16"),  # all rows to rank 0's experts: rank 1's launch has no tile
    "mxfp8_all_remote_shared_clamped": ("all_remote", True, 0.5, "mxfp8"),  # both launches' MX variants
}


def _routed_gradient_runs(rank: int) -> dict:
    """Every gradient of this rank's routed experts and combine at EP = 2, the ``"triton"`` path's and the
    megakernel's (test_mok_megakernel_autograd.py's inputs, at H = I = 32), and the megakernel calls each made."""
    from tests.moe.test_mok_megakernel_autograd import H, routed_gradients
    from titan_mok.kernels.mok_megakernel import MAX_EPOCH
    from titan_mok.moe.workspace import get_workspace

    (x, weights, shared), expert_weights = layer_inputs(WORLD, H, seed=3, dim_i=32)
    local = tuple(_rank_slice(w, rank).contiguous() for w in expert_weights)
    dout = _rank_slice(torch.randn(WORLD * T, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16), rank)
    calls = get_workspace(dist.group.WORLD, T, K, H, torch.bfloat16, x.device).megakernel_calls
    results, case_args = {}, {}
    for case, (kind, with_shared, limit, precision) in GRADIENT_CASES.items():
        ids = _rank_slice(routing(kind, WORLD, seed=5), rank)
        args = case_args[case] = (_rank_slice(x, rank), _rank_slice(weights, rank), ids,
                                  _rank_slice(shared, rank) if with_shared else None, local, dout)
        for kernels in ("triton", "megakernel"):
            if (case, kernels) == ("rank_0_only", "megakernel"):
                calls.epoch = MAX_EPOCH  # every rank: the forward restarts the epochs (both launches' flags zeroed)
            epoch = calls.epoch
            results[case, kernels] = routed_gradients(kernels, *args, group=dist.group.WORLD, swiglu_limit=limit,
                                                      precision=precision)
            results[case, kernels, "epochs"] = epoch, calls.epoch
    # every row remote: each rank's launch has tiles (rank 1's pulled from rank 0, which publishes)
    remote = "all_remote_shared_clamped"
    results["stall"] = _stalled_dgrad(case_args[remote])
    results["after_stall"] = routed_gradients("megakernel", *case_args[remote], group=dist.group.WORLD,
                                              swiglu_limit=GRADIENT_CASES[remote][2])
    return results


def _stalled_dgrad(args) -> str:
    """The dgrad launch with rank 1 publishing nothing, on a forward call's schedule: the wait's words (each rank
    names its own; both restart their epochs there)."""
    from titan_mok.kernels.grouped_gemm import grouped_gate_up_swiglu
    from titan_mok.moe.fused import fused_dispatch
    from titan_mok.moe.megakernel_rank import (
        megakernel_rank_dgrad,
        megakernel_rank_forward,
        raise_on_megakernel_rank_error,
    )

    x, weights, ids, shared, local, dout = args
    with torch.no_grad():
        _, handle, _ = megakernel_rank_forward(x, weights, ids, shared, local, num_experts=E,
                                               group=dist.group.WORLD, config=SMALL)
        gate, up, _ = grouped_gate_up_swiglu(fused_dispatch(x, handle), handle.group_end, *local[:2], None)
        megakernel_rank_dgrad(dout, weights, gate, up, local, handle, num_experts=E, group=dist.group.WORLD,
                              config=SMALL, trap=False, stall_rank=1)
    try:
        raise_on_megakernel_rank_error()
        return "no error"
    except RuntimeError as e:
        return str(e)


def _layer_runs(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from tests.moe.test_mok_megakernel_layer import _inputs, _layer, run_layers
    from titan_mok.moe.expert_parallel import MokExpertParallel

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    x, dy = (t[:, rank * T:(rank + 1) * T] for t in _inputs(tokens=WORLD * T, seed=4))  # [1, T, H]
    results = {}
    for kernels in ("triton", "megakernel"):
        layer = _layer(kernels, seed=5)
        parallelize_module(layer.experts, mesh, MokExpertParallel())
        runs = []
        for _ in range(2):
            y, dx, grads = run_layers([layer], x, dy)
            runs.append((y, dx, {key: g.to_local() if hasattr(g, "to_local") else g for key, g in grads.items()}))
        results[kernels] = runs
        results[kernels, "rows_computed"] = layer.experts.rows_computed.item()
    return results


def _layer_runs_under_fsdp(rank: int) -> dict:
    """The layer at EP = 2 under FSDP2 as the trainer shards it on two ranks: the experts (EP's Shard(0) DTensors on
    the "ep" dim) fully sharded over the one-rank "efsdp" dim of the same mesh, the layer over both ranks; bf16
    gathers, fp32 reduce-scatters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from tests.moe.test_mok_megakernel_layer import _inputs, _layer, run_layers
    from titan_mok.moe.expert_parallel import MokExpertParallel
    from titan_mok.moe.mxfp8_fsdp import gather_as_mxfp8, gather_layouts

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("efsdp", "ep"))
    dp_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    x, dy = (t[:, rank * T:(rank + 1) * T] for t in _inputs(tokens=WORLD * T, seed=6))  # [1, T, H]
    results = {}
    for kernels, precision in itertools.product(("triton", "megakernel"), ("bf16", "mxfp8")):
        layer = _layer(kernels, seed=7, precision=precision)
        parallelize_module(layer.experts, mesh["ep"], MokExpertParallel())
        if precision == "mxfp8":  # gathered as MXFP8 over the one-rank dim (titan_mok.parallelize)
            gather_as_mxfp8(layer.experts, 1, gather_layouts(True, recomputes_forward=False))
        fully_shard(layer.experts, mesh=mesh["efsdp"], mp_policy=policy)
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
        layer.experts.weights_gathered = True  # as titan_mok.parallelize says after fully_shard
        y, dx, grads = run_layers([layer], x, dy)
        results[kernels, precision] = (y, dx, {key: g.to_local() for key, g in grads.items()})
    return results


def _worker(rank: int, out_dir: str) -> None:
    import tests.conftest  # noqa: F401 - a spawned process needs the session's Triton-interpreter shims too
    from tests.shared_file_symmetric import shared_file_allocator
    from titan_mok.moe import moe as moe_module
    from titan_mok.moe import workspace

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    workspace.SYMMETRIC_ALLOCATORS["cpu"] = shared_file_allocator(out_dir)  # the stand-in (module docstring)
    moe_module.has_cuda_capability = lambda major, minor: True  # the interpreter runs the Hopper kernels here
    results = {"routed": _routed_calls(rank), "layer": _layer_runs(rank), "gradients": _routed_gradient_runs(rank),
               "layer_fsdp": _layer_runs_under_fsdp(rank)}
    torch.save(results, rank_file(out_dir, rank))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory):
    return spawn_ranks(_worker, WORLD, str(tmp_path_factory.mktemp("megakernel_ep")))


@interpreted
def test_routed_output_equals_the_triton_path_at_ep_1(ep_results):
    (x, weights, shared), expert_weights = layer_inputs(WORLD, 64)
    for kind in KINDS:
        want = triton_path(x, weights, routing(kind, WORLD, seed=3), shared, expert_weights)
        for rank, results in enumerate(ep_results):
            first, second = results["routed"][kind]
            assert torch.equal(first, _rank_slice(want, rank)), (kind, rank)
            assert torch.equal(second, first), (kind, rank, "run to run")


@interpreted
def test_epochs_restart_together_and_a_stalled_peer_is_named_on_both_ranks(ep_results):
    (x, weights, shared), expert_weights = layer_inputs(WORLD, 64)
    skewed = triton_path(x, weights, routing("skewed", WORLD, seed=3), shared, expert_weights)
    balanced = triton_path(x, weights, routing("balanced", WORLD, seed=3), shared, expert_weights)
    for rank, results in enumerate(ep_results):
        routed = results["routed"]
        assert routed["epoch_before_restart"] == 2 * len(KINDS)  # one epoch per call, counted alike on both ranks
        assert routed["epoch_after_restart"] == 1
        assert torch.equal(routed["after_restart"], _rank_slice(skewed, rank))
        assert torch.equal(routed["after_stall"], _rank_slice(balanced, rank))
    # rank 0 waited for rank 1's x_ready; rank 1 published nothing, so its own ring tiles were never pulled
    assert "x_ready: rank 0's communication program waited for rank 1 " in ep_results[0]["routed"]["stall"]
    assert "ring ready: rank 1's compute program waited for ring tile" in ep_results[1]["routed"]["stall"]


@pytest.mark.parametrize("case", list(GRADIENT_CASES))
@interpreted
def test_every_gradient_equals_the_triton_path_at_ep_2(ep_results, case):
    """Each rank's gradients of x, the combine weights, the shared output and its experts' weights through the
    dgrad launch (two megakernel calls: the forward's and the dgrad's, no recomputed forward), also right after
    the epochs' restart."""
    from tests.moe.test_mok_megakernel_autograd import assert_same_gradients

    for rank, results in enumerate(ep_results):
        got, want = results["gradients"][case, "megakernel"], results["gradients"][case, "triton"]
        assert_same_gradients(got, want, (case, rank))
        before, after = results["gradients"][case, "megakernel", "epochs"]
        # one forward and one dgrad launch; the second case after the epochs' restart (the count starts over at 1)
        assert after == (2 if case == "rank_0_only" else before + 2), (case, rank)
        assert len(set(results["gradients"][case, "triton", "epochs"])) == 1, (case, rank)


@interpreted
def test_a_stalled_peer_in_the_dgrad_launch_is_named_on_both_ranks_then_both_recover(ep_results):
    from tests.moe.test_mok_megakernel_autograd import assert_same_gradients

    # rank 0 waited for rank 1's dy_ready; rank 1's communication programs (stalled) pulled none of its ring tiles
    assert "backward: timed out: dy_ready: rank 0's communication program waited for rank 1 " in (
        ep_results[0]["gradients"]["stall"])
    assert "backward: timed out: ring ready: rank 1's compute program waited for ring tile" in (
        ep_results[1]["gradients"]["stall"])
    for rank, results in enumerate(ep_results):
        want = results["gradients"]["all_remote_shared_clamped", "triton"]
        assert_same_gradients(results["gradients"]["after_stall"], want, rank)


@interpreted
def test_layer_equals_the_triton_path_at_ep_2_and_does_not_depend_on_p(ep_results):
    from tests.moe.test_mok_megakernel_layer import _inputs, _layer, run_layers
    from titan_mok.moe import moe as moe_module

    for rank, results in enumerate(ep_results):
        layer = results["layer"]
        for (y, dx, grads), (y_want, dx_want, grads_want) in zip(layer["megakernel"], layer["triton"]):
            assert torch.equal(y, y_want) and torch.equal(dx, dx_want), rank
            assert grads.keys() == grads_want.keys() and (0, "experts.w_down") in grads
            for key in grads_want:
                assert torch.equal(grads[key], grads_want[key]), (rank, key)
        (y, dx, grads), (y2, dx2, grads2) = layer["megakernel"]
        assert torch.equal(y, y2) and torch.equal(dx, dx2) and all(torch.equal(grads[k], grads2[k]) for k in grads)
        assert layer["megakernel", "rows_computed"] == layer["triton", "rows_computed"]
    assert sum(r["layer"]["megakernel", "rows_computed"] for r in ep_results) == 2 * WORLD * T * K  # dropless
    hopper, moe_module.has_cuda_capability = moe_module.has_cuda_capability, lambda major, minor: True
    try:
        x, dy = _inputs(tokens=WORLD * T, seed=4)
        y_one, dx_one, _ = run_layers([_layer("megakernel", seed=5)], x, dy)  # EP = 1 on the concatenated batch
    finally:
        moe_module.has_cuda_capability = hopper
    for rank, results in enumerate(ep_results):
        y, dx, _ = results["layer"]["megakernel"][0]
        assert torch.equal(y, y_one[:, rank * T:(rank + 1) * T]) and torch.equal(dx, dx_one[:, rank * T:(rank + 1) * T])


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@interpreted
def test_layer_at_ep_2_under_fsdp_equals_the_triton_path(ep_results, precision):
    """EP = 2 under FSDP (the trainer's sharding on two ranks; MXFP8: the experts' weights gathered as MXFP8): the
    megakernel layer's output, input gradient and every reduce-scattered gradient shard equal the ``"triton"``
    path's, bit for bit."""
    for rank, results in enumerate(ep_results):
        (y, dx, grads), (y_want, dx_want, grads_want) = (results["layer_fsdp"][k, precision]
                                                         for k in ("megakernel", "triton"))
        assert torch.equal(y, y_want) and torch.equal(dx, dx_want), rank
        assert grads.keys() == grads_want.keys() and (0, "experts.w_down") in grads
        for key in grads_want:
            assert torch.equal(grads[key], grads_want[key]), (rank, key)
