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
from titan_mok.moe.dispatch import reduce_slots
from titan_mok.moe.torchtitan_backend import routed_torchtitan
from titan_mok.registry import MODELS, flavors

SHAPES = MODELS
IMPLS = {
    "triton": dict(backend="mok", kernels="triton"),
    "auto": dict(backend="mok", kernels="auto"),
    "torchtitan": dict(backend="torchtitan", kernels="auto"),
}


def _build(shape: str, impl: str, precision: str, skewed: bool, ep_mesh) -> MoE:
    from dataclasses import replace

    flavor = flavors(shape)["full"]
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
    """Median of ``iters`` CUDA-event timings of ``fn()`` after ``warmup`` calls."""
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


def _routed_section(moe: MoE, x_TH: torch.Tensor):
    """The routed experts alone (dispatch → expert FFN → combine) on fixed router outputs."""
    group = moe._ep_group()
    with torch.no_grad():
        bias_E = moe.expert_bias if moe.args.use_expert_bias else None
        weights_TK, topk_idx_TK, _ = moe.router(moe.router.logits(x_TH), bias_E, None)
        shared_TH = moe.shared_expert(x_TH) if moe.shared_expert is not None else None
    x_TH = x_TH.detach().requires_grad_()
    weights_TK = weights_TK.requires_grad_()

    def run() -> torch.Tensor:
        if moe.args.backend == "mok":
            return moe._routed_mok(x_TH, weights_TK, topk_idx_TK, shared_TH, group)
        return reduce_slots(routed_torchtitan(moe.experts, x_TH, topk_idx_TK), weights_TK, shared_TH, x_TH.dtype)

    return run, (x_TH, weights_TK)


def _fwd_bwd_ms(run, inputs, dy, iters, warmup) -> tuple[float, float]:
    """(forward ms, backward ms) of ``run()``; backward = (forward + backward) − forward."""
    def forward():
        with torch.no_grad():
            run()

    def forward_backward():
        run().backward(dy)
        for t in inputs:
            t.grad = None

    fwd = _max_over_ranks(_median_ms(forward, iters, warmup))
    return fwd, _max_over_ranks(_median_ms(forward_backward, iters, warmup)) - fwd


def _floors_ms(args, dim: int, tokens: int, ep_degree: int, precision: str) -> tuple[float, float]:
    """Roofline floors (forward, backward): max(FLOPs / 800 TF/s, expert-weight bytes / 4343 GB/s)
    (h200_facts.md ceilings); backward also writes bf16 weight gradients."""
    flops = 6 * (tokens + tokens * args.top_k) * dim * args.expert_dim
    weights = 3 * (args.num_experts // ep_degree) * dim * args.expert_dim
    read = weights * (2 if precision == "bf16" else 1 + 1 / 32)
    return max(flops / 800e9, read / 4343e6), max(2 * flops / 800e9, (read + 2 * weights) / 4343e6)


def bench_one(shape, impl, precision, skewed, tokens, iters, warmup, ep_mesh) -> dict:
    moe = _build(shape, impl, precision, skewed, ep_mesh)
    rank = dist.get_rank() if dist.is_initialized() else 0
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    x = torch.randn(1, tokens, moe.dim, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(1, tokens, moe.dim, device="cuda", generator=g, dtype=torch.bfloat16)

    def layer():
        out = moe(x)
        moe.zero_grad(set_to_none=True)
        return out

    result = {}
    result["fwd_ms"], result["bwd_ms"] = _fwd_bwd_ms(layer, (x,), dy, iters, warmup)
    run, inputs = _routed_section(moe, x[0])
    result["routed_fwd_ms"], result["routed_bwd_ms"] = _fwd_bwd_ms(run, inputs, dy[0], iters, warmup)
    ep_degree = dist.get_world_size() if dist.is_initialized() else 1
    result["floor_fwd_ms"], result["floor_bwd_ms"] = _floors_ms(moe.args, moe.dim, tokens, ep_degree, precision)
    flops_fwd = 6 * (tokens + tokens * moe.args.top_k) * moe.dim * moe.args.expert_dim
    result["fwd_tflops"], result["bwd_tflops"] = flops_fwd / result["fwd_ms"] / 1e9, 2 * flops_fwd / result["bwd_ms"] / 1e9
    del moe, run, inputs
    torch.cuda.empty_cache()
    return result


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
                        print(f"{shape} {routing} {precision} {impl} ep={world}: layer fwd {r['fwd_ms']:.2f} ms "
                              f"({r['fwd_tflops']:.0f} TF/s) bwd {r['bwd_ms']:.2f} ms ({r['bwd_tflops']:.0f} TF/s); "
                              f"routed fwd {r['routed_fwd_ms']:.2f} bwd {r['routed_bwd_ms']:.2f} ms", flush=True)
    if rank0:
        base = {(row[0], row[1]): row[4] for row in rows if row[3] == "torchtitan"}
        print("\nms, max over ranks; × tt: torchtitan time / this time (same run); floor: roofline floor / this time")
        print("| shape | routing | prec | impl | EP | layer fwd | layer bwd | routed fwd | routed bwd | layer × tt f/b "
              "| routed × tt f/b | floor f/b ms | routed floor frac f/b |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for shape, routing, precision, impl, r in rows:
            b = base.get((shape, routing))
            ratios = [f"{b[k] / r[k]:.2f}" if b else "—" for k in ("fwd_ms", "bwd_ms", "routed_fwd_ms", "routed_bwd_ms")]
            print(f"| {shape} | {routing} | {precision} | {impl} | {world} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} "
                  f"| {r['routed_fwd_ms']:.2f} | {r['routed_bwd_ms']:.2f} | {ratios[0]} / {ratios[1]} "
                  f"| {ratios[2]} / {ratios[3]} | {r['floor_fwd_ms']:.2f} / {r['floor_bwd_ms']:.2f} "
                  f"| {r['floor_fwd_ms'] / r['routed_fwd_ms']:.2f} / {r['floor_bwd_ms'] / r['routed_bwd_ms']:.2f} |",
                  flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
