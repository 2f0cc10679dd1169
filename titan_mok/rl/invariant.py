"""Batch-invariant replacements for the two ops of a decoder whose per-row bits
depend on the batch around the row: the dense projections and attention.

Legend: B batch, N heads, Q queries, K keys (the KV-cache length), E q/k head
dim, D v head dim, M rows, TQ queries per attention tile.

Why: the rollout decodes one token per sequence against a KV cache, the trainer
recomputes every position of a padded batch at once. For the recorded logprobs
to equal the recomputed ones bit for bit (docs/design.md §8), every row must meet the
same kernels, the same shapes and the same reduction order in both passes:

- ``F.linear`` → ``titan_mok.kernels.row_tiles.row_invariant_linear`` (every GEMM has
  ``TILE_M`` rows; a one-row product would take the GEMV path). Cost: the
  zero-padded last tile (up to 63 wasted rows per call; a decode step of B
  sequences computes ``64·ceil(B/64)`` rows).
- ``F.scaled_dot_product_attention`` → :func:`invariant_attention`: scores and
  probabilities·values as batched GEMMs of one fixed shape ``[TQ, E] × [E, K]``
  per (batch, head) tile; the softmax runs over all K keys of the cache (the
  trainer pads sequences to the same K) with masked keys set to ``-inf``, so a
  row's sum sees the same values in the same order whatever the cache fill.
  Cost: no fused/flash kernel — the ``[B, N, TQ, K]`` score tile is materialised
  (O(Q·K) memory per head) and a decode step computes a full ``TQ``-row tile.

- ``mean`` over the last dim (RMSNorm's ``mean(x²)``) → the same mean on
  ``TILE_M``-row tiles: a GPU reduction's thread layout, hence its summation
  order, depends on how many rows it reduces. Cost: the padded last tile.

The MoE layer is batch-invariant by construction (``titan_mok.kernels.row_tiles``);
RoPE, embeddings and residual adds are elementwise and need no replacement (the
parity tests check the whole path, bit for bit).
"""

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from titan_mok.kernels.row_tiles import autocast_dtype, map_row_tiles, row_invariant_linear

TILE_Q = 16
"""Queries per attention GEMM tile (fixed: a decode step pads its one query to it)."""


