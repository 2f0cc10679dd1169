"""DeepSeek-V4 attention: shared-KV multi-query attention with per-head sinks over
a causal sliding window plus compressed key/value entries.

Legend: B batch, S sequence (queries), H hidden, N query heads, D head dim
(query = shared key/value), R rope dims, W window keys, T compressed entries,
M compression ratio, X entries pooled at once, K positions pooled per entry (M,
or 2M with overlap), P compressor projection width (D, or 2D with overlap),
Q q_lora rank, G output groups, F = N·D/G, L o_lora rank, I indexer heads,
J indexer head dim.

Per layer (``compress_ratio``):
- 0: the sliding window only (plain RoPE, theta 1e4);
- HCA (128): window + every causal compressed entry of non-overlapping 128-token windows;
- CSA (4): window + the lightning indexer's top-k of the compressed entries of
  overlapping 8-token windows (stride 4).
Compressed entry w summarises tokens [w·M, (w+1)·M) and is visible to query t
when w < (t + 1) // M. Compressed layers use YaRN RoPE on theta 1.6e5.

The reference math views each query's window ([B, S, W, D] keys) and scores it
with every compressed entry: [B, N, S, W + T] scores (no sparse kernel). The indexer's Hadamard rotation of q and k (an FP8
quantisation aid in the official inference code) is orthogonal and leaves the
scores unchanged in full precision, so it is omitted (as in transformers); so
are the official code's FP8/FP4 activation-quantisation simulations of the
cached keys and indexer inputs (quantisation-aware-training aids).

The forward is split into per-token pieces (``Attention.project``,
``Attention.project_out``, ``Compressor.project``, ``Indexer.queries``) and pieces
over one sequence's keys (``Compressor.windows``/``pool``, ``Indexer.top``,
``Attention.attend``), so that RL's cached decode step (``titan_mok.rl.cached_dsv4``)
runs these same functions on one new token against cached keys. Every product
whose rows are queries and whose columns are a sequence's compressed entries is
one ``F.linear`` per sequence (:func:`entry_products`), not an einsum over the
batch: under RL's ``BatchInvariantMode`` its rows then do not depend on how many
queries the call has.
"""

import torch
import torch.nn.functional as F
from torch import nn

from titan_mok.models.common.norm import RMSNorm
from titan_mok.models.common.rope import YaRN, apply_rope, rope_cache

from .args import DeepSeekV4ModelArgs


