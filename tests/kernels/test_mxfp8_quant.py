"""Triton MXFP8 quantization (kernels/mxfp8_quant.py) equals the reference bit for bit.

On CPU the kernels run in Triton's interpreter (small sizes); on a GPU at real sizes.
"""

import pytest
import torch
import triton
import triton.language as tl

from titan_mok.kernels.mxfp8_quant import (
    WIDE_SCALE_BITS,
    mx_dequantize_bits,
    mx_dequantize_bits_sm90,
    mxfp8_fake_quantize,
    mxfp8_quantize,
    mxfp8_quantize_transposed,
    ref_mxfp8_fake_quantize,
    ref_mxfp8_quantize,
)

from tests.kernels.test_mxfp8 import _edge_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_same_mx(name, tri, ref):
    assert tri.dim == ref.dim and tri.mma_order == ref.mma_order, name
    for part in ("data", "scale"):
        a, b = getattr(tri, part).view(torch.uint8), getattr(ref, part).view(torch.uint8)
        assert a.shape == b.shape, f"{name}.{part}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        bad = (a != b).nonzero()
        assert bad.numel() == 0, f"{name}.{part}: {bad.shape[0]} mismatches, first at {bad[0].tolist()}"


def _edge_tensor(device) -> torch.Tensor:
    """[64, 96] fp32 whose 32-blocks along either dim include every edge block."""
    g = torch.Generator().manual_seed(0)
    blocks = _edge_blocks()  # [nb, 32]
    x = torch.randn(64 * 96, generator=g) * 100
    x[: blocks.numel()] = blocks.flatten()
    x = x.reshape(64, 96)
    x = torch.cat([x[:32], x[:32].t()[:32].repeat(1, 3)])  # edge blocks along rows and columns
    x[3, 7], x[40, 50], x[5, 90] = float("nan"), float("inf"), -float("inf")
    return x.to(device)


@pytest.mark.parametrize("dim", [0, 1])
def test_edge_values_2d(dim):
    x = _edge_tensor(DEVICE)
    assert_same_mx(f"edge dim={dim}", mxfp8_quantize(x, dim), ref_mxfp8_quantize(x, dim))


@pytest.mark.parametrize("dim", [-1, 1, 0])
def test_bf16_weights_3d(dim):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(2, 64, 96, generator=g) * torch.logspace(-4, 4, 96)).to(torch.bfloat16).to(DEVICE)
    if dim == 0:
        w = w.reshape(64, 96, 2)  # blocked along a leading dim, Q = 192
    assert_same_mx(f"w dim={dim}", mxfp8_quantize(w, dim), ref_mxfp8_quantize(w, dim))


