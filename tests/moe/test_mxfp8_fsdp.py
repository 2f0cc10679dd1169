"""FSDP2 all-gathers mxfp8 routed-expert weights as MXFP8 (titan_mok.moe.mxfp8_fsdp): 2 processes, gloo.

Two processes are spawned once for the module; each scenario shards a RoutedExperts over them (FSDP's
bf16 param dtype, fp32 reduce), runs forward and backward on the same rows on both ranks (so FSDP's
averaged gradient is each rank's gradient, exactly) and saves what it saw; the tests compare it here with
the unsharded module.

Claims: the MXFP8 operands the expert FFN reads equal, bit for bit, the MXFP8 of the gathered bf16 weights
(``weight_operand`` of the full parameter cast to bf16), in the forward and in the backward; outputs, input
gradients and weight gradients equal the unsharded module's bit for bit (reference and Triton kernels);
training steps with gradient accumulation quantize each rank's shard once per optimizer step per layout and
end on the unsharded run's weights; a write to the weights (announced, or through the parameter) is gathered
fresh; each all-gather moves (1 + 1/32) / 2 of the bf16 bytes when the forward
and the backward gather one layout each, (1 + 1/32) when one gather serves both; a one-rank shard group
(EP over every rank) gathers its packed operands; the state dict and checkpoints hold plain tensors.
"""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
from torch.distributed.tensor import DTensor

from tests.spawned_ranks import rank_file, spawn_ranks
from titan_mok.kernels import weight_cache
from titan_mok.kernels.grouped_ffn import interpreting, weight_operand
from titan_mok.kernels.mxfp8_gathered import MXFP8GatheredWeight
from titan_mok.moe import mxfp8_fsdp
from titan_mok.moe.args import MoEArgs
from titan_mok.moe.experts import RoutedExperts

WORLD = 2
E, H, I = 4, 64, 96
GROUP_END = [5, 5, 19, 26]  # expert 1 gets no rows; 3 padding rows follow
ROWS = 29
NAMES = ("w_gate", "w_up", "w_down")
STEPS, MICROBATCHES = 2, 2
ONE_LAYOUT = mxfp8_fsdp.gather_layouts(reshards_after_forward=True, recomputes_forward=False)
BOTH_LAYOUTS = mxfp8_fsdp.gather_layouts(reshards_after_forward=False, recomputes_forward=False)
# CPU tensors everywhere: the Triton kernels run only in Triton's interpreter (without CUDA; on a GPU
# machine the rest still checks FSDP's extension points in that machine's torch)
INTERPRETING = interpreting()
SCENARIOS = {
    # name: (kernels, reshard after forward, shard ranks)
    "one_layout": ("reference", True, WORLD),
    "both_layouts": ("reference", False, WORLD),
    **({"triton": ("triton", True, WORLD)} if INTERPRETING else {}),
    "one_rank_group": ("reference", True, 1),
}


class _Layer(nn.Module):
    """The experts under an FSDP root, as in a model (FSDP never reshards its root after forward)."""

    def __init__(self, precision: str, kernels: str):
        super().__init__()
        args = MoEArgs(num_experts=E, expert_dim=I, precision=precision, kernels=kernels)
        self.experts = RoutedExperts(H, args, use_triton=kernels == "triton")

    def forward(self, x_RH, group_end_E):
        return self.experts(x_RH, group_end_E)


def _rows(step: int = 0, micro: int = 0):
    g = torch.Generator().manual_seed(100 + 10 * step + micro)
    x = torch.randn(ROWS, H, generator=g).bfloat16()
    dy = torch.randn(ROWS, H, generator=g).bfloat16()
    return x, dy, torch.tensor(GROUP_END)


