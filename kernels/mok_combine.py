"""Per-token slot arithmetic of the MoK combine (docs/design.md, the combine and the fused path).

Legend: T tokens, K top-k (slots per token), H hidden.

- ``slot_reduce``: ``out[t] = cast(Σ_j w[t,j]·slots[t,j] + shared[t])``, the sum in fp32 in
  ascending slot order j (w·row rounded to fp32 first, then added: no FMA contraction, the kernel
  is compiled with ``enable_fp_fusion=False``), rounded once (RNE) to the output dtype. Without
  weights it is the backward of dispatch: ``dx[t] = cast(Σ_j dslots[t,j])``. Optionally writes
  the slots it read to ``copy_TKH`` (the rows combine's backward keeps).
- ``slot_scale``: ``dy[t,j] = cast(w[t,j]·dout[t])`` (the rows the experts pull in backward).

Both equal their references bit for bit (``ref_slot_reduce``, ``ref_slot_scale``: the reference backend's
combine, ``titan_mok.moe.dispatch``): same operations, same order, one rounding each.
"""

import torch
import triton
import triton.language as tl

from titan_mok.kernels.grouped_tiles import _bf16_rne

_BLOCK_H = 1024


def ref_slot_reduce(slots_TKH: torch.Tensor, weights_TK: torch.Tensor | None, shared_TH: torch.Tensor | None,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """out[t] = Σ_j (w[t,j] ·) slots[t,j] (ascending j) + shared[t], in fp32, cast once: the reference backend's
    combine (and, without weights and shared, its dispatch backward)."""
    acc_TH = None
    for j in range(slots_TKH.shape[1]):
        term_TH = slots_TKH[:, j].float()
        if weights_TK is not None:
            term_TH = weights_TK[:, j : j + 1] * term_TH
        acc_TH = term_TH if acc_TH is None else acc_TH + term_TH
    if shared_TH is not None:
        acc_TH = acc_TH + shared_TH.float()
    return acc_TH.to(out_dtype)


def ref_slot_scale(weights_TK: torch.Tensor, dout_TH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dy[t, j] = w[t, j] · dout[t] in fp32, rounded once to dtype: the reference backend's combine backward."""
    return (weights_TK.unsqueeze(-1) * dout_TH.float().unsqueeze(1)).to(dtype)


@triton.jit
def _round_to(x, out_ptr):
    if out_ptr.dtype.element_ty == tl.bfloat16:
        return _bf16_rne(x)
    return x.to(out_ptr.dtype.element_ty)


@triton.jit
def _slot_term(slots_ptr, w_ptr, copy_ptr, t, j, cols, ok, H, K: tl.constexpr, HAS_W: tl.constexpr,
               HAS_COPY: tl.constexpr):
    """(w[t,j] ·) slots[t,j] in fp32 (one rounding), copying the row out on the way."""
    row = tl.load(slots_ptr + (t * K + j) * H + cols, mask=ok, other=0.0)
    if HAS_COPY:
        tl.store(copy_ptr + (t * K + j) * H + cols, row, mask=ok)
    term = row.to(tl.float32)
    if HAS_W:
        term = tl.load(w_ptr + t * K + j) * term
    return term


@triton.jit
def _slot_reduce_kernel(slots_ptr, w_ptr, shared_ptr, out_ptr, copy_ptr, H,
                        K: tl.constexpr, HAS_W: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_COPY: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = _slot_term(slots_ptr, w_ptr, copy_ptr, t, 0, cols, ok, H, K, HAS_W, HAS_COPY)
    for j in tl.static_range(1, K):  # ascending slot order, fp32 adds (no FMA: enable_fp_fusion=False)
        acc = acc + _slot_term(slots_ptr, w_ptr, copy_ptr, t, j, cols, ok, H, K, HAS_W, HAS_COPY)
    if HAS_SHARED:
        acc = acc + tl.load(shared_ptr + t * H + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, _round_to(acc, out_ptr), mask=ok)


@triton.jit
def _slot_scale_kernel(w_ptr, dout_ptr, dy_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    dout = tl.load(dout_ptr + t * H + cols, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        tl.store(dy_ptr + (t * K + j) * H + cols, _round_to(tl.load(w_ptr + t * K + j) * dout, dy_ptr), mask=ok)


def _check_tk(name: str, t: torch.Tensor | None, shape: tuple, dtype: torch.dtype | None = None) -> None:
    if t is None:
        return
    if tuple(t.shape) != shape or not t.is_contiguous() or (dtype is not None and t.dtype != dtype):
        raise ValueError(f"{name} must be contiguous {dtype or ''} {list(shape)}, got {t.dtype} {tuple(t.shape)}")


def slot_reduce(slots_TKH: torch.Tensor, weights_TK: torch.Tensor | None, shared_TH: torch.Tensor | None,
                out_dtype: torch.dtype, copy_TKH: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H] in out_dtype: Σ_j (w[t,j]·) slots[t,j] (+ shared[t]) in fp32, ascending j (module docstring)."""
    num_tokens, top_k, dim = slots_TKH.shape
    _check_tk("slots_TKH", slots_TKH, (num_tokens, top_k, dim))
    _check_tk("weights_TK", weights_TK, (num_tokens, top_k), torch.float32)
    _check_tk("shared_TH", shared_TH, (num_tokens, dim))
    _check_tk("copy_TKH", copy_TKH, (num_tokens, top_k, dim), slots_TKH.dtype)
    out_TH = torch.empty(num_tokens, dim, dtype=out_dtype, device=slots_TKH.device)
    if num_tokens:
        grid = (num_tokens, triton.cdiv(dim, _BLOCK_H))
        _slot_reduce_kernel[grid](
            slots_TKH, weights_TK if weights_TK is not None else slots_TKH,
            shared_TH if shared_TH is not None else slots_TKH, out_TH,
            copy_TKH if copy_TKH is not None else slots_TKH, dim,
            K=top_k, HAS_W=weights_TK is not None, HAS_SHARED=shared_TH is not None, HAS_COPY=copy_TKH is not None,
            BLOCK_H=_BLOCK_H, enable_fp_fusion=False,
        )
    return out_TH


def slot_scale(weights_TK: torch.Tensor, dout_TH: torch.Tensor, dy_TKH: torch.Tensor) -> None:
    """dy_TKH[t, j] = cast(w[t,j]·dout[t]) in dy's dtype, in place (the combine's input gradient)."""
    num_tokens, top_k, dim = dy_TKH.shape
    _check_tk("weights_TK", weights_TK, (num_tokens, top_k), torch.float32)
    _check_tk("dout_TH", dout_TH, (num_tokens, dim))
    _check_tk("dy_TKH", dy_TKH, (num_tokens, top_k, dim))
    if num_tokens:
        _slot_scale_kernel[(num_tokens, triton.cdiv(dim, _BLOCK_H))](weights_TK, dout_TH, dy_TKH, dim, K=top_k,
                                                                      BLOCK_H=_BLOCK_H)
