"""MXFP8 (OCP Microscaling, E4M3 elements with one E8M0 scale per 32) — the reference format.

This module is the definition (docs/design.md, MXFP8); the Triton kernels in
``titan_mok.kernels.mxfp8_quant`` and the grouped GEMMs must match it bit for bit.

Rules, for each block of 32 consecutive elements along the quantized dim:
- ``amax`` = max |x| over the block (computed in fp32; bf16/fp16 inputs are exact there).
- scale = 2^e with e the smallest integer such that amax <= 448 * 2^e, i.e.
  e = ceil(log2(amax / 448)) evaluated exactly (from the fp32 exponent and mantissa, not
  through a rounded float log2), clamped to E8M0's range [-127, 127]. An all-zero block
  (and any block with amax < 448 * 2^-127) gets the smallest scale, 2^-127.
- element = round-to-nearest-even(x / 2^e) in E4M3, saturating to ±448.
- NaN/Inf rule (OCP's NaN scale): a block holding any NaN or ±Inf gets the NaN scale
  (E8M0 0xFF) and all its elements are E4M3 NaN (0x7F), so the whole block dequantizes to NaN.

Scales are stored as ``torch.float8_e8m0fnu`` (present in torch >= 2.7; this project runs
2.11 on the GPU machine and 2.13 on CPU); compare them through ``.view(torch.uint8)``:
many ops (``torch.equal`` among them) are not implemented for that dtype.

Legend: ``dim`` is the blocked dimension of size D; D/32 blocks along it.
"""

from dataclasses import dataclass

import torch

BLOCK = 32
"""Elements sharing one scale."""
E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn."""
E8M0_MIN_EXP = -127
"""Exponent of the smallest E8M0 scale (biased 0)."""
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E4M3_NAN = 0x7F
SCALE_DTYPE = torch.float8_e8m0fnu


@dataclass
class MXTensor:
    """An MXFP8 tensor: E4M3 ``data`` (shape of the source) and E8M0 ``scale``.

    ``scale`` has the source's shape with ``dim`` divided by 32; ``dim`` is stored
    non-negative. ``mma_order``: within each block the elements are stored in the order
    Hopper's bf16 wgmma holds its register operand (``to_mma_order``), not in index order.
    """

    data: torch.Tensor
    scale: torch.Tensor
    dim: int
    mma_order: bool = False

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data * 2^e, computed in fp32 (the exact product, rounded once to fp32), cast to ``dtype``."""
        data = from_mma_order(self.data, self.dim) if self.mma_order else self.data
        scale = e8m0_values(self.scale).repeat_interleave(BLOCK, dim=self.dim)  # shape of data
        return (data.float() * scale).to(dtype)


# A block's index k = 16c + 8h + 2t + l (c: which k16 MMA step, t: which thread of a quad holds it, h: low or
# high 8 of the step, l: which of a pair). Hopper's bf16 wgmma gives thread t of a quad the pairs at
# 2t and 2t + 8 of each step (PTX ISA, "wgmma register fragment A"); stored at 8t + 4c + 2h + l, a
# thread's four pairs of a block are 8 adjacent bytes, one shared-memory load instead of four.
_INDEX_ORDER_DIMS = (2, 2, 4, 2)  # (c, h, t, l)
_MMA_ORDER_DIMS = (4, 2, 2, 2)  # (t, c, h, l)


def to_mma_order(data: torch.Tensor, dim: int) -> torch.Tensor:
    """``data`` (blocks of 32 along ``dim``, index order) with each block's elements in MMA order."""
    blocks = data.movedim(dim, -1).unflatten(-1, (-1, *_INDEX_ORDER_DIMS))
    return blocks.permute(*range(blocks.dim() - 4), -2, -4, -3, -1).flatten(-5).movedim(-1, dim).contiguous()


