"""The router's one-call CUDA path is row-invariant: each token's weights, expert ids, scores
and logit gradient are bitwise the same whatever batch it is routed in, and equal to the
64-row-tile path (titan_mok/moe/router.py's docstring says why). GPU only."""

import pytest
import torch

from benchmarks.tools.router import full_router
from titan_mok.registry import MODELS

DEVICE = "cuda"


def route_with_grad(router, logits_TE, bias_E, ids_T, row_tiles=None):
    logits_TE = logits_TE.detach().requires_grad_(True)
    weights_TK, topk_idx_TK, scores_TE = router(logits_TE, bias_E, ids_T, row_tiles=row_tiles)
    # fixed per-element cotangents: each row's gradient depends on its own values only
    (weights_TK * torch.linspace(0.5, 1.5, weights_TK.shape[1], device=DEVICE)).sum().backward(retain_graph=True)
    (scores_TE * 0.25).sum().backward()
    return weights_TK, topk_idx_TK, scores_TE, logits_TE.grad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape,hash_routing", [(s, False) for s in MODELS] + [("deepseek_v4_pro", True)])
def test_one_call_routing_is_row_invariant(shape, hash_routing):
    torch.manual_seed(0)
    router, use_bias = full_router(shape, hash_routing, DEVICE)
    num_tokens, num_experts = 2048, router.num_experts
    logits_TE = torch.randn(num_tokens, num_experts, device=DEVICE) * 3
    logits_TE[5, :] = 0.0  # one row of ties
    bias_E = torch.randn(num_experts, device=DEVICE) * 0.1 if use_bias else None
    ids_T = torch.randint(router.hash_table.shape[0], (num_tokens,), device=DEVICE) if hash_routing else None
    whole = route_with_grad(router, logits_TE, bias_E, ids_T, row_tiles=False)
    tiles = route_with_grad(router, logits_TE, bias_E, ids_T, row_tiles=True)
    bounds = [0, 1, 8, 300, 1111, num_tokens]
    parts = [route_with_grad(router, logits_TE[a:b], bias_E, None if ids_T is None else ids_T[a:b], row_tiles=False)
             for a, b in zip(bounds, bounds[1:])]
    for i, name in enumerate(("weights", "expert ids", "scores", "logit grad")):
        assert torch.equal(whole[i], tiles[i]), f"{shape}: {name} differ from the 64-row-tile path"
        assert torch.equal(whole[i], torch.cat([p[i] for p in parts])), f"{shape}: {name} depend on the batch"
