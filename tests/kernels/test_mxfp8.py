"""The MXFP8 reference format (titan_mok.kernels.mxfp8) against brute-force statements of docs/design.md §6."""

import math

import pytest
import torch

from titan_mok.kernels.mxfp8 import E4M3_MAX, MXTensor, fake_quantize_mxfp8, from_mma_order, to_mma_order, to_mxfp8

# Every finite non-negative E4M3 value, indexed by its bit pattern 0x00..0x7E.
E4M3_POS = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _brute_force(x_row: torch.Tensor) -> tuple[int, list[int]]:
    """One block of 32 by the words of the rule: exponent by search, elements by nearest-even."""
    xs = x_row.double().tolist()
    amax = max(abs(v) for v in xs)
    exp = -127
    while exp < 127 and amax > E4M3_MAX * 2.0**exp:
        exp += 1
    codes = []
    for v in xs:
        q = min(abs(v) / 2.0**exp, E4M3_MAX)
        dist = (E4M3_POS - q).abs()
        best = torch.nonzero(dist == dist.min()).flatten()
        code = int(best[0]) if len(best) == 1 or int(best[0]) % 2 == 0 else int(best[1])
        if math.copysign(1.0, v) < 0:
            code |= 0x80
        codes.append(code)
    return exp + 127, codes


def _edge_blocks() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    blocks = [
        torch.zeros(32),
        torch.full((32,), 448.0),
        torch.full((32,), -448.0 * 2.0**-3),
        torch.randn(32, generator=g) * (3e38 / 4),  # huge: near fp32 max
        torch.randn(32, generator=g) * 1e-40,  # fp32 subnormals only
        torch.randn(32, generator=g) * torch.logspace(-30, 30, 32),  # mixed magnitudes
        torch.linspace(-1, 1, 32) * 448.0 * (1 + 2.0**-20),  # amax just above 448
        torch.randn(32, generator=g).to(torch.bfloat16).float() * 2.0**-133,  # bf16 subnormal range
    ]
    ties = torch.arange(32).float() * 0.125 + 0.0625  # exact midpoints between E4M3 neighbours at scale 1
    ties[-1] = 448.0
    blocks.append(ties)
    return torch.stack(blocks)


@pytest.mark.parametrize("kind", ["edge", "random"])
def test_matches_brute_force(kind):
    if kind == "edge":
        x = _edge_blocks()
    else:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(12, 32, generator=g) * torch.exp(torch.randn(12, 1, generator=g) * 8)
    mx = to_mxfp8(x)
    for i in range(x.shape[0]):
        scale_bits, codes = _brute_force(x[i])
        assert int(_bits(mx.scale)[i, 0]) == scale_bits, f"block {i}"
        assert _bits(mx.data)[i].tolist() == codes, f"block {i}"


def test_scale_rounds_up_and_zero_block_gets_smallest_scale():
    x = torch.zeros(3, 32)
    x[1, 0] = 448.0  # exactly representable at scale 2^0
    x[2, 0] = 448.0 * (1 + 2.0**-23)  # one ulp above: the scale doubles
    scale = _bits(to_mxfp8(x).scale)[:, 0].tolist()
    assert scale == [0, 127, 128]


def test_no_element_exceeds_448_and_roundtrip_of_representable_values():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 256, generator=g) * 1e4
    mx = to_mxfp8(x)
    assert mx.data.float().abs().max() <= E4M3_MAX
    # A block's amax may shrink in quantization (then its scale does too): compare values.
    assert torch.equal(to_mxfp8(mx.dequantize()).dequantize(), mx.dequantize())


def test_nan_and_inf_poison_their_block_only():
    x = torch.randn(4, 64)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    x[2, 0] = -float("inf")
    mx = to_mxfp8(x)
    s = _bits(mx.scale)
    assert s[0].tolist()[0] == 0xFF and s[1].tolist()[1] == 0xFF and s[2].tolist()[0] == 0xFF
    assert s[0, 1] != 0xFF and s[1, 0] != 0xFF and (s[3] != 0xFF).all()
    deq = mx.dequantize()
    assert deq[0, :32].isnan().all() and deq[1, 32:].isnan().all() and deq[2, :32].isnan().all()
    assert torch.isfinite(deq[0, 32:]).all() and torch.isfinite(deq[3]).all()


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_dim_is_a_transpose_and_bf16_input(dim):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 96, generator=g) * 10).to(torch.bfloat16)
    mx = to_mxfp8(x, dim=dim)
    ref = to_mxfp8(x.movedim(dim, -1).contiguous(), dim=-1)
    assert mx.data.shape == x.shape
    assert torch.equal(_bits(mx.data).movedim(dim, -1), _bits(ref.data))
    assert torch.equal(_bits(mx.scale).movedim(dim, -1), _bits(ref.scale))
    assert torch.equal(fake_quantize_mxfp8(x, dim), mx.dequantize())
    assert isinstance(mx, MXTensor) and mx.dim == dim % 2


@pytest.mark.parametrize("dim", [0, 1])
def test_mma_order_places_each_thread_pairs_together(dim):
    """MMA order stores block element k = 16c + 8h + 2t + l at 8t + 4c + 2h + l (the pairs thread t of a quad
    holds in two k16 wgmma steps, adjacent), the scales untouched; dequantize() reads it back."""
    x = (torch.randn(64, 96, generator=torch.Generator().manual_seed(5)) * 10).to(torch.bfloat16)
    mx, index = to_mxfp8(x, dim, mma_order=True), to_mxfp8(x, dim)
    stored, want = _bits(mx.data).movedim(dim, -1), _bits(index.data).movedim(dim, -1)
    for k in range(32):
        c, h, t, l = k // 16, k // 8 % 2, k // 2 % 4, k % 2
        assert torch.equal(stored[..., 32 + 8 * t + 4 * c + 2 * h + l], want[..., 32 + k]), k
    assert torch.equal(_bits(mx.scale), _bits(index.scale))
    assert mx.mma_order and torch.equal(mx.dequantize(), index.dequantize())
    assert torch.equal(_bits(from_mma_order(mx.data, dim)), _bits(index.data))
    assert torch.equal(_bits(to_mma_order(index.data, dim)), _bits(mx.data))


def test_bad_input_errors_name_the_tensor():
    with pytest.raises(ValueError, match=r"w_gate has size 40 along dim 1"):
        to_mxfp8(torch.zeros(3, 40), name="w_gate")
    with pytest.raises(TypeError, match="x must be a floating-point"):
        to_mxfp8(torch.zeros(3, 32, dtype=torch.int32))
