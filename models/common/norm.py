"""RMSNorm, computed in fp32 and cast back (as the reference checkpoints do).

Legend: H normalised (last) dimension.
"""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``y = w · x / sqrt(mean(x²) + eps)``; with ``zero_centered`` the weight is
    stored as ``w − 1`` (Qwen3.5's ``(1 + w)`` form), so it initialises to zeros."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def forward(self, x_xH: torch.Tensor) -> torch.Tensor:
        x32_xH = x_xH.float()
        y_xH = (x32_xH * torch.rsqrt(x32_xH.pow(2).mean(-1, keepdim=True) + self.eps)).to(x_xH.dtype)
        weight_H = self.weight + 1 if self.zero_centered else self.weight
        return weight_H * y_xH

    def reset_parameters(self) -> None:
        if self.zero_centered:
            nn.init.zeros_(self.weight)
        else:
            nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, zero_centered={self.zero_centered}"
