"""Auxiliary load-balancing loss (Switch-style, Qwen3.5), attached to the layer output.

Legend: T tokens, E experts, K top-k, H hidden.

``attach_aux_loss(y, aux, coef)`` returns y unchanged; its backward adds
coef · d(aux)/dθ to the graph, so a plain cross-entropy on the model output
trains the router as if ``coef · aux`` had been added to the loss.
"""

import torch


def load_balance_aux_loss(scores_TE: torch.Tensor, topk_idx_TK: torch.Tensor) -> torch.Tensor:
    """E · Σ_e f_e · P_e: f_e = top-k picks of e / T, P_e = mean router probability of e."""
    num_tokens, num_experts = scores_TE.shape
    picks_E = torch.bincount(topk_idx_TK.reshape(-1), minlength=num_experts).to(torch.float32)
    return num_experts * (picks_E / num_tokens * scores_TE.mean(dim=0)).sum()


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, aux_loss: torch.Tensor, coef: float) -> torch.Tensor:
        ctx.coef = coef
        ctx.aux_meta = (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return dy, torch.full(shape, ctx.coef, dtype=dtype, device=device), None


def attach_aux_loss(y: torch.Tensor, aux_loss: torch.Tensor, coef: float) -> torch.Tensor:
    """y, with ``coef · aux_loss`` joined to the backward pass."""
    return _AttachAuxLoss.apply(y, aux_loss, coef)
