"""MoE layer benchmark: forward and forward+backward time of one full-size MoE layer.

    torchrun --nproc_per_node N -m titan_mok.bench.layer --shape kimi_k2_7_code --precision bf16 --backend mok

EP degree = N (the whole world is one ep group; N = 1: no expert parallelism).
The layer is the model's ``full`` flavor MoE (DESIGN §4 table), weights and activations
in bf16, T tokens per GPU (default 2048), the top-k router's layers (hash routing off).
``--backend`` and ``--kernels`` (comma lists) pick the implementations:
- ``mok`` with ``--kernels reference``: titan-mok's pure-PyTorch reference backend (all-gathered
  schedule with host syncs, gloo/NCCL all-to-all, kernels/grouped_ffn.py's reference FFN in fp32);
- ``torchtitan``: TorchTitan 0.2.2's GroupedExperts (``torch._grouped_mm``) + all-to-all
  ExpertParallel, the baseline. TorchTitan has no SwiGLU clamp: DeepSeek-V4's is dropped there.
Timing: CUDA events around a fixed number of iterations (every rank runs the same count, the
collectives stay matched), median after warm-up, max over ranks; backward = (forward +
backward) − forward. Rank 0 prints one line per configuration and, with ``--out``, writes
them as JSON lines.
"""

import argparse
import dataclasses
import datetime
import json
import os

import torch
import torch.distributed as dist

from titan_mok.bench.mok_fused import _max_over_ranks, _median_ms  # one timing loop for both benches
from titan_mok.moe import MoE
from titan_mok.registry import MODELS, flavors

SHAPES = MODELS


def build_layer(shape: str, backend: str, kernels: str, precision: str, ep_mesh) -> MoE:
    """The shape's full-flavor MoE layer on this GPU, bf16, random weights (std 0.02)."""
    flavor = flavors(shape)["full"]
    overrides = dict(backend=backend, kernels=kernels, precision=precision, hash_routing=False)
    if backend == "torchtitan":
        overrides["swiglu_limit"] = None
    args = dataclasses.replace(flavor.moe_args, **overrides)
    torch.set_default_dtype(torch.bfloat16)  # parameters in bf16 from the start (buffers stay fp32)
    try:
        with torch.device("meta"):
            moe = MoE(args, flavor.dim)
    finally:
        torch.set_default_dtype(torch.float32)
    moe = moe.to_empty(device="cuda")
    torch.manual_seed(0)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.02)
        for buffer in moe.buffers():
            buffer.zero_()
    if ep_mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module
        from torchtitan.distributed.expert_parallel import ExpertParallel

        from titan_mok.moe.expert_parallel import MokExpertParallel

        style = MokExpertParallel() if backend == "mok" else ExpertParallel()
        parallelize_module(moe.experts, ep_mesh, style)
        moe.experts.ep_mesh = ep_mesh
    return moe


def median_ms(fn, iters: int, warmup: int) -> float:
    """Median CUDA-event time of ``fn()`` over ``iters`` calls after ``warmup`` calls, max over ranks."""
    return _max_over_ranks(_median_ms(fn, iters, warmup))


def bench(shape: str, backend: str, kernels: str, precision: str, tokens: int, iters: int, warmup: int, ep_mesh):
    moe = build_layer(shape, backend, kernels, precision, ep_mesh)
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    x_BSH = torch.randn(1, tokens, moe.dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy_BSH = torch.randn(1, tokens, moe.dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    x_BSH.requires_grad_(True)

    def forward():
        with torch.no_grad():
            moe(x_BSH)

    def forward_backward():
        moe(x_BSH).backward(dy_BSH)
        moe.zero_grad(set_to_none=True)
        x_BSH.grad = None

    fwd = median_ms(forward, iters, warmup)
    fwd_bwd = median_ms(forward_backward, iters, warmup)
    args = moe.args
    flops_fwd = 6 * (tokens + tokens * args.top_k) * moe.dim * args.expert_dim  # MoK's convention
    del moe
    torch.cuda.empty_cache()
    return {
        "shape": shape, "backend": backend, "kernels": kernels if backend == "mok" else "-", "precision": precision,
        "ep": dist.get_world_size() if dist.is_initialized() else 1, "tokens_per_gpu": tokens,
        "fwd_ms": round(fwd, 3), "bwd_ms": round(fwd_bwd - fwd, 3), "fwd_bwd_ms": round(fwd_bwd, 3),
        "fwd_tflops": round(flops_fwd / fwd / 1e9, 1), "bwd_tflops": round(2 * flops_fwd / (fwd_bwd - fwd) / 1e9, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default=",".join(SHAPES), help=f"comma list of {SHAPES}")
    parser.add_argument("--backend", default="mok,torchtitan", help="comma list of mok, torchtitan")
    parser.add_argument("--kernels", default="reference", help="mok backend: reference, auto or triton")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "mxfp8"))
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per GPU")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None, help="append JSON lines here (rank 0)")
    opts = parser.parse_args()
    for shape in opts.shape.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"--shape {shape!r}: choose from {SHAPES}")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ep_mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
        ep_mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))["ep"]
    rank = dist.get_rank() if dist.is_initialized() else 0
    for shape in opts.shape.split(","):
        for backend in opts.backend.split(","):
            try:
                result = bench(shape, backend, opts.kernels, opts.precision, opts.tokens, opts.iters, opts.warmup,
                               ep_mesh)
            except torch.OutOfMemoryError:  # e.g. the fp32 reference at EP=1 on the largest shapes
                torch.cuda.empty_cache()
                result = {"shape": shape, "backend": backend, "kernels": opts.kernels, "ep": world,
                          "error": "CUDA out of memory"}
            if rank == 0:
                print(json.dumps(result), flush=True)
                if opts.out:
                    with open(opts.out, "a") as f:
                        f.write(json.dumps(result) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