def _initialized(layer: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        layer.experts.init_weights(0.02)
        for w in layer.experts.parameters():
            w.mul_(10.0)  # larger than init: the E8M0 scales differ across blocks
    return layer


def unsharded(kernels: str = "reference") -> _Layer:
    """The module every scenario is compared with: fp32 parameters cast to bf16 in its forward."""
    return _initialized(_Layer("mxfp8", kernels))


def _sharded(kernels: str, reshard: bool, shard_ranks: int, precision: str = "mxfp8"):
    with torch.device("meta"):
        layer = _Layer(precision, kernels)
    mesh = init_device_mesh("cpu", (WORLD // shard_ranks, shard_ranks), mesh_dim_names=("rep", "shard"))["shard"]
    if precision == "mxfp8":
        mxfp8_fsdp.gather_as_mxfp8(layer.experts, shard_ranks, ONE_LAYOUT if reshard else BOTH_LAYOUTS)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(layer.experts, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(layer, mesh=mesh, mp_policy=policy)
    layer.experts.weights_gathered = True
    layer.to_empty(device="cpu")  # TorchTitan builds on meta, then materializes and initializes
    with torch.no_grad():  # each rank's shard of the unsharded module's weights
        for name, w in unsharded().named_parameters():
            shard = getattr(layer.experts, name.split(".")[-1])
            mesh = shard.device_mesh
            shard.to_local().copy_(w.chunk(mesh.size(), dim=0)[mesh.get_local_rank()])
    return layer


class _CountingAllGather(AllGather):
    """FSDP's all-gather, recording the bytes each call sends from this rank."""

    def __init__(self):
        self.sent = []

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.sent.append(input_tensor.numel() * input_tensor.element_size())
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _record_operands(seen: list):
    """Patches MXFP8GatheredWeight.operand to record (pass, weight, along, data bits, scale bits) per read."""
    read = MXFP8GatheredWeight.operand

    def recorded(self, along, name):
        op = read(self, along, name)
        in_backward = torch._C._current_graph_task_id() != -1
        seen.append(("backward" if in_backward else "forward", name, along, op.data.view(torch.uint8).clone(),
                     op.scale.view(torch.uint8).clone()))
        return op

    MXFP8GatheredWeight.operand = recorded
    return read


def _step_results(layer) -> dict:
    """One forward and backward: outputs, gradients (full), the full weights and what the FFN read."""
    x, dy, group_end = _rows()
    x.requires_grad_(True)
    seen = []
    read = _record_operands(seen)
    try:
        y = layer(x, group_end)
        y.backward(dy)
    finally:
        MXFP8GatheredWeight.operand = read
    return {"y": y.detach(), "dx": x.grad, "seen": seen,
            "grads": {n: getattr(layer.experts, n).grad.full_tensor() for n in NAMES},
            "weights": {n: getattr(layer.experts, n).full_tensor() for n in NAMES}}


_PHASE = ["pass"]  # where a quantization runs: "pass" (a forward or backward) or "step" (the optimizer's)


def _train(layer) -> dict:
    """STEPS fused AdamW steps of MICROBATCHES microbatches, the trainers' post-hook registered."""
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
    optimizer.register_step_post_hook(weight_cache.step_post_hook(layer))
    outputs = []
    for step in range(STEPS):
        for micro in range(MICROBATCHES):
            x, dy, group_end = _rows(step, micro)
            y = layer(x, group_end)
            y.backward(dy)
            outputs.append(y.detach())
        _PHASE[0] = "step"
        optimizer.step()
        _PHASE[0] = "pass"
        optimizer.zero_grad()
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for n, p in layer.named_parameters()}
    return {"outputs": outputs, "weights": full}


def _expect_error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _worker(rank: int, out_dir: str) -> None:
    import tests.conftest  # noqa: F401 - a spawned process needs the session's Triton-interpreter shims too

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    results = {}
    for name, (kernels, reshard, shard_ranks) in SCENARIOS.items():
        results[name] = _step_results(_sharded(kernels, reshard, shard_ranks))

    for precision, reshard in (("mxfp8", True), ("mxfp8", False), ("bf16", True)):
        layer = _sharded("reference", reshard, WORLD, precision)
        counter = _CountingAllGather()
        layer.experts.set_custom_all_gather(counter)
        _step_results(layer)
        results["sent", precision, reshard] = counter.sent

    made = []
    packed = mxfp8_fsdp._packed_operands
    mxfp8_fsdp._packed_operands = lambda w, layouts, name: (made.append((name, layouts, _PHASE[0]))
                                                             or packed(w, layouts, name))
    results["train"] = _train(_sharded("reference", True, WORLD))
    mxfp8_fsdp._packed_operands = packed
    results["quantized"] = made

    layer = _sharded("reference", True, WORLD)
    _step_results(layer)  # the MXFP8 copies of the initial weights are kept
    state = layer.state_dict()
    results["state_types"] = {k: type(v.to_local()).__name__ for k, v in state.items()}
    with torch.no_grad():
        state["experts.w_up"].mul_(2.0)  # as a checkpoint load or the RL reference swap write, then say so
    weight_cache.weights_written()
    results["after_state_write"] = _step_results(layer)
    with torch.no_grad():
        layer.experts.w_gate.mul_(0.5)  # an in-place write through the parameter: no call needed
    results["after_param_write"] = _step_results(layer)
    results["errors"] = {
        "uneven": _expect_error(lambda: mxfp8_fsdp.gather_as_mxfp8(
            RoutedExperts(H, MoEArgs(num_experts=3, expert_dim=I, precision="mxfp8"), use_triton=False), 2,
            ONE_LAYOUT)),
        # one layout per gather, but FSDP keeps the forward's gather for the backward: refused when read
        "no_regather": _expect_error(lambda: _step_results(_one_layout_never_regathered())),
    }
    torch.save(results, rank_file(out_dir, rank))
    dist.destroy_process_group()


def _one_layout_never_regathered():
    layer = _sharded("reference", True, WORLD)
    layer.experts.set_reshard_after_forward(False)
    return layer


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(_worker, WORLD, str(tmp_path_factory.mktemp("mxfp8_fsdp")))


def _unsharded_step(kernels: str) -> dict:
    layer = unsharded(kernels)
    x, dy, group_end = _rows()
    x.requires_grad_(True)
    y = layer(x, group_end)
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "grads": {n: getattr(layer.experts, n).grad for n in NAMES},
            "weights": {n: getattr(layer.experts, n).detach() for n in NAMES}}


def _assert_read_the_mxfp8_of(got: dict, weights: dict, rank: int) -> None:
    """Every operand the FFN read is weight_operand (the Triton quantizer, in the interpreter; the shards were
    quantized by the reference) of the full weight cast to bf16; the forward read the forward layouts and the
    backward the dgrad layouts, each weight's both."""
    reads = {(p, name.rsplit("_", 1)[0], along) for p, name, along, _, _ in got["seen"]}
    assert reads == {(p, w, along) for p, along in (("forward", 2), ("backward", 1)) for w in NAMES}, reads
    for _, name, along, data, scale in got["seen"]:
        weight = weights[name.rsplit("_", 1)[0]]
        assert torch.equal(got["weights"][name.rsplit("_", 1)[0]], weight), f"rank {rank} {name}: other weights"
        want = weight_operand(weight.to(torch.bfloat16), "mxfp8", along, name, reference=not INTERPRETING)
        assert torch.equal(data, want.data.view(torch.uint8)), f"rank {rank} {name} along {along}: data"
        assert torch.equal(scale, want.scale.view(torch.uint8)), f"rank {rank} {name} along {along}: scales"


def _unsharded_weights() -> dict:
    return {n: getattr(unsharded().experts, n).detach() for n in NAMES}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_gathered_mxfp8_is_the_mxfp8_of_the_gathered_bf16(results, scenario):
    for rank in range(WORLD):
        _assert_read_the_mxfp8_of(results[rank][scenario], _unsharded_weights(), rank)


def test_written_weights_are_gathered_fresh(results):
    """After a write through the state dict's tensors and ``weights_written`` (a checkpoint load, the RL
    reference swap), and after an in-place write through the parameter, the next pass reads the MXFP8 of
    the new weights, not the copies kept before."""
    weights = _unsharded_weights()
    weights["w_up"] = 2.0 * weights["w_up"]
    for rank in range(WORLD):
        _assert_read_the_mxfp8_of(results[rank]["after_state_write"], weights, rank)
    weights["w_gate"] = 0.5 * weights["w_gate"]
    for rank in range(WORLD):
        _assert_read_the_mxfp8_of(results[rank]["after_param_write"], weights, rank)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_outputs_and_gradients_equal_the_unsharded_module(results, scenario):
    kernels = SCENARIOS[scenario][0]
    want = _unsharded_step(kernels)
    for rank in range(WORLD):
        got = results[rank][scenario]
        assert torch.equal(got["y"], want["y"]), f"rank {rank}: forward"
        assert torch.equal(got["dx"], want["dx"]), f"rank {rank}: input gradient"
        for name in NAMES:
            assert want["grads"][name].abs().sum() > 0
            assert torch.equal(got["grads"][name], want["grads"][name]), f"rank {rank}: {name} gradient"


def test_training_quantizes_each_shard_in_each_step_and_ends_on_the_unsharded_weights(results):
    layer = unsharded()
    want = _train(layer)
    for rank in range(WORLD):
        got = results[rank]["train"]
        for i, (a, b) in enumerate(zip(got["outputs"], want["outputs"])):
            assert torch.equal(a, b), f"rank {rank}: microbatch {i} output"
        for name in want["weights"]:
            assert torch.equal(got["weights"][name], want["weights"][name]), f"rank {rank}: {name} after training"
        # each weight's forward and dgrad layouts: at their first gathers, then once in each optimizer step and
        # never again in a forward or backward
        layouts = [(n, layouts) for n in NAMES for layouts in ((2,), (1,))]
        want_made = [(*nl, "pass") for nl in layouts] + [(*nl, "step") for nl in layouts] * STEPS
        assert sorted(results[rank]["quantized"]) == sorted(want_made), results[rank]["quantized"]


def test_all_gather_moves_mxfp8_bytes(results):
    numel = E * H * I  # per weight: w_gate, w_up [E, I, H], w_down [E, H, I]
    shard_bf16_bytes = 3 * numel * 2 // WORLD
    for rank in range(WORLD):
        bf16 = results[rank]["sent", "bf16", True]
        one = results[rank]["sent", "mxfp8", True]
        both = results[rank]["sent", "mxfp8", False]
        assert bf16 == [shard_bf16_bytes] * 2, bf16  # the forward's and the backward's all-gather
        assert len(one) == 2 and all(sent * 64 == bf16[0] * 33 for sent in one), (one, bf16)  # (1 + 1/32) / 2
        assert len(both) == 1 and both[0] * 32 == bf16[0] * 33, (both, bf16)  # (1 + 1/32), once per step


def test_state_dict_holds_plain_shards(results):
    for rank in range(WORLD):
        assert set(results[rank]["state_types"].values()) == {"Tensor"}, results[rank]["state_types"]


def test_bad_setups_raise_clear_errors(results):
    for rank in range(WORLD):
        errors = results[rank]["errors"]
        uneven, no_regather = errors["uneven"], errors["no_regather"]
        assert uneven.startswith("ValueError") and "3 experts held per EP rank must split evenly over the 2 " \
            "ranks" in uneven, uneven
        assert no_regather.startswith("RuntimeError") and "w_down_EHI: the dgrad GEMMs need the MXFP8 layout " \
            "along dim 1, but this all-gather brought only: forward" in no_regather, no_regather
