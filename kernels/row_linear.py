"""fp32 ``a_MK @ b_KN`` in one Triton launch, row-batch-invariant: the CUDA path of
``row_tiles.row_invariant_linear`` for fp32 operands (the router's logits, Qwen3.5's shared-expert gate).

Legend: M rows, K reduction, N output features.

Why a kernel: the reference (``row_tiles.tiled_mm``) calls one GEMM per 64-row tile so that cuBLAS's
shape-dependent algorithm choice sees the same M for every row; at 2048 tokens that is 32 launches
(and as many more in the backward), about 3 ms of host time per Qwen3.5 layer forward on an H100
against 0.5 ms of GPU time, so the layer waited on the host. Here each output element is one fp32
FMA chain over K in ascending order (``input_precision="ieee"``: no TF32), BLOCK_K at a time, the
same for every row whatever M, the tile or the program: a row's bits depend only on that row.
fp32 only: bf16 GEMMs keep cuBLAS on row tiles (tensor cores, and what RL's invariant layers use).
"""

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_K = 64, 32


@triton.jit
def _row_linear_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bk, stride_bn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(b_ptr + ks[:, None].to(tl.int64) * stride_bk + cols[None, :].to(tl.int64) * stride_bn,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def row_linear_fp32(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """c_MN = a_MK @ b_KN in fp32 (a row-major; b any strides, e.g. a weight's transpose), one launch."""
    if a_MK.dtype != torch.float32 or b_KN.dtype != torch.float32:
        raise TypeError(f"row_linear_fp32: a and b must be float32, got {a_MK.dtype} and {b_KN.dtype}")
    if a_MK.dim() != 2 or b_KN.dim() != 2 or a_MK.shape[1] != b_KN.shape[0]:
        raise ValueError(f"row_linear_fp32: a {tuple(a_MK.shape)} and b {tuple(b_KN.shape)} must be [M, K] and [K, N]")
    a_MK = a_MK.contiguous()
    (num_rows, k), n = a_MK.shape, b_KN.shape[1]
    c_MN = torch.empty(num_rows, n, dtype=torch.float32, device=a_MK.device)
    if num_rows == 0 or n == 0:
        return c_MN
    if k == 0:
        return c_MN.zero_()
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    grid = (triton.cdiv(num_rows, BLOCK_M), triton.cdiv(n, block_n))
    _row_linear_kernel[grid](a_MK, b_KN, c_MN, num_rows, n, k, a_MK.stride(0), b_KN.stride(0), b_KN.stride(1),
                             BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=4)
    return c_MN
