"""``[mok] kernels = "megakernel"`` on one GPU, against ``kernels = "triton"``, bit for bit (torch.equal, or equal
floats from the runs' metrics.jsonl):
- the MoE layer's output, input gradient and every parameter gradient (bf16 activations from fp32 master weights;
  and under autocast with a gated shared expert and the SwiGLU clamp), run to run, with activation checkpointing and
  two layers sharing the megakernel's workspace; ``kernels = "auto"`` takes the fused path and equals "triton";
- the routed experts and combine at Kimi K2.7's sizes with the default config: every gradient (through the dgrad
  launch) on one GPU (bf16 and MXFP8), and at EP = 2 (4, 8) GPUs;
- the routed path (forward and backward) does no host sync;
- training steps of each model's debug flavor on one GPU (AMP, full activation checkpointing), and of Kimi K2.7
  Code's with MXFP8 routed experts, on two GPUs under FSDP (EP degree 1, whose hooks gather the experts' weights
  for the megakernel) and at EP degree 2 (each rank's launch reaching the other through symmetric memory): every
  step's loss, gradient norm and loss checksum; no token dropped. A run resumed from a checkpoint continues the
  run it was cut from bit for bit.
- on 2 (4, 8) GPUs, one launch per rank over symmetric memory (``titan_mok.moe.megakernel_rank``): the layer at EP =
  the GPU count equals ``kernels = "triton"`` at the same EP degree, output and every gradient, run to run; its
  routed path does no host sync; a stalled peer ends in the bounded wait's error on both ranks, and with ``trap``
  in a device error within the bound.
The megakernel row of ``bench.layer``: tests/moe/test_bench_layer.py::test_full_kimi_layer_on_gpu.
CPU (the interpreter's serialized megakernel): test_mok_megakernel_layer.py.
"""

import datetime
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
    "mxfp8_amp_gated_clamped": dict(amp=True, args=dict(precision="mxfp8", score_func="softmax",
                                                        use_expert_bias=False, load_balance_coeff=None,
                                                        shared_expert_gate=True, swiglu_limit=0.5,
                                                        shared_expert_swiglu_limit=0.5)),
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


KIMI_H, KIMI_I, KIMI_K = 7168, 2048, 8


def _kimi_routed_inputs(tokens: int, experts: int, held: int, kind: str, seed: int):
    """Routed inputs at Kimi K2.7's sizes, on the GPU: x bf16 [T, H], combine weights fp32 [T, K], ids [T, K] of
    ``experts`` ("balanced": uniform; "skewed": expert e drawn with weight 2^-e, so a few low experts take nearly
    every row), a bf16 shared output, dout bf16 [T, H], and ``held`` experts' (w_gate, w_up [held, I, H], w_down
    [held, H, I]) bf16."""
    g = torch.Generator().manual_seed(seed)
    if kind == "balanced":
        ids = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :KIMI_K]
    else:
        ids = torch.multinomial(0.5 ** torch.arange(experts, dtype=torch.float).expand(tokens, -1), KIMI_K,
                                generator=g)
    x = torch.randn(tokens, KIMI_H, generator=g).to(torch.bfloat16)
    weights = torch.rand(tokens, KIMI_K, generator=g)
    shared = (torch.randn(tokens, KIMI_H, generator=g) * 0.1).to(torch.bfloat16)
    dout = (torch.randn(tokens, KIMI_H, generator=g) * 0.01).to(torch.bfloat16)
    expert_weights = tuple((torch.randn(held, *shape, generator=g) * 0.02).to(torch.bfloat16).cuda()
                           for shape in ((KIMI_I, KIMI_H), (KIMI_I, KIMI_H), (KIMI_H, KIMI_I)))
    return (*(t.cuda() for t in (x, weights, ids, shared, dout)), expert_weights)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("kind", ["balanced", "skewed"])
