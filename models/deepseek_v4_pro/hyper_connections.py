"""Manifold-constrained hyper-connections (mHC): the residual stream is n parallel
copies; each sub-layer reads a weighted sum of them (``pre``), writes its output
back to every copy (``post``) and mixes the copies through a doubly-stochastic
matrix (``comb``, projected by Sinkhorn-Knopp iterations).

Legend: B batch, S sequence, C streams (hc_mult), H hidden.

All weights come from one linear map of the RMS-normalised flattened streams:
``mixes = (x_flat / rms(x_flat)) · fnᵀ`` ([B, S, (2 + C)·C]), then
``pre = sigmoid(mixes_pre·scale0 + base_pre) + eps``,
``post = 2·sigmoid(mixes_post·scale1 + base_post)``,
``comb = Sinkhorn(softmax_rows(mixes_comb·scale2 + base_comb) + eps)``.
Output: ``x'_j = post_j · f(Σ_i pre_i x_i) + Σ_i comb_ij x_i``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from titan_mok.kernels.row_tiles import pointwise_padded


def sinkhorn(comb_BSCC: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Column-normalise once, then (iters − 1) times rows then columns (the official order)."""
    comb_BSCC = comb_BSCC / (comb_BSCC.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb_BSCC = comb_BSCC / (comb_BSCC.sum(dim=-1, keepdim=True) + eps)
        comb_BSCC = comb_BSCC / (comb_BSCC.sum(dim=-2, keepdim=True) + eps)
    return comb_BSCC


def stream_mixes(x_BSCH: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """Linear map of the RMS-normalised flattened streams, fp32: [B, S, C·H] -> [B, S, out]."""
    x_BSF = x_BSCH.flatten(2).float()
    return F.linear(x_BSF * torch.rsqrt(x_BSF.square().mean(-1, keepdim=True) + norm_eps), fn.float())


def collapse(x_BSCH: torch.Tensor, pre_BSC: torch.Tensor) -> torch.Tensor:
    """Σ_i pre_i x_i in fp32, cast back: [B, S, H]."""
    return (pre_BSC[..., None] * x_BSCH.float()).sum(dim=2).to(x_BSCH.dtype)


class HyperConnection(nn.Module):
    """The (pre, post, comb) generator around one sub-layer."""

    def __init__(self, dim: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + hc_mult) * hc_mult, hc_mult * dim))
        self.base = nn.Parameter(torch.zeros((2 + hc_mult) * hc_mult))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x_BSCH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (sub-layer input [B, S, H], post [B, S, C], comb [B, S, C, C]), post/comb fp32."""
        c = self.hc_mult
        mixes = stream_mixes(x_BSCH, self.fn, self.norm_eps)
        pre_w, post_w, comb_w = mixes.split([c, c, c * c], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([c, c, c * c])
        scale = self.scale.float()
        # sigmoid on a padded flat tensor: a token's weights keep their bits whatever the call's size (RL decode)
        pre_post_BS2C = torch.cat([pre_w * scale[0] + pre_b, post_w * scale[1] + post_b], dim=-1)
        pre_BSC, post_BSC = pointwise_padded(torch.sigmoid, pre_post_BS2C).split(c, dim=-1)
        pre_BSC, post_BSC = pre_BSC + self.hc_eps, 2 * post_BSC
        # [B, S, C·C] -> [B, S, C, C]
        comb_logits = comb_w.unflatten(-1, (c, c)) * scale[2] + comb_b.view(c, c)
        comb_BSCC = sinkhorn(comb_logits.softmax(dim=-1) + self.hc_eps, self.sinkhorn_iters, self.hc_eps)
        return collapse(x_BSCH, pre_BSC), post_BSC, comb_BSCC

    def init_weights(self):
        nn.init.normal_(self.fn, std=0.02)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)


def merge(out_BSH: torch.Tensor, residual_BSCH: torch.Tensor, post_BSC: torch.Tensor, comb_BSCC: torch.Tensor):
    """x'_j = post_j · out + Σ_i comb_ij · residual_i: [B, S, C, H]."""
    dtype = residual_BSCH.dtype
    mixed = torch.einsum("bsij,bsih->bsjh", comb_BSCC.to(dtype), residual_BSCH)
    return post_BSC.to(dtype)[..., None] * out_BSH[:, :, None, :] + mixed


class HyperHead(nn.Module):
    """Final collapse of the streams before the last norm: pre-weights only, scalar scale."""

    def __init__(self, dim: int, hc_mult: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * dim))
        self.base = nn.Parameter(torch.zeros(hc_mult))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x_BSCH: torch.Tensor) -> torch.Tensor:
        mixes = stream_mixes(x_BSCH, self.fn, self.norm_eps)
        pre_BSC = pointwise_padded(torch.sigmoid, mixes * self.scale.float() + self.base.float()) + self.hc_eps
        return collapse(x_BSCH, pre_BSC)

    def init_weights(self):
        nn.init.normal_(self.fn, std=0.02)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)