@pytest.mark.parametrize("shape", [(2, 64, 96), (3, 96, 48)])
def test_quantize_transposed_bits(shape):
    """One pass over w [E, X, Y] gives to_mxfp8(w^T, 2) with contiguous [E, Y, X] data and [E, Y, X/32] scales."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[-1])).to(torch.bfloat16).to(DEVICE)
    w[0, :32, 0] = float("nan")  # one bad block: NaN scale, 0x7F elements
    mx = mxfp8_quantize_transposed(w, "w")
    assert mx.data.is_contiguous() and mx.data.shape == (shape[0], shape[2], shape[1])
    assert mx.scale.is_contiguous()
    assert_same_mx(f"w^T {shape}", mx, ref_mxfp8_quantize(w.transpose(1, 2).contiguous(), 2))


@pytest.mark.parametrize("dim", [2, 1])
def test_quantize_in_mma_order_bits(dim):
    """mma_order: the rows kernel (dim 2) and the columns kernel (dim 1, and the transposed pass) store each block's
    elements in MMA order, bit-identical to to_mxfp8(..., mma_order=True); the values are the index-order ones."""
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(2, 96, 64, generator=g) * torch.logspace(-4, 4, 64)).to(torch.bfloat16).to(DEVICE)
    w[1, :32, 5] = float("nan")
    mx = mxfp8_quantize(w, dim, mma_order=True)
    assert_same_mx(f"w dim={dim}", mx, ref_mxfp8_quantize(w, dim, mma_order=True))
    index = ref_mxfp8_quantize(w, dim)
    assert torch.equal(mx.dequantize().nan_to_num(7.0), index.dequantize().nan_to_num(7.0))
    if dim == 1:
        assert_same_mx("w^T", mxfp8_quantize_transposed(w, "w", mma_order=True),
                       ref_mxfp8_quantize(w.transpose(1, 2).contiguous(), 2, mma_order=True))


def test_fake_quantize_bits():
    """The bf16 operand form (q * 2^e) an MXFP8 GEMM reads: bit-exact down to bf16's smallest
    normal (2^-126); below it (blocks with amax < ~2^-117) a backend may flush or round the
    subnormal product differently, so there only |value| < 2^-125 is required."""
    x = _edge_tensor(DEVICE)
    tri, ref = mxfp8_fake_quantize(x), ref_mxfp8_fake_quantize(x)
    assert tri.dtype == torch.bfloat16
    tiny = ref.float().abs() < 2.0**-126
    same = (tri.view(torch.int16) == ref.view(torch.int16)) | (tri.isnan() & ref.isnan())
    same |= tiny & (tri.float().abs() < 2.0**-125)
    assert same.all(), f"{(~same).sum()} mismatches, first at {(~same).nonzero()[0].tolist()}"
    assert (~tiny).sum() > 0.4 * x.numel()  # most values are checked bit for bit


def test_bad_dim_size_names_the_tensor():
    with pytest.raises(ValueError, match="w_down has size 48 along dim 1"):
        mxfp8_quantize(torch.zeros(2, 48, 64, device=DEVICE), 1, name="w_down")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape,dim", [((4, 2048, 7168), -1), ((4, 2048, 7168), 1), ((5120, 7168), 0), ((5120, 3072), 1)])
def test_real_sizes_gpu(shape, dim):
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(shape, device="cuda", generator=g) * torch.exp(torch.randn(shape, device="cuda", generator=g) * 4)
    x = x.to(torch.bfloat16)
    x.view(-1)[:: 997] = 0.0
    assert_same_mx(f"{shape} dim={dim}", mxfp8_quantize(x, dim), ref_mxfp8_quantize(x, dim))
    if x.dim() == 3:  # an expert weight: also as weight_operand quantizes it
        assert_same_mx(f"{shape} dim={dim} MMA order", mxfp8_quantize(x, dim, mma_order=True),
                       ref_mxfp8_quantize(x, dim, mma_order=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mma_order", [False, True])
def test_quantize_transposed_real_size_gpu(mma_order):
    g = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.randn(4, 2048, 7168, device="cuda", generator=g) * 0.02).to(torch.bfloat16)  # [E, I, H] gate weight
    assert_same_mx("w^T", mxfp8_quantize_transposed(w, "w", mma_order=mma_order),
                   ref_mxfp8_quantize(w.transpose(1, 2).contiguous(), 2, mma_order=mma_order))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_more_than_2_pow_31_elements_gpu():
    """Offsets past 2^31 elements (a [192, 2048, 7168] expert weight): compare the last rows."""
    x = torch.randn(2**31 // 7168 + 64, 7168, device="cuda", dtype=torch.bfloat16)
    tail = slice(x.shape[0] - 64, None)
    mx = mxfp8_quantize(x, -1)
    assert_same_mx("tail", type(mx)(mx.data[tail], mx.scale[tail], 1), ref_mxfp8_quantize(x[tail], -1))
    assert torch.equal(mxfp8_fake_quantize(x)[tail], ref_mxfp8_fake_quantize(x[tail]))


@triton.jit
def _dequantize_both(q_ptr, bits_ptr, ref_ptr, out_ptr, wide, WORDS: tl.constexpr):
    """Rows of 32 E4M3 codes with a scale each, through mx_dequantize_bits and mx_dequantize_bits_sm90."""
    rows = tl.program_id(0) * 64 + tl.arange(0, 64)
    off = rows[:, None] * 32 + tl.arange(0, 32)[None, :]
    q, bits = tl.load(q_ptr + off), tl.load(bits_ptr + rows)
    tl.store(ref_ptr + off, mx_dequantize_bits(q, bits, 1))
    tl.store(out_ptr + off, mx_dequantize_bits_sm90(q, bits, 1, wide != 0, WORDS))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("words", [True, False])
def test_sm90_dequantize_matches_reference_bits_gpu(words):
    """mx_dequantize_bits_sm90 (inline PTX) against mx_dequantize_bits over every (E4M3 code, E8M0 scale) pair:
    with ``wide`` the same bits everywhere but at the E4M3 NaN codes under a finite scale (which to_mxfp8 never
    writes: its NaN elements sit in NaN-scale blocks); without it the same for every scale up to 2^7."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(8, 32)
    q = codes.repeat(256, 1).cuda().view(torch.float8_e4m3fn)  # scale b on rows 8b .. 8b + 7
    bits = torch.arange(256, dtype=torch.int32).repeat_interleave(8).to(torch.uint8).cuda()
    nan_code = ((codes.repeat(256, 1).int() & 0x7F) == 0x7F).cuda()
    finite_scale = (bits != 255)[:, None]
    for wide in (1, 0):
        ref, out = (torch.empty(2048, 32, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        _dequantize_both[(32,)](q, bits, ref, out, wide, words)
        checked = ~(nan_code & finite_scale)
        if not wide:
            checked &= (bits <= WIDE_SCALE_BITS.value)[:, None]
        assert checked.sum() > 60000 if wide else checked.sum() > 34000
        same = (out.view(torch.int16) == ref.view(torch.int16)) | (out.isnan() & ref.isnan())
        bad = (~same & checked).nonzero()
        assert bad.numel() == 0, f"wide={wide}: {bad.shape[0]} differ, first (row, col) {bad[0].tolist()}"
        if not wide:  # past 2^7 the one multiply is not enough: the flag is needed
            assert not same[(bits > WIDE_SCALE_BITS.value) & (bits < 255)].all()