def test_routed_gradients_at_kimi_sizes_equal_the_triton_path(kind, precision):
    """The routed experts and combine at Kimi K2.7's sizes (H 7168, I 2048, K 8; 4096 tokens over 48 experts: a
    rank's share at EP 8), the default MegakernelConfig: the output and every gradient (x, the combine weights, the
    shared output, w_gate, w_up, w_down) through the dgrad launch bitwise the triton path's, run to run, in bf16 and
    with MXFP8 routed experts (both launches' MX variants)."""
    from tests.moe.test_mok_megakernel_autograd import assert_same_gradients, routed_gradients
    from titan_mok.moe.megakernel import MegakernelConfig

    x, weights, ids, shared, dout, expert_weights = _kimi_routed_inputs(4096, 48, 48, kind, seed=11)

    def call(kernels):
        return routed_gradients(kernels, x, weights, ids, shared, expert_weights, dout, num_experts=48,
                                config=MegakernelConfig(), precision=precision)

    want = call("triton")
    got = call("megakernel")
    assert_same_gradients(got, want, (kind, precision))
    assert_same_gradients(call("megakernel"), got, f"{kind}, {precision}: run to run")


def _train(folder, kernels: str, nproc: int, ep: int = 1, precision: str = "bf16",
           model: str = "kimi_k2_7_code", steps: int = 4, *extra: str) -> list[dict]:
    torchrun.run("titan_mok.train", f"train_configs/{model}/debug.toml", "--training.steps", str(steps),
                 "--parallelism.expert_parallel_degree", str(ep), "--training.mixed_precision_param", "bfloat16",
                 "--activation_checkpoint.mode", "full", "--metrics.log_freq", "1", "--mok.kernels", kernels,
                 "--mok.precision", precision, "--job.dump_folder", str(folder), *extra, nproc=nproc, timeout=600)
    (jsonl,) = folder.glob("tb/*/metrics.jsonl")
    return [json.loads(line) for line in jsonl.read_text().splitlines()[1:]]


def _assert_same_steps(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for mine, theirs in zip(got, want):
        for key in ("loss_metrics/global_avg_loss", "grad_norm", "determinism/loss_checksum"):
            assert mine["metrics"][key] == theirs["metrics"][key], (mine["step"], key)
        assert mine["metrics"]["moe/tokens_dropped"] == 0


@pytest.mark.parametrize("model", ["kimi_k2_7_code", "glm_5_2", "qwen3_5_397b_a17b", "deepseek_v4_pro"])
def test_debug_training_steps_equal_the_triton_path(tmp_path, model):
    """One GPU, each model's debug flavor: no FSDP, TorchTitan's AMP (autocast to bf16 over fp32 weights)."""
    _assert_same_steps(_train(tmp_path / "megakernel", "megakernel", 1, model=model),
                       _train(tmp_path / "triton", "triton", 1, model=model))


def test_kimi_debug_mxfp8_training_steps_equal_the_triton_path(tmp_path):
    """One GPU, MXFP8 routed experts: the megakernel's forward reads the weight operands the Triton FFN keeps per
    optimizer step, its backward the triton path's MXFP8 backward."""
    _assert_same_steps(_train(tmp_path / "megakernel", "megakernel", 1, precision="mxfp8"),
                       _train(tmp_path / "triton", "triton", 1, precision="mxfp8"))


def test_kimi_debug_training_resumed_from_a_checkpoint_continues_bitwise(tmp_path):
    """One GPU, the megakernel: six steps straight, and the same run resumed from its step-3 checkpoint (model,
    optimizer, schedule, data position), give the same steps 4-6 bit for bit (the megakernel's workspace, epochs
    and flags start afresh in the resumed process)."""
    checkpoint = ("--checkpoint.enable", "--checkpoint.interval", "3")
    full = _train(tmp_path / "full", "megakernel", 1, 1, "bf16", "kimi_k2_7_code", 6, *checkpoint)
    shutil.copytree(tmp_path / "full" / "checkpoint" / "step-3", tmp_path / "resumed" / "checkpoint" / "step-3")
    resumed = _train(tmp_path / "resumed", "megakernel", 1, 1, "bf16", "kimi_k2_7_code", 6, *checkpoint)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    keys = ("loss_metrics/global_avg_loss", "grad_norm")  # not the loss checksum: it chains a process's own steps
    assert [[r["metrics"][k] for k in keys] for r in resumed] == [[r["metrics"][k] for k in keys] for r in full[3:]]


@pytest.mark.two_gpus
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_kimi_debug_training_steps_under_fsdp_equal_the_triton_path(tmp_path):
    """Two GPUs, FSDP over both, EP degree 1: each rank's megakernel on its own tokens with the gathered weights."""
    _assert_same_steps(_train(tmp_path / "megakernel", "megakernel", 2), _train(tmp_path / "triton", "triton", 2))


@pytest.mark.two_gpus
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_kimi_debug_training_steps_at_ep_2_equal_the_triton_path(tmp_path):
    """Two GPUs, EP degree 2: each rank's megakernel pulls and pushes the other's rows through symmetric memory, in
    the forward launch and in the backward's dgrad launch."""
    _assert_same_steps(_train(tmp_path / "megakernel", "megakernel", 2, ep=2),
                       _train(tmp_path / "triton", "triton", 2, ep=2))


@pytest.mark.two_gpus
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("ep", [1, 2])
def test_kimi_debug_mxfp8_training_steps_on_two_gpus_equal_the_triton_path(tmp_path, ep):
    """Two GPUs, MXFP8 routed experts: under FSDP at EP degree 1 (the weights arrive as FSDP's MXFP8 all-gather,
    read as gathered) and at EP degree 2 (symmetric memory between the ranks' launches)."""
    _assert_same_steps(_train(tmp_path / "megakernel", "megakernel", 2, ep=ep, precision="mxfp8"),
                       _train(tmp_path / "triton", "triton", 2, ep=ep, precision="mxfp8"))


# ---------------------------------------------------------------- EP over real GPUs, one process per GPU, NCCL

_SYMMETRIC_MEMORY_ENV = (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                         ("NVSHMEM_DISABLE_NVLS", "1"))
STALL_TIMEOUT_MS = 3000.0


def _init(rank: int, world: int, init_file: str):
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    return init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))


