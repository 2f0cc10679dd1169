"""kernels/row_linear.py: the fp32 row-invariant GEMM (the router's logits on CUDA). A row's bits do not depend
on the rows around it (bitwise), the values are the fp32 product's, and row_invariant_linear's autograd takes
it on CUDA. CPU: Triton's interpreter; GPU: the compiled kernel."""

import pytest
import torch

from titan_mok.kernels.row_linear import row_linear_fp32
from titan_mok.kernels.row_tiles import row_invariant_linear

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # CPU: the interpreter


def _inputs(num_rows, k, n, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x_MK = torch.randn(num_rows, k, generator=gen).to(device)
    w_NK = torch.randn(n, k, generator=gen).to(device) * 0.05
    return x_MK, w_NK


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,n", [(96, 40), (200, 1), (64, 130)])
def test_rows_are_batch_invariant(device, k, n):
    x_MK, w_NK = _inputs(150, k, n, device)
    whole_MN = row_linear_fp32(x_MK, w_NK.t())
    for lo, hi in [(0, 1), (3, 70), (70, 150), (149, 150)]:
        assert torch.equal(row_linear_fp32(x_MK[lo:hi], w_NK.t()), whole_MN[lo:hi]), (lo, hi)
    perm = torch.randperm(150, generator=torch.Generator().manual_seed(1)).to(device)
    assert torch.equal(row_linear_fp32(x_MK[perm], w_NK.t()), whole_MN[perm])
    ref_MN = (x_MK.double() @ w_NK.double().t()).float()
    torch.testing.assert_close(whole_MN, ref_MN, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_and_plain_b(device):
    x_MK, w_NK = _inputs(33, 80, 48, device)
    # b as a weight's transpose (strides (1, K)) and as a contiguous [K, N]: the same values, the same bits
    assert torch.equal(row_linear_fp32(x_MK, w_NK.t()), row_linear_fp32(x_MK, w_NK.t().contiguous()))


@pytest.mark.parametrize("device", DEVICES)
def test_edge_sizes_and_errors(device):
    x_MK, w_NK = _inputs(5, 16, 8, device)
    assert row_linear_fp32(x_MK[:0], w_NK.t()).shape == (0, 8)
    assert torch.equal(row_linear_fp32(x_MK[:, :0], w_NK[:, :0].t()), torch.zeros(5, 8, device=device))
    with pytest.raises(TypeError, match="float32"):
        row_linear_fp32(x_MK.bfloat16(), w_NK.t())
    with pytest.raises(ValueError, match=r"\[M, K\] and \[K, N\]"):
        row_linear_fp32(x_MK, w_NK)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_linear_on_cuda_is_row_invariant_with_grads():
    """row_invariant_linear on fp32 CUDA tensors: forward and input gradient through the kernel, batch-invariant,
    and the weight gradient one GEMM (as on CPU)."""
    x_MK, w_NK = _inputs(2048, 7168, 384, "cuda")
    dy_MN = torch.randn(2048, 384, device="cuda")

    def run(lo, hi):
        x = x_MK[lo:hi].clone().requires_grad_()
        y = row_invariant_linear(x, w_NK)
        y.backward(dy_MN[lo:hi])
        return y, x.grad

    y_all, dx_all = run(0, 2048)
    for lo, hi in [(0, 1), (1, 300), (300, 2048)]:
        y, dx = run(lo, hi)
        assert torch.equal(y, y_all[lo:hi]) and torch.equal(dx, dx_all[lo:hi]), (lo, hi)
    torch.testing.assert_close(y_all, (x_MK.double() @ w_NK.double().t()).float(), rtol=1e-4, atol=1e-4)
