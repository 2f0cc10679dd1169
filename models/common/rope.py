"""Rotary position embedding: plain RoPE and YaRN, interleaved or half-split layout.

Legend: B batch, S sequence, N heads, D rotary dims (even).

The cache is one real fp32 tensor ``[S, D]`` = ``cat(cos, sin)`` of the ``D/2``
pair angles (already multiplied by YaRN's attention factor), so it is an
ordinary buffer that FSDP and ``model.to`` leave alone.

Layouts: ``interleaved`` rotates the pairs ``(x0, x1), (x2, x3), …`` (DeepSeek-V3,
Kimi, GLM-5 checkpoints); ``half`` rotates ``(x_i, x_{i+D/2})`` (Llama/Qwen's
``rotate_half``). Attention only uses dot products of rotated q and k, so the
interleaved output keeps the pair layout of its input.
"""

import math
from dataclasses import dataclass

import torch


@dataclass
class YaRN:
    """YaRN context extension (arXiv:2309.00071), DeepSeek-V3's parameterisation."""

    factor: float
    """Context extension factor (interpolated frequencies are divided by it)."""
    original_seq_len: int
    """Pre-training context (``original_max_position_embeddings``)."""
    beta_fast: float = 32.0
    """Rotations at which the ramp starts keeping the original frequencies."""
    beta_slow: float = 1.0
    """Rotations below which frequencies are fully interpolated."""
    mscale: float = 1.0
    """Numerator coefficient of the cos/sin attention factor."""
    mscale_all_dim: float = 0.0
    """Softmax-scale coefficient (DeepSeek: softmax scale × mscale(factor, this)²); 0: off."""

    def __post_init__(self):
        if self.factor <= 0 or self.original_seq_len <= 0:
            raise ValueError(f"YaRN factor ({self.factor}) and original_seq_len ({self.original_seq_len}) must be > 0")

    @staticmethod
    def _mscale(factor: float, coef: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * coef * math.log(factor) + 1.0

    def attention_factor(self) -> float:
        """Multiplier of cos and sin."""
        if self.mscale and self.mscale_all_dim:
            return self._mscale(self.factor, self.mscale) / self._mscale(self.factor, self.mscale_all_dim)
        return self._mscale(self.factor, 1.0)

    def softmax_scale_factor(self) -> float:
        """Multiplier of the attention softmax scale."""
        return self._mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def inv_freq(self, inv_freq_D2: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
        """Blend interpolated and original frequencies with YaRN's linear ramp."""

        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp_D2 = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep_D2 = 1 - ramp_D2  # 1: keep the original frequency (high-frequency pairs)
        return inv_freq_D2 / self.factor * (1 - keep_D2) + inv_freq_D2 * keep_D2


def rope_cache(seq_len: int, dim: int, theta: float, yarn: YaRN | None = None) -> torch.Tensor:
    """``[seq_len, dim]`` fp32: ``cat(cos, sin)`` of the pair angles, on the current default device."""
    if dim % 2:
        raise ValueError(f"rotary dim must be even, got {dim}")
    inv_freq_D2 = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scale = 1.0
    if yarn is not None:
        inv_freq_D2 = yarn.inv_freq(inv_freq_D2, dim, theta)
        scale = yarn.attention_factor()
    angles_SD2 = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq_D2)
    return torch.cat([angles_SD2.cos(), angles_SD2.sin()], dim=-1) * scale


def apply_rope(x_BSND: torch.Tensor, cache_SD: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of ``x`` by the first S positions of the cache (fp32 math)."""
    seq_len, dim = x_BSND.shape[1], x_BSND.shape[-1]
    if cache_SD.shape[0] < seq_len or cache_SD.shape[1] != dim:
        raise ValueError(f"rope cache {tuple(cache_SD.shape)} does not cover seq {seq_len} × rotary dim {dim}")
    cos_S1D2, sin_S1D2 = cache_SD[:seq_len, None, :].chunk(2, dim=-1)  # [S, 1, D/2] each
    x32_BSND = x_BSND.float()
    if interleaved:
        x1, x2 = x32_BSND[..., 0::2], x32_BSND[..., 1::2]
    else:
        x1, x2 = x32_BSND.chunk(2, dim=-1)
    y1, y2 = x1 * cos_S1D2 - x2 * sin_S1D2, x2 * cos_S1D2 + x1 * sin_S1D2
    if interleaved:
        y_BSND = torch.stack([y1, y2], dim=-1).flatten(-2)  # [B, S, N, D/2, 2] -> [B, S, N, D]
    else:
        y_BSND = torch.cat([y1, y2], dim=-1)
    return y_BSND.to(x_BSND.dtype)
