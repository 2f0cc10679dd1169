"""Both MXFP8 layouts from one read (kernels/mxfp8_quant_both.py): the single-layout kernels' tensors, bit for bit.

On CPU the kernels run in Triton's interpreter (small sizes); on a GPU at Kimi's size.
"""

import pytest
import torch

from titan_mok.kernels.mxfp8_quant import mxfp8_quantize, mxfp8_quantize_transposed
from titan_mok.kernels.mxfp8_quant_both import mxfp8_quantize_both, ref_mxfp8_quantize_both

from tests.kernels.test_mxfp8_quant import DEVICE, _edge_tensor, assert_same_mx


def assert_same_tensors(name, got, want):
    """Same MXTensor fields, shapes, strides and bits."""
    for part in ("data", "scale"):
        a, b = getattr(got, part), getattr(want, part)
        assert a.dtype == b.dtype and a.stride() == b.stride(), f"{name}.{part}: {a.dtype} {a.stride()} vs " \
                                                                f"{b.dtype} {b.stride()}"
    assert_same_mx(name, got, want)


def assert_both_as_single(w, mma_order, reference=True, **kw):
    """mxfp8_quantize_both(w) against the two single-layout quantizers and (``reference``) the definition."""
    rows, cols = mxfp8_quantize_both(w, "w", mma_order=mma_order, **kw)
    assert_same_tensors("along Y", rows, mxfp8_quantize(w, 2, "w", mma_order=mma_order))
    assert_same_tensors("along X, transposed", cols, mxfp8_quantize_transposed(w, "w", mma_order=mma_order))
    if reference:
        for label, got, want in zip(("along Y", "along X"), (rows, cols), ref_mxfp8_quantize_both(w, "w", mma_order)):
            assert_same_mx(f"{label} vs reference", got, want)


def _weight(shape, seed) -> torch.Tensor:
    """bf16 [E, X, Y] over 8 decades along Y, with zero blocks, bf16 subnormals, huge values and NaN/Inf blocks
    along either dim."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[-1])
    w[0, :32, :32] = 0.0  # a zero block both ways
    w[-1, 32:64, :] *= 2.0**-133  # bf16 subnormals
    w[-1, :, 32:64] *= 2.0**100  # huge
    w[0, 40, 70], w[-1, 65, 3], w[-1, 2, 33] = float("nan"), float("inf"), -float("inf")
    return w.to(torch.bfloat16).to(DEVICE)


# X, Y multiples of 32 but not of the default tile's sides (64, 128), both weights' orientations
@pytest.mark.parametrize("shape", [(3, 96, 160), (2, 160, 96)], ids=["w_gate_EIH", "w_down_EHI"])
@pytest.mark.parametrize("mma_order", [True, False], ids=["mma", "index"])
def test_both_layouts_equal_the_single_kernels_bits(shape, mma_order):
    """Against the definition too on a GPU: Triton 3.6's interpreter casts bf16 subnormals to fp32 as zero or
    2^-126 (the single-layout kernels' bits there too); test_edge_values_fp32 holds subnormals to it."""
    assert_both_as_single(_weight(shape, seed=0), mma_order, reference=DEVICE == "cuda")


def test_edge_values_fp32():
    """fp32 weights holding every edge block along either dim (fp32 subnormals, near fp32 max, ties)."""
    x = _edge_tensor(DEVICE)  # [64, 96]
    assert_both_as_single(torch.stack([x, -x.flip(1)]), mma_order=True)


@pytest.mark.parametrize("tile", [(32, 32, 1), (128, 64, 8)])
def test_other_tiles_same_bits(tile):
    """The tiles the benchmark times write the default tile's bits (a tile larger than the weight included)."""
    w = _weight((2, 96, 96), seed=1)
    assert_both_as_single(w, mma_order=True, reference=False, tile=tile)


def test_bad_inputs_name_what_is_allowed():
    with pytest.raises(ValueError, match=r"w_up: mxfp8_quantize_both takes a 3-D weight \[E, X, Y\]"):
        mxfp8_quantize_both(torch.zeros(64, 64), "w_up")
    with pytest.raises(ValueError, match="w_down has size 48 along dim 1"):
        mxfp8_quantize_both(torch.zeros(2, 48, 64), "w_down")
    with pytest.raises(ValueError, match="w_gate has size 80 along dim 2"):
        mxfp8_quantize_both(torch.zeros(2, 64, 80), "w_gate")
    with pytest.raises(ValueError, match="tile BY must be a power of two >= 32, got 96"):
        mxfp8_quantize_both(torch.zeros(2, 64, 64), tile=(64, 96, 4))
    with pytest.raises(ValueError, match="tile warps must be one of 1, 2, 4, 8, 16, got 3"):
        mxfp8_quantize_both(torch.zeros(2, 64, 64), tile=(64, 64, 3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(160, 2048, 7168), (8, 7168, 2048)], ids=["w_gate_EIH", "w_down_EHI"])
def test_kimi_size_gpu(shape):
    """Kimi's expert weights (I 2048, H 7168); 160 experts put the offsets past 2^31 elements."""
    g = torch.Generator(device="cuda").manual_seed(6)
    w = torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)  # in bf16: 4.7 GB, not fp32's 9.4
    w *= torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16).mul_(4).exp_()
    w.view(-1)[::997] = 0.0
    w.view(-1)[::1_000_003] = float("nan")
    rows, cols = mxfp8_quantize_both(w, "w", mma_order=True)
    assert_same_tensors("along Y", rows, mxfp8_quantize(w, 2, "w", mma_order=True))
    assert_same_tensors("along X, transposed", cols, mxfp8_quantize_transposed(w, "w", mma_order=True))