def from_mma_order(data: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of ``to_mma_order``."""
    blocks = data.movedim(dim, -1).unflatten(-1, (-1, *_MMA_ORDER_DIMS))
    return blocks.permute(*range(blocks.dim() - 4), -3, -2, -4, -1).flatten(-5).movedim(-1, dim).contiguous()


def e8m0_values(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (or their uint8 bits) as fp32 values 2^e, NaN for the NaN scale."""
    exp = scale.view(torch.uint8).to(torch.int32) - E8M0_BIAS
    return torch.where(exp == E8M0_NAN - E8M0_BIAS, torch.nan, exp2_exact(exp.clamp(max=E8M0_BIAS)))


def exp2_exact(n: torch.Tensor) -> torch.Tensor:
    """2^n as fp32 built from its bits (exact, unlike a library exp2), for int n in [-127, 127]."""
    n = n.to(torch.int32)
    normal = ((n + E8M0_BIAS).clamp(min=1) << 23).view(torch.float32)
    return torch.where(n == E8M0_MIN_EXP, 2.0**E8M0_MIN_EXP, normal)  # 2^-127 is subnormal


def _check_blockable(x: torch.Tensor, dim: int, name: str) -> int:
    if not x.is_floating_point():
        raise TypeError(f"to_mxfp8: {name} must be a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"to_mxfp8: {name} must have at least one dimension")
    dim = dim % x.dim()
    if x.shape[dim] % BLOCK != 0:
        raise ValueError(
            f"to_mxfp8: {name} has size {x.shape[dim]} along dim {dim} (shape {tuple(x.shape)}); "
            f"MXFP8 blocks need a multiple of {BLOCK} there (pad it first)"
        )
    return dim


def scale_exponent_of_amax(amax: torch.Tensor) -> torch.Tensor:
    """e = ceil(log2(amax / 448)) exactly, clamped to [-127, 127]; amax >= 0, finite, fp32.

    With amax = m * 2^k, m in [0.5, 1) (frexp, exact also for subnormals), and
    448 = 0.875 * 2^9: amax <= 448 * 2^e  <=>  e >= k - 9 when m <= 0.875, else e >= k - 8.
    """
    mantissa, exponent = torch.frexp(amax)
    exp = exponent - 9 + (mantissa > 0.875).to(torch.int32)
    exp = torch.where(amax == 0, E8M0_MIN_EXP, exp)
    return exp.clamp(E8M0_MIN_EXP, E8M0_BIAS)


def to_mxfp8(x: torch.Tensor, dim: int = -1, name: str = "x", mma_order: bool = False) -> MXTensor:
    """Quantize ``x`` to MXFP8 with blocks of 32 along ``dim`` (the rules in the module docstring),
    the elements stored in MMA order if ``mma_order``.

    ``name`` names the tensor in error messages. Raises when ``x.shape[dim]`` is not a
    multiple of 32.
    """
    dim = _check_blockable(x, dim, name)
    x_f = x.float().movedim(dim, -1)
    x_blk = x_f.unflatten(-1, (-1, BLOCK))  # [..., D/32, 32]
    finite = torch.isfinite(x_blk).all(dim=-1)  # [..., D/32]
    amax = torch.where(finite, x_blk.abs().amax(dim=-1), 0.0)
    exp = scale_exponent_of_amax(amax)  # [..., D/32] int32
    # 2^-e is a normal fp32 for every e that a finite fp32 amax can produce (e <= 120),
    # so the product is exact unless it is far below E4M3's smallest subnormal (then 0).
    inv_scale = exp2_exact(-exp).unsqueeze(-1)
    q = (x_blk * inv_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q_bits = torch.where(finite.unsqueeze(-1), q.view(torch.uint8), E4M3_NAN)
    s_bits = torch.where(finite, exp + E8M0_BIAS, E8M0_NAN).to(torch.uint8)
    data = q_bits.flatten(-2).movedim(-1, dim).contiguous()
    if mma_order:
        data = to_mma_order(data, dim)
    scale = s_bits.movedim(-1, dim).contiguous().view(SCALE_DTYPE)
    return MXTensor(data=data.view(torch.float8_e4m3fn), scale=scale, dim=dim, mma_order=mma_order)


def fake_quantize_mxfp8(x: torch.Tensor, dim: int = -1, name: str = "x") -> torch.Tensor:
    """dequantize(to_mxfp8(x, dim)) in fp32: the values an MXFP8 GEMM multiplies."""
    return to_mxfp8(x, dim, name).dequantize(torch.float32)
