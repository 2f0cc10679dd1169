"""MoE layer benchmark of the fused mok path against the other implementations.

    torchrun --nproc_per_node N -m titan_mok.bench.mok_fused --shape kimi_k2_7_code,glm_5_2 \
        --precision bf16,mxfp8 --impl triton,auto,torchtitan

EP degree = N (the whole world is one ep group). Implementations (``MoEArgs`` fields):
- ``triton``: backend mok, kernels "triton" — the fused path (titan_mok.moe.fused);
- ``auto``: backend mok, kernels "auto" — reference dispatch/combine (NCCL all-to-all, host
  sync for split sizes) + the Triton grouped FFN;
- ``torchtitan``: backend torchtitan — TorchTitan 0.2.2's GroupedExperts + ExpertParallel
  (bf16 only; DeepSeek-V4's SwiGLU clamp is dropped for it, as TorchTitan has none).
The layer is each model's ``full`` flavor MoE (weights and activations in bf16), T tokens per
GPU, balanced (random init, small bias) or skewed routing (a quarter of the experts favoured).
Timing: CUDA events, median of ``--iters`` iterations after warm-up, max over ranks; backward =
(forward + backward) − forward. TFLOP/s/GPU by MoK's convention: 6·(T + T·K)·H·I forward,
twice that backward. Prints one table (rank 0).
"""

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from titan_mok.moe import MoE

SHAPES = ("kimi_k2_7_code", "glm_5_2", "qwen3_5_397b_a17b", "deepseek_v4_pro")
IMPLS = {
    "triton": dict(backend="mok", kernels="triton"),
    "auto": dict(backend="mok", kernels="auto"),
    "torchtitan": dict(backend="torchtitan", kernels="auto"),
}


def _full_flavor(shape: str):
    import importlib

    return importlib.import_module(f"titan_mok.models.{shape}").__dict__[f"{shape}_configs"]["full"]


def _build(shape: str, impl: str, precision: str, skewed: bool, ep_mesh) -> MoE:
    from dataclasses import replace

    flavor = _full_flavor(shape)
    overrides = dict(IMPLS[impl], precision=precision, hash_routing=False, max_rows_per_rank=None)
    if impl == "torchtitan":
        overrides["swiglu_limit"] = None
    args = replace(flavor.moe_args, **overrides)
    torch.manual_seed(0)
    with torch.device("meta"):  # bf16 from the start: a full layer's fp32 experts would not fit
        moe = MoE(args, flavor.dim)
    moe = moe.to(torch.bfloat16).to_empty(device="cuda")
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.02)
        for name in ("expert_bias", "tokens_per_expert", "expert_load"):  # fp32 buffers the router reads
            setattr(moe, name, torch.zeros(args.num_experts, dtype=torch.float32, device="cuda"))
        moe.expert_bias.normal_(0, 1e-3)
        if skewed:  # a quarter of the experts get most of the picks
            moe.expert_bias[: args.num_experts // 4] += 0.05
    if ep_mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module
        from torchtitan.distributed.expert_parallel import ExpertParallel

        from titan_mok.moe.expert_parallel import MokExpertParallel

        parallelize_module(moe.experts, ep_mesh, ExpertParallel() if impl == "torchtitan" else MokExpertParallel())
    return moe


def _median_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _max_over_ranks(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench_one(shape, impl, precision, skewed, tokens, iters, warmup, ep_mesh) -> dict:
    moe = _build(shape, impl, precision, skewed, ep_mesh)
    rank = dist.get_rank() if dist.is_initialized() else 0
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    x = torch.randn(1, tokens, moe.dim, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(1, tokens, moe.dim, device="cuda", generator=g, dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            moe(x)

    def forward_backward():
        moe(x).backward(dy)
        moe.zero_grad(set_to_none=True)
        x.grad = None

    fwd = _max_over_ranks(_median_ms(forward, iters, warmup))
    fwd_bwd = _max_over_ranks(_median_ms(forward_backward, iters, warmup))
    args = moe.args
    flops_fwd = 6 * (tokens + tokens * args.top_k) * moe.dim * args.expert_dim
    del moe
    torch.cuda.empty_cache()
    bwd = fwd_bwd - fwd
    return dict(fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=flops_fwd / fwd / 1e9, bwd_tflops=2 * flops_fwd / bwd / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default=",".join(SHAPES))
    parser.add_argument("--precision", default="bf16,mxfp8")
    parser.add_argument("--impl", default="triton,auto,torchtitan")
    parser.add_argument("--routing", default="balanced", help="balanced,skewed")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per GPU")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    opts = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ep_mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
        ep_mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    rows = []
    for shape in opts.shape.split(","):
        for routing in opts.routing.split(","):
            for precision in opts.precision.split(","):
                for impl in opts.impl.split(","):
                    if impl == "torchtitan" and precision != "bf16":
                        continue
                    try:
                        r = bench_one(shape, impl, precision, routing == "skewed", opts.tokens, opts.iters,
                                      opts.warmup, ep_mesh)
                    except Exception as err:  # one failing configuration must not hide the others
                        if rank0:
                            print(f"FAILED {shape} {routing} {precision} {impl}: {type(err).__name__}: {err}", flush=True)
                        torch.cuda.empty_cache()
                        continue
                    rows.append((shape, routing, precision, impl, r))
                    if rank0:
                        print(f"{shape} {routing} {precision} {impl} ep={world}: fwd {r['fwd_ms']:.2f} ms "
                              f"({r['fwd_tflops']:.0f} TF/s)  bwd {r['bwd_ms']:.2f} ms ({r['bwd_tflops']:.0f} TF/s)",
                              flush=True)
    if rank0:
        base = {(row[0], row[1]): row[4] for row in rows if row[3] == "torchtitan"}
        print("\n| shape | routing | precision | impl | EP | fwd ms | fwd TF/s | bwd ms | bwd TF/s | fwd × tt | bwd × tt |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for shape, routing, precision, impl, r in rows:
            b = base.get((shape, routing))
            ratio_f = f"{b['fwd_ms'] / r['fwd_ms']:.2f}" if b else "—"
            ratio_b = f"{b['bwd_ms'] / r['bwd_ms']:.2f}" if b else "—"
            print(f"| {shape} | {routing} | {precision} | {impl} | {world} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} "
                  f"| {r['bwd_ms']:.2f} | {r['bwd_tflops']:.0f} | {ratio_f} | {ratio_b} |", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