def rope_caches(args: DeepSeekV4ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE caches [max_seq_len, R] for sliding-only layers (plain, rope_theta) and
    compressed layers (YaRN on compress_rope_theta). DeepSeek-V4 does not scale
    cos/sin by YaRN's mscale: mscale = mscale_all_dim makes the factor exactly 1."""
    plain = rope_cache(args.max_seq_len, args.rope_head_dim, args.rope_theta)
    yarn = YaRN(args.rope_factor, args.original_seq_len, args.beta_fast, args.beta_slow, mscale=1.0, mscale_all_dim=1.0)
    return plain, rope_cache(args.max_seq_len, args.rope_head_dim, args.compress_rope_theta, yarn)


def apply_tail_rope(x: torch.Tensor, cache_SR: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last R dims of ``x`` ([B, S, N, D] or [B, S, D]) in interleaved
    pairs by the cache rows [S, R]; ``inverse`` rotates by the negated angles."""
    rope_dim = cache_SR.shape[-1]
    if inverse:
        cos, sin = cache_SR.chunk(2, dim=-1)
        cache_SR = torch.cat([cos, -sin], dim=-1)
    x_BSND = x if x.dim() == 4 else x.unsqueeze(2)  # [B, S, D] -> [B, S, 1, D]
    rotated = apply_rope(x_BSND[..., -rope_dim:], cache_SR, interleaved=True)
    y_BSND = torch.cat([x_BSND[..., :-rope_dim], rotated], dim=-1)
    return y_BSND if x.dim() == 4 else y_BSND.squeeze(2)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def entry_products(rows_BSXC: torch.Tensor, entries_BTC: torch.Tensor) -> torch.Tensor:
    """``rows · entriesᵀ`` per sequence: [B, S, X, C] × [B, T, C] -> [B, S, X, T]. One
    ``F.linear`` per sequence on its S·X rows (BatchInvariantMode's row-tiled GEMM:
    a row's bits do not depend on S; an einsum's GEMM would have M = S·X)."""
    batch, seq_len, n_x, width = rows_BSXC.shape
    return torch.stack(
        [F.linear(rows_SXC.reshape(seq_len * n_x, width), e_TC).view(seq_len, n_x, -1) for rows_SXC, e_TC in zip(rows_BSXC, entries_BTC)]
    )


class Compressor(nn.Module):
    """Summarises every M consecutive tokens into one entry of size ``head_dim``:
    a softmax over the window (per channel) of gate scores plus a learned
    position bias ``ape [M, ·]`` weights the projected tokens; then RMSNorm and
    RoPE at the window's first position. With ``overlap`` (CSA) each token
    projects to two halves: entry w mixes the first half of window w−1 with the
    second half of window w (width 2M, stride M)."""

    def __init__(self, dim: int, head_dim: int, ratio: int, overlap: bool, norm_eps: float):
        super().__init__()
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        width = 2 * head_dim if overlap else head_dim
        self.wkv = nn.Linear(dim, width, bias=False)
        self.wgate = nn.Linear(dim, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width))
        self.norm = RMSNorm(head_dim, norm_eps)

    def forward(self, x_BSH: torch.Tensor, cache_SR: torch.Tensor) -> torch.Tensor:
        """Compressed entries [B, T, head_dim], T = S // M (a trailing partial window is not emitted)."""
        n_win = x_BSH.shape[1] // self.ratio
        if n_win == 0:
            return x_BSH.new_zeros(x_BSH.shape[0], 0, self.head_dim)
        pos_S = torch.arange(n_win * self.ratio, device=x_BSH.device)
        kv_BSP, score_BSP = self.project(x_BSH[:, : n_win * self.ratio], pos_S)
        entry_1T = torch.arange(n_win, device=x_BSH.device)[None]
        return self.pool(*self.windows(kv_BSP, score_BSP, entry_1T), entry_1T, cache_SR, x_BSH.dtype)

    def project(self, x_BSH: torch.Tensor, pos_xS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token, in fp32 (the official code pools in fp32): the projected kv [B, S, P]
        and gate scores [B, S, P] plus ``ape`` at each token's place (``pos mod M``) in its window."""
        x32_BSH = x_BSH.float()
        kv_BSP = F.linear(x32_BSH, self.wkv.weight.float())
        return kv_BSP, F.linear(x32_BSH, self.wgate.weight.float()) + self.ape.float()[pos_xS % self.ratio]

    def windows(self, kv_BSP: torch.Tensor, score_BSP: torch.Tensor, entry_xX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions entry w pools, [B, X, K, D] kv and scores: [w·M, (w+1)·M); with
        overlap, the first halves of [(w−1)·M, w·M) (kv 0, score −inf before position 0)
        then the second halves of [w·M, (w+1)·M)."""
        m, d = self.ratio, self.head_dim
        rows_B11 = torch.arange(kv_BSP.shape[0], device=kv_BSP.device)[:, None, None]
        pos_xXM = entry_xX[..., None] * m + torch.arange(m, device=kv_BSP.device)
        kv_BXMP, score_BXMP = kv_BSP[rows_B11, pos_xXM], score_BSP[rows_B11, pos_xXM]
        if not self.overlap:
            return kv_BXMP, score_BXMP
        before_xXM1 = (pos_xXM < m)[..., None]  # window w−1 starts before position 0
        prev_xXM = (pos_xXM - m).clamp(min=0)
        prev_kv_BXMD = kv_BSP[rows_B11, prev_xXM, :d].masked_fill(before_xXM1, 0.0)
        prev_score_BXMD = score_BSP[rows_B11, prev_xXM, :d].masked_fill(before_xXM1, float("-inf"))
        # [B, X, 2M, D]: previous window's first half, then this window's second half
        return torch.cat([prev_kv_BXMD, kv_BXMP[..., d:]], dim=2), torch.cat([prev_score_BXMD, score_BXMP[..., d:]], dim=2)

    def pool(self, kv_BXKD, score_BXKD, entry_xX, cache_SR, dtype: torch.dtype) -> torch.Tensor:
        """Entries [B, X, D]: the score-softmax-weighted sum of each entry's K positions (fp32),
        cast to the activations' ``dtype``, normalised, rotated by its first position's row."""
        batch, n_x = kv_BXKD.shape[:2]
        compressed_BXD = (kv_BXKD * score_BXKD.softmax(dim=2)).sum(dim=2).to(dtype)
        rope_YR = cache_SR[(entry_xX * self.ratio).expand(batch, n_x).reshape(-1)]  # Y = B·X: per entry
        # [B, X, D] -> [1, B·X, D]: each entry takes its own rotary row
        return apply_tail_rope(self.norm(compressed_BXD).view(1, batch * n_x, -1), rope_YR).view(batch, n_x, -1)

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.wkv.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wgate.weight, mean=0.0, std=0.02)
        nn.init.zeros_(self.ape)
        self.norm.reset_parameters()


class Indexer(nn.Module):
    """Lightning indexer: its own compressor at J dims, I query heads from the
    q_lora residual; score(t, w) = Σ_i weight_i(t) · relu(q_i(t) · k(w)) / sqrt(J·I).
    Returns the visible mask [B, S, T] of each query's top-k causal entries."""

    def __init__(self, args: DeepSeekV4ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.ratio = args.csa_ratio
        self.wq_b = nn.Linear(args.q_lora_rank, args.index_n_heads * args.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(args.dim, args.index_n_heads, bias=False)
        self.compressor = Compressor(args.dim, args.index_head_dim, args.csa_ratio, True, args.norm_eps)

    def forward(self, x_BSH, q_residual_BSQ, cache_SR, causal_ST) -> torch.Tensor:
        q_BSIJ, weights_BSI = self.queries(x_BSH, q_residual_BSQ, cache_SR)
        return self.top(q_BSIJ, weights_BSI, self.compressor(x_BSH, cache_SR), causal_ST)

    def queries(self, x_BSH, q_residual_BSQ, cache_SR) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: rotated query heads [B, S, I, J] and their fp32 weights [B, S, I]."""
        batch, seq_len, _ = x_BSH.shape
        q_BSIJ = apply_tail_rope(self.wq_b(q_residual_BSQ).view(batch, seq_len, self.n_heads, self.head_dim), cache_SR)
        return q_BSIJ, self.weights_proj(x_BSH).float() * self.n_heads**-0.5

    def top(self, q_BSIJ, weights_BSI, k_BTJ, causal_xST) -> torch.Tensor:
        """Each query's top-k of the causal entries ``k_BTJ``; ``causal_xST`` broadcasts to [B, S, T].
        Scores tie exactly where every head's ReLU is 0; which tied entries ``topk`` keeps is its
        algorithm's (as in transformers): on CPU a function of the row alone."""
        scores_BSIT = F.relu(entry_products(q_BSIJ.float(), k_BTJ.float())) * self.head_dim**-0.5
        index_BST = (scores_BSIT * weights_BSI[..., None]).sum(dim=2).masked_fill(~causal_xST, float("-inf"))
        topk_BSK = index_BST.topk(min(self.topk, k_BTJ.shape[1]), dim=-1).indices
        chosen_BST = torch.zeros_like(index_BST, dtype=torch.bool).scatter_(-1, topk_BSK, True)
        return chosen_BST & causal_xST

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.wq_b.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.weights_proj.weight, mean=0.0, std=0.02)
        self.compressor.init_weights(init_std)


class Attention(nn.Module):
    def __init__(self, args: DeepSeekV4ModelArgs, compress_ratio: int):
        super().__init__()
        self.n_heads, self.head_dim, self.eps = args.n_heads, args.head_dim, args.norm_eps
        self.window, self.o_groups = args.sliding_window, args.o_groups
        self.compress_ratio = compress_ratio
        self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * args.head_dim, bias=False)
        self.wkv = nn.Linear(args.dim, args.head_dim, bias=False)
        self.kv_norm = RMSNorm(args.head_dim, args.norm_eps)
        # grouped low-rank output: G blocks [L, N·D/G], then [H, G·L]
        self.wo_a = nn.Linear(args.n_heads * args.head_dim // args.o_groups, args.o_groups * args.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(args.o_groups * args.o_lora_rank, args.dim, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(args.n_heads))
        if compress_ratio:
            overlap = compress_ratio == args.csa_ratio
            self.compressor = Compressor(args.dim, args.head_dim, compress_ratio, overlap, args.norm_eps)
            self.indexer = Indexer(args) if overlap else None
        else:
            self.compressor = self.indexer = None

    def forward(self, x_BSH: torch.Tensor, cache_SR: torch.Tensor) -> torch.Tensor:
        """``cache_SR``: the layer's RoPE cache from position 0 (at least S rows)."""
        seq_len = x_BSH.shape[1]
        cache_SR = cache_SR[:seq_len]
        q_residual_BSQ, q_BSND, kv_BSD = self.project(x_BSH, cache_SR)
        # window keys of query i: positions i-W+1 … i (W = min(window, S)); a strided view
        # of the front-padded keys [B, S+W-1, D] -> [B, S, D, W] (its backward is a
        # fixed-order sum, no scatter-add), padding masked in attend
        pos_S = torch.arange(seq_len, device=x_BSH.device)
        width = min(self.window, seq_len)
        window_SW = pos_S[:, None] - (width - 1) + torch.arange(width, device=x_BSH.device)
        kv_win_BSWD = F.pad(kv_BSD.float(), (0, 0, width - 1, 0)).unfold(1, width, 1).transpose(2, 3)
        compressed_BTD = visible_xST = None
        if self.compressor is not None:
            compressed_BTD = self.compressor(x_BSH, cache_SR)
            causal_ST = torch.arange(compressed_BTD.shape[1], device=x_BSH.device)[None, :] < ((pos_S + 1) // self.compress_ratio)[:, None]
            visible_xST = causal_ST[None] if self.indexer is None else self.indexer(x_BSH, q_residual_BSQ, cache_SR, causal_ST)
        o_BSND = self.attend(q_BSND, kv_win_BSWD, (window_SW >= 0)[None], compressed_BTD, visible_xST)
        return self.project_out(o_BSND, cache_SR)

    def project(self, x_BSH: torch.Tensor, cache_SR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per token: the q_lora residual [B, S, Q], rotated queries [B, S, N, D] and the
        rotated shared key/value [B, S, D]."""
        batch, seq_len, _ = x_BSH.shape
        q_residual_BSQ = self.q_norm(self.wq_a(x_BSH))
        q_BSND = self.wq_b(q_residual_BSQ).view(batch, seq_len, self.n_heads, self.head_dim)
        q_BSND = apply_tail_rope(unweighted_rms_norm(q_BSND, self.eps), cache_SR)
        return q_residual_BSQ, q_BSND, apply_tail_rope(self.kv_norm(self.wkv(x_BSH)), cache_SR)

    def attend(self, q_BSND, kv_win_BSWD, window_keep_xSW, compressed_BTD, visible_xST) -> torch.Tensor:
        """Each query over its W window keys ``kv_win_BSWD`` (fp32; ``window_keep_xSW``
        broadcasts to [B, S, W]) and the ``visible_xST`` compressed entries of its sequence
        (None: sliding window only), with the per-head sink: [B, S, N, D] in q's dtype."""
        batch, seq_len = q_BSND.shape[:2]
        width = kv_win_BSWD.shape[2]
        # scores, softmax and the value sums in fp32 (the official sparse-attention kernel's precision);
        # [B, S, N, D] @ [B, S, D, W]: one [N, D] × [D, W] product per query
        kv_win_BSWD = kv_win_BSWD.contiguous()  # both callers' products see the same layout
        q32_BSND = q_BSND.float()
        logits_BNSK = (q32_BSND @ kv_win_BSWD.transpose(2, 3)).transpose(1, 2) * self.head_dim**-0.5
        logits_BNSK = logits_BNSK.masked_fill(~window_keep_xSW[:, None], float("-inf"))
        if compressed_BTD is not None:
            compressed_BTD = compressed_BTD.float()
            logits_BNST = entry_products(q32_BSND, compressed_BTD).transpose(1, 2) * self.head_dim**-0.5
            # keys = the window, then the compressed entries: [B, N, S, W + T]
            logits_BNSK = torch.cat([logits_BNSK, logits_BNST.masked_fill(~visible_xST[:, None], float("-inf"))], dim=-1)
        # per-head sink: an extra logit in the softmax normaliser with no value
        sink_BNS1 = self.attn_sink.float()[None, :, None, None].expand(batch, -1, seq_len, 1)
        probs_BSNK = torch.cat([logits_BNSK, sink_BNS1], dim=-1).softmax(dim=-1)[..., :-1].transpose(1, 2)
        o_BSND = probs_BSNK[..., :width].contiguous() @ kv_win_BSWD
        if compressed_BTD is not None:
            # probabilities · entries: rows [S·N, T] against the entries as [D, T]
            o_BSND = o_BSND + entry_products(probs_BSNK[..., width:], compressed_BTD.transpose(1, 2))
        return o_BSND.to(q_BSND.dtype)

    def project_out(self, o_BSND: torch.Tensor, cache_SR: torch.Tensor) -> torch.Tensor:
        """Per token: undo the values' RoPE (their last R dims) at the query's position, then
        the grouped low-rank output projection: [B, S, H]."""
        batch, seq_len = o_BSND.shape[:2]
        o_BSND = apply_tail_rope(o_BSND, cache_SR, inverse=True)
        # [B, S, N, D] -> [B, S, G, F]; wo_a as G blocks [L, F], one F.linear per group
        o_BSGF = o_BSND.reshape(batch, seq_len, self.o_groups, -1)
        wo_a_GLF = self.wo_a.weight.view(self.o_groups, -1, o_BSGF.shape[-1])
        o_BSX = torch.cat([F.linear(o_BSGF[:, :, g], wo_a_GLF[g]) for g in range(self.o_groups)], dim=-1)  # X = G·L
        return self.wo_b(o_BSX)

    def init_weights(self, init_std: float):
        for linear in (self.wq_a, self.wq_b, self.wkv, self.wo_a):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo_b.weight, mean=0.0, std=init_std)
        self.q_norm.reset_parameters()
        self.kv_norm.reset_parameters()
        nn.init.zeros_(self.attn_sink)
        for module in (self.compressor, self.indexer):
            if module is not None:
                module.init_weights(init_std)
