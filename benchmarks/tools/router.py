"""Benchmark: the router's routing step on one GPU, all tokens in one call (the CUDA default)
against 64-row tiles (the CPU path; every device's path before 2026-12-01).

    python3 -m benchmarks.tools.router [--tokens 2048] [--iters 50]

Per shape (full flavor, top-k routing, the expert bias where the model has one): forward
(scores → expert choice → combine weights) and forward + backward (fixed cotangents on the
weights and scores, to the logits); median of ``--iters`` CUDA-event timings after warm-up.
The logits GEMM is not included (kernels/row_linear.py: one row-invariant launch on CUDA).
"""

import argparse
import dataclasses
import json

import torch

from titan_mok.bench.timing import median_ms
from titan_mok.moe.router import TopKRouter
from titan_mok.registry import MODELS, flavors


def full_router(shape: str, hash_routing: bool, device: str = "cuda") -> tuple[TopKRouter, bool]:
    """(the shape's full-flavor router, whether its layer adds an expert bias)."""
    flavor = flavors(shape)["full"]
    hash_args = dict(hash_routing=True, hash_vocab_size=flavor.vocab_size) if hash_routing else {}
    args = dataclasses.replace(flavor.moe_args, **hash_args)
    return TopKRouter(args, flavor.dim).to(device), args.use_expert_bias


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=50)
    opts = parser.parse_args()
    for shape in MODELS:
        torch.manual_seed(0)
        router, use_bias = full_router(shape, hash_routing=False)
        logits_TE = torch.randn(opts.tokens, router.num_experts, device="cuda", requires_grad=True)
        bias_E = torch.randn(router.num_experts, device="cuda") * 0.1 if use_bias else None
        row = {"shape": shape, "tokens": opts.tokens}
        for row_tiles in (True, False):
            def forward():
                return router(logits_TE, bias_E, None, row_tiles=row_tiles)

            def forward_backward():
                weights_TK, _, scores_TE = forward()
                torch.autograd.backward([weights_TK, scores_TE], [torch.ones_like(weights_TK), torch.ones_like(scores_TE)])

            name = "tiles" if row_tiles else "one_call"
            row[f"{name}_fwd_ms"] = median_ms(forward, opts.iters, 5)
            row[f"{name}_fwd_bwd_ms"] = median_ms(forward_backward, opts.iters, 5)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
