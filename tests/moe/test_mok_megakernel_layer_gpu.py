"""``[mok] kernels = "megakernel"`` on one GPU, against ``kernels = "triton"``, bit for bit (torch.equal, or equal
floats from the runs' metrics.jsonl):
- the MoE layer's output, input gradient and every parameter gradient (bf16 activations from fp32 master weights;
  and under autocast with a gated shared expert and the SwiGLU clamp), run to run, with activation checkpointing and
  two layers sharing the megakernel's workspace; ``kernels = "auto"`` takes the fused path and equals "triton";
- the routed path (forward and backward) does no host sync;
- training steps of the Kimi K2.7 Code debug flavor (one GPU, AMP, full activation checkpointing; and on two GPUs
  under FSDP, EP degree 1, whose hooks gather the experts' weights for the megakernel): every step's loss,
  gradient norm and loss checksum; no token dropped.
The megakernel row of ``bench.layer``: tests/moe/test_bench_layer.py::test_full_kimi_layer_on_gpu.
CPU (the interpreter's serialized megakernel): test_mok_megakernel_layer.py.
"""

import json

import pytest
import torch

from tests import torchrun
from tests.cuda_sync import run_without_host_sync
from tests.moe.test_mok_megakernel_layer import run_layers
from titan_mok.moe import MoE, MoEArgs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, I, E, K, T = 512, 256, 16, 4, 384
CASES = {
    "bf16": dict(amp=False, args=dict(route_scale=2.5)),
    "amp_gated_clamped": dict(amp=True, args=dict(score_func="softmax", use_expert_bias=False,
                                                  load_balance_coeff=None, shared_expert_gate=True,
                                                  swiglu_limit=0.5, shared_expert_swiglu_limit=0.5)),
}


def _layer(kernels: str, case: str = "bf16", seed: int = 1234) -> MoE:
    torch.manual_seed(seed)
    args = MoEArgs(num_experts=E, top_k=K, expert_dim=I, shared_expert_dim=I, kernels=kernels, **CASES[case]["args"])
    moe = MoE(args, H).cuda()  # fp32 master weights
    moe.init_weights(0.02, torch.device("cuda"))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.05)
        moe.expert_bias.normal_(0, 0.1)
    return moe


def _inputs(case: str = "bf16", seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if CASES[case]["amp"] else torch.bfloat16
    return tuple(torch.randn(1, T, H, generator=g).to(dtype).cuda() for _ in range(2))


def _assert_bitwise(got, want, what: str):
    (y, dx, grads), (y_want, dx_want, grads_want) = got, want
    assert torch.equal(y, y_want), f"{what}: output"
    assert torch.equal(dx, dx_want), f"{what}: input gradient"
    assert grads.keys() == grads_want.keys() and any(name == "experts.w_down" for _, name in grads), what
    for key in grads_want:
        assert torch.equal(grads[key], grads_want[key]), f"{what}: gradient of {key}"


@pytest.mark.parametrize("case", list(CASES))
def test_layer_equals_the_triton_path_and_auto_is_the_triton_path(case):
    x, dy = _inputs(case)
    want = run_layers([_layer("triton", case)], x, dy, CASES[case]["amp"])
    mega = _layer("megakernel", case)
    got = run_layers([mega], x, dy, CASES[case]["amp"])
    _assert_bitwise(got, want, "megakernel")
    _assert_bitwise(run_layers([mega], x, dy, CASES[case]["amp"]), got, "megakernel run to run")
    assert mega.experts.rows_computed.item() == 2 * T * K  # two forwards, every slot computed
    auto = _layer("auto", case)
    assert auto._schedule(x[0]) == "fused"
    _assert_bitwise(run_layers([auto], x, dy, CASES[case]["amp"]), want, "auto")


def test_activation_checkpointing_and_layers_sharing_the_workspace():
    x, dy = _inputs(seed=8)
    want = run_layers([_layer("triton", seed=1), _layer("triton", seed=2)], x, dy)
    mega = [_layer("megakernel", seed=1), _layer("megakernel", seed=2)]
    _assert_bitwise(run_layers(mega, x, dy, checkpointed=True), want, "checkpointed")
    _assert_bitwise(run_layers(mega, x, dy), want, "two layers")


def test_routed_path_has_no_host_sync():
    moe = _layer("megakernel")
    x, dy = _inputs(seed=9)
    x_TH = x[0].clone().requires_grad_()
    weights_TK = torch.rand(T, K, device="cuda", requires_grad=True)
    topk_idx_TK = torch.rand(T, E, device="cuda").argsort(dim=1)[:, :K]
    shared_TH = torch.randn(T, H, device="cuda").to(torch.bfloat16).requires_grad_()

    def step():
        moe.routed(x_TH, weights_TK, topk_idx_TK, shared_TH, None, torch.bfloat16).backward(dy[0])

    step()  # compile the kernels and allocate the workspace
    run_without_host_sync(step)


def _train(folder, kernels: str, nproc: int) -> list[dict]:
    torchrun.run("titan_mok.train", "train_configs/kimi_k2_7_code/debug.toml", "--training.steps", "4",
                 "--parallelism.expert_parallel_degree", "1", "--training.mixed_precision_param", "bfloat16",
                 "--activation_checkpoint.mode", "full", "--metrics.log_freq", "1", "--mok.kernels", kernels,
                 "--job.dump_folder", str(folder), nproc=nproc, timeout=600)
    (jsonl,) = folder.glob("tb/*/metrics.jsonl")
    return [json.loads(line) for line in jsonl.read_text().splitlines()[1:]]


def _assert_same_steps(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for mine, theirs in zip(got, want):
        for key in ("loss_metrics/global_avg_loss", "grad_norm", "determinism/loss_checksum"):
            assert mine["metrics"][key] == theirs["metrics"][key], (mine["step"], key)
        assert mine["metrics"]["moe/tokens_dropped"] == 0


def test_kimi_debug_training_steps_equal_the_triton_path(tmp_path):
    """One GPU: no FSDP, TorchTitan's AMP (autocast to bf16 over fp32 weights)."""
    _assert_same_steps(_train(tmp_path / "megakernel", "megakernel", 1), _train(tmp_path / "triton", "triton", 1))


@pytest.mark.two_gpus
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_kimi_debug_training_steps_under_fsdp_equal_the_triton_path(tmp_path):
    """Two GPUs, FSDP over both, EP degree 1: each rank's megakernel on its own tokens with the gathered weights."""
    _assert_same_steps(_train(tmp_path / "megakernel", "megakernel", 2), _train(tmp_path / "triton", "triton", 2))