def _is_plain(*tensors) -> bool:
    # DTensors (TP-sharded weights) keep their own dispatch; FSDP hands plain tensors to forward.
    return all(t is None or type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def invariant_linear(x_xK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose output rows do not depend on the other rows of ``x``; under autocast in its
    dtype, as ``F.linear`` (this mode sees the operands before autocast would cast them)."""
    dtype = autocast_dtype(x_xK)
    x_xK, weight_NK = x_xK.to(dtype), weight_NK.to(dtype)
    bias_N = bias_N.to(dtype) if bias_N is not None else None
    lead = x_xK.shape[:-1]
    y_MN = row_invariant_linear(x_xK.reshape(-1, x_xK.shape[-1]), weight_NK)  # [..., K] -> [M, N]
    if bias_N is not None:
        y_MN = y_MN + bias_N
    return y_MN.view(*lead, weight_NK.shape[0])


def _is_last_dim_mean(x, dim=None, keepdim=False, *, dtype=None) -> bool:
    return dtype is None and isinstance(x, torch.Tensor) and x.dim() >= 2 and dim in (-1, x.dim() - 1, [-1], (-1,))


def invariant_last_dim_mean(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """``x.mean(-1, keepdim)`` computed on ``TILE_M``-row tiles (row-batch-invariant)."""
    mean_M1 = map_row_tiles(lambda rows: rows.mean(-1, keepdim=True), x.reshape(-1, x.shape[-1]))  # [..., H] -> [M, 1]
    return mean_M1.view(*x.shape[:-1], 1) if keepdim else mean_M1.view(x.shape[:-1])


def invariant_attention(
    q_BNQE: torch.Tensor,
    k_BNKE: torch.Tensor,
    v_BNKD: torch.Tensor,
    scale: float,
    q_start: int | torch.Tensor,
    keep_BNQK: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of Q consecutive queries per sequence, the first at position
    ``q_start`` (an int, or a ``[B]`` tensor when Q = 1), to keys at positions
    0..K-1: the query at position p sees key j iff ``j <= p`` (and ``keep``).

    The query at position p always sits in row ``p mod TILE_Q`` of a ``TILE_Q``-row
    tile — where the trainer's full pass puts it — so its bits depend only on its
    own row, the keys and values, and p: not on Q, B, or its batch-mates."""
    bsz, n_heads, n_q, e_dim = q_BNQE.shape
    n_k, d_dim = k_BNKE.shape[2], v_BNKD.shape[-1]
    device = q_BNQE.device
    if isinstance(q_start, int):
        if n_q > 1 and q_start % TILE_Q:
            raise ValueError(
                f"invariant_attention: {n_q} queries must start at a multiple of TILE_Q = {TILE_Q}, got {q_start}"
            )
        q_start = torch.full((bsz,), q_start, device=device)
    elif n_q != 1 or q_start.shape != (bsz,):
        raise ValueError(f"invariant_attention: a q_start tensor must be [B] = [{bsz}] with one query, got Q = {n_q}")
    slot_BQ = q_start[:, None] % TILE_Q + torch.arange(n_q, device=device)  # row in the tiled query buffer
    n_slots = -(-n_q // TILE_Q) * TILE_Q
    q_pos_BS = (q_start - q_start % TILE_Q)[:, None] + torch.arange(n_slots, device=device)  # empty slots: any position
    q_BNSE = q_BNQE.new_zeros(bsz, n_heads, n_slots, e_dim)
    q_BNSE[torch.arange(bsz, device=device)[:, None], :, slot_BQ] = q_BNQE.transpose(1, 2)  # indexed: [B, Q, N, E]
    if keep_BNQK is not None:
        keep_BNSK = keep_BNQK.new_ones(bsz, n_heads, n_slots, n_k)
        keep_BNSK[torch.arange(bsz, device=device)[:, None], :, slot_BQ] = keep_BNQK.expand(
            bsz, n_heads, n_q, n_k
        ).transpose(1, 2)

    k_pos_K = torch.arange(n_k, device=device)
    k_xEK = k_BNKE.reshape(bsz * n_heads, n_k, e_dim).transpose(1, 2)  # [B·N, E, K]
    v_xKD = v_BNKD.reshape(bsz * n_heads, n_k, d_dim)  # [B·N, K, D]
    out_tiles = []
    for start in range(0, n_slots, TILE_Q):
        q_xTE = q_BNSE[:, :, start : start + TILE_Q].reshape(bsz * n_heads, TILE_Q, e_dim)  # [B·N, TQ, E]
        scores_xTK = torch.bmm(q_xTE, k_xEK).float() * scale
        keep_BNTK = (k_pos_K <= q_pos_BS[:, start : start + TILE_Q, None]).unsqueeze(1)
        if keep_BNQK is not None:
            keep_BNTK = keep_BNTK & keep_BNSK[:, :, start : start + TILE_Q]
        scores_BNTK = scores_xTK.view(bsz, n_heads, TILE_Q, n_k).masked_fill(~keep_BNTK, float("-inf"))
        probs_xTK = torch.softmax(scores_BNTK, dim=-1).to(v_xKD.dtype).view(bsz * n_heads, TILE_Q, n_k)
        out_tiles.append(torch.bmm(probs_xTK, v_xKD).view(bsz, n_heads, TILE_Q, d_dim))
    out_BNSD = torch.cat(out_tiles, dim=2)
    out_BQND = out_BNSD[torch.arange(bsz, device=device)[:, None], :, slot_BQ]  # indexed: [B, Q, N, D]
    return out_BQND.transpose(1, 2)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention``'s signature on :func:`invariant_attention`."""
    if dropout_p != 0.0:
        raise ValueError("BatchInvariantMode: attention with dropout_p > 0 is not supported")
    if enable_gqa:  # query head h reads kv head h // (Nq / Nkv), as SDPA's GQA does
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise ValueError(f"BatchInvariantMode: attention masks must be boolean, got {attn_mask.dtype}")
    if not is_causal and attn_mask is None:
        raise ValueError("BatchInvariantMode: only causal attention is supported (is_causal, or a causal attn_mask)")
    n_q, e_dim, n_k = query.shape[2], query.shape[3], key.shape[2]
    scale = e_dim**-0.5 if scale is None else scale
    # SDPA's causal convention: the Q queries are the last Q of the K positions.
    return invariant_attention(query, key, value, scale, n_k - n_q, attn_mask)


class BatchInvariantMode(TorchFunctionMode):
    """Inside this context, ``F.linear``, ``F.scaled_dot_product_attention`` and
    last-dim ``mean`` on plain tensors run their batch-invariant versions
    (autograd-capable); every other op is untouched. Used by both the rollout and
    the trainer's forward."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and _is_plain(*args, *kwargs.values()):
            return invariant_linear(*args, **kwargs)
        if func is F.scaled_dot_product_attention and _is_plain(*args[:3]):
            return _sdpa(*args, **kwargs)
        if func in (torch.mean, torch.Tensor.mean) and _is_plain(args[0]) and _is_last_dim_mean(*args, **kwargs):
            return invariant_last_dim_mean(*args, **kwargs)
        return func(*args, **kwargs)