def _ep_layer(kernels: str, case: str, mesh) -> MoE:
    from torch.distributed.tensor.parallel import parallelize_module

    from titan_mok.moe.expert_parallel import MokExpertParallel

    layer = _layer(kernels, case)
    parallelize_module(layer.experts, mesh, MokExpertParallel())
    return layer


def _local_grads(result):
    y, dx, grads = result
    return y, dx, {key: g.to_local() if hasattr(g, "to_local") else g for key, g in grads.items()}


def _layer_worker(rank: int, world: int, init_file: str) -> None:
    mesh = _init(rank, world, init_file)
    try:
        for case in CASES:
            x, dy = (t[:, rank * T // world:(rank + 1) * T // world] for t in _inputs(case))  # this rank's tokens
            amp = CASES[case]["amp"]
            want = _local_grads(run_layers([_ep_layer("triton", case, mesh)], x, dy, amp))
            mega = _ep_layer("megakernel", case, mesh)
            got = _local_grads(run_layers([mega], x, dy, amp))
            _assert_bitwise(got, want, f"rank {rank} of {world}, {case}")
            _assert_bitwise(_local_grads(run_layers([mega], x, dy, amp)), got, f"rank {rank}, {case}: run to run")
        # the routed path (forward and backward) without a host sync, at EP = world
        layer = _ep_layer("megakernel", "bf16", mesh)
        tokens = T // world
        g = torch.Generator().manual_seed(10 + rank)
        x_TH = torch.randn(tokens, H, generator=g).to(torch.bfloat16).cuda().requires_grad_()
        weights_TK = torch.rand(tokens, K, generator=g).cuda().requires_grad_()
        topk_idx_TK = torch.rand(tokens, E, generator=g).argsort(dim=1)[:, :K].cuda()
        dy_TH = torch.randn(tokens, H, generator=g).to(torch.bfloat16).cuda()
        group = mesh.get_group()

        def step():
            layer.routed(x_TH, weights_TK, topk_idx_TK, None, group, torch.bfloat16).backward(dy_TH)

        step()  # compile the kernels and allocate the workspaces
        run_without_host_sync(step)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.two_gpus
@pytest.mark.parametrize("world", [2, 4, 8])
def test_layer_at_ep_equals_the_triton_path_at_the_same_ep(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    for var, value in _SYMMETRIC_MEMORY_ENV:
        os.environ[var] = value
    init_file = Path(f"/tmp/mok_megakernel_ep{world}_{os.getpid()}")
    init_file.unlink(missing_ok=True)
    mp.spawn(_layer_worker, args=(world, str(init_file)), nprocs=world, join=True)


def _routed_gradients_worker(rank: int, world: int, init_file: str) -> None:
    from tests.moe.test_mok_megakernel_autograd import assert_same_gradients, routed_gradients
    from titan_mok.moe.megakernel import MegakernelConfig

    mesh = _init(rank, world, init_file)
    experts = 64
    try:
        for kind in ("balanced", "skewed"):  # skewed: nearly every row to rank 0's first experts
            x, weights, ids, shared, dout, local = _kimi_routed_inputs(2048, experts, experts // world, kind,
                                                                       seed=30 + rank)

            def call(kernels):
                return routed_gradients(kernels, x, weights, ids, shared, local, dout, num_experts=experts,
                                        group=mesh.get_group(), config=MegakernelConfig())

            want = call("triton")
            got = call("megakernel")
            assert_same_gradients(got, want, f"rank {rank} of {world}, {kind}")
            assert_same_gradients(call("megakernel"), got, f"rank {rank} of {world}, {kind}: run to run")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.two_gpus
@pytest.mark.parametrize("world", [2, 4, 8])
def test_routed_gradients_at_kimi_sizes_at_ep_equal_the_triton_path(world):
    """Each rank's routed experts and combine at Kimi K2.7's sizes (H 7168, I 2048, K 8, 2048 tokens per rank, 64
    experts), the default MegakernelConfig, EP = the GPU count: every gradient through the dgrad launches reaching
    each other over symmetric memory, bitwise the triton path's at the same EP degree, run to run."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    for var, value in _SYMMETRIC_MEMORY_ENV:
        os.environ[var] = value
    init_file = Path(f"/tmp/mok_megakernel_grads_ep{world}_{os.getpid()}")
    init_file.unlink(missing_ok=True)
    mp.spawn(_routed_gradients_worker, args=(world, str(init_file)), nprocs=world, join=True)


def _stall_worker(rank: int, init_file: str, out_dir: str) -> None:
    from titan_mok.moe.megakernel import MegakernelConfig
    from titan_mok.moe.megakernel_rank import megakernel_rank_routed_experts, raise_on_megakernel_rank_error

    mesh = _init(rank, 2, init_file)
    layer = _ep_layer("megakernel", "bf16", mesh)
    local = tuple(w.to_local().to(torch.bfloat16).contiguous() for w in (layer.experts.w_gate, layer.experts.w_up,
                                                                          layer.experts.w_down))
    g = torch.Generator().manual_seed(20 + rank)
    tokens = T // 2
    x_TH = torch.randn(tokens, H, generator=g).to(torch.bfloat16).cuda()
    weights_TK = torch.rand(tokens, K, generator=g).cuda()
    topk_idx_TK = torch.rand(tokens, E, generator=g).argsort(dim=1)[:, :K].cuda()
    config = MegakernelConfig(timeout_ms=STALL_TIMEOUT_MS)
    call = lambda **kw: megakernel_rank_routed_experts(  # noqa: E731
        x_TH, weights_TK, topk_idx_TK, None, local, num_experts=E, group=mesh.get_group(), config=config, **kw)
    result = {}
    with torch.no_grad():
        call()  # compile and allocate
        torch.cuda.synchronize()
        start = time.monotonic()
        call(stall_rank=1, trap=False)
        torch.cuda.synchronize()
        result["seconds"] = time.monotonic() - start
        try:
            raise_on_megakernel_rank_error()
            result["error"] = None
        except RuntimeError as e:
            result["error"] = str(e)
        dist.barrier()  # both ranks restarted their epochs before either calls again
        start = time.monotonic()
        try:
            call(stall_rank=1, trap=True)
            torch.cuda.synchronize()
            result["trap"] = None
        except RuntimeError as e:  # the finish's device assertion
            result["trap"] = str(e)
        result["trap_seconds"] = time.monotonic() - start
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a CUDA context does not survive the device error


@pytest.mark.two_gpus
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_a_stalled_peer_ends_in_the_bounded_wait_error(tmp_path):
    for var, value in _SYMMETRIC_MEMORY_ENV:
        os.environ[var] = value
    mp.spawn(_stall_worker, args=(str(tmp_path / "pg_init"), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert "x_ready: rank 0's communication program waited for rank 1 " in results[0]["error"]
    assert results[1]["error"] is not None and "mok megakernel: timed out" in results[1]["error"]
    for result in results:
        assert result["seconds"] <= 3 * STALL_TIMEOUT_MS / 1000 + 10, result  # bounded: a few waits in sequence
        assert result["trap"] is not None and result["trap_seconds"] <= 3 * STALL_TIMEOUT_MS / 1000 + 10, result
