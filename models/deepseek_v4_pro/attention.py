"""DeepSeek-V4 attention: shared-KV multi-query attention with per-head sinks over
a causal sliding window plus compressed key/value entries.

Legend: B batch, S sequence (queries and window keys), H hidden, N query heads,
D head dim (query = shared key/value), R rope dims, T compressed entries,
M compression ratio, Q q_lora rank, G output groups, L o_lora rank,
I indexer heads, J indexer head dim.

Per layer (``compress_ratio``):
- 0: the sliding window only (plain RoPE, theta 1e4);
- HCA (128): window + every causal compressed entry of non-overlapping 128-token windows;
- CSA (4): window + the lightning indexer's top-k of the compressed entries of
  overlapping 8-token windows (stride 4).
Compressed entry w summarises tokens [w·M, (w+1)·M) and is visible to query t
when w < (t + 1) // M. Compressed layers use YaRN RoPE on theta 1.6e5.

The reference math views each query's window ([B, S, D, W] keys) and scores it
with every compressed entry: [B, N, S, W + T] scores (no sparse kernel). The indexer's Hadamard rotation of q and k (an FP8
quantisation aid in the official inference code) is orthogonal and leaves the
scores unchanged in full precision, so it is omitted (as in transformers); so
are the official code's FP8/FP4 activation-quantisation simulations of the
cached keys and indexer inputs (quantisation-aware-training aids).
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
        batch, seq_len, _ = x_BSH.shape
        n_win, m, d = seq_len // self.ratio, self.ratio, self.head_dim
        if n_win == 0:
            return x_BSH.new_zeros(batch, 0, d)
        # pooled in fp32 (as the official code), normalised in the activations' dtype
        x32_BSH = x_BSH[:, : n_win * m].float()
        # [B, S, W] -> [B, T, M, W]
        kv_BTMW = F.linear(x32_BSH, self.wkv.weight.float()).view(batch, n_win, m, -1)
        score_BTMW = F.linear(x32_BSH, self.wgate.weight.float()).view(batch, n_win, m, -1) + self.ape.float()
        if self.overlap:
            # [B, T, M, 2D] -> [B, T, 2M, D]: previous window's first half, then this window's second half
            prev_kv = F.pad(kv_BTMW[:, :-1, :, :d], (0, 0, 0, 0, 1, 0))
            prev_score = F.pad(score_BTMW[:, :-1, :, :d], (0, 0, 0, 0, 1, 0), value=float("-inf"))
            kv_BTMW = torch.cat([prev_kv, kv_BTMW[..., d:]], dim=2)
            score_BTMW = torch.cat([prev_score, score_BTMW[..., d:]], dim=2)
        compressed_BTD = (kv_BTMW * score_BTMW.softmax(dim=2)).sum(dim=2).to(x_BSH.dtype)
        positions = torch.arange(n_win, device=x_BSH.device) * m
        return apply_tail_rope(self.norm(compressed_BTD), cache_SR[positions])

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
        batch, seq_len, _ = x_BSH.shape
        k_BTJ = self.compressor(x_BSH, cache_SR)
        q_BSIJ = apply_tail_rope(self.wq_b(q_residual_BSQ).view(batch, seq_len, self.n_heads, self.head_dim), cache_SR)
        scores_BSIT = F.relu(torch.einsum("bsij,btj->bsit", q_BSIJ.float(), k_BTJ.float())) * self.head_dim**-0.5
        weights_BSI = self.weights_proj(x_BSH).float() * self.n_heads**-0.5
        index_BST = (scores_BSIT * weights_BSI[..., None]).sum(dim=2).masked_fill(~causal_ST, float("-inf"))
        topk_BSK = index_BST.topk(min(self.topk, k_BTJ.shape[1]), dim=-1).indices
        chosen_BST = torch.zeros_like(index_BST, dtype=torch.bool).scatter_(-1, topk_BSK, True)
        return chosen_BST & causal_ST

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
        batch, seq_len, _ = x_BSH.shape
        q_residual_BSQ = self.q_norm(self.wq_a(x_BSH))
        q_BSND = self.wq_b(q_residual_BSQ).view(batch, seq_len, self.n_heads, self.head_dim)
        q_BSND = apply_tail_rope(unweighted_rms_norm(q_BSND, self.eps), cache_SR)
        kv_BSD = apply_tail_rope(self.kv_norm(self.wkv(x_BSH)), cache_SR)

        # window keys of query i: positions i-W+1 … i (W = min(window, S)); a strided view
        # of the front-padded keys [B, S+W-1, D] -> [B, S, D, W] (its backward is a
        # fixed-order sum, no scatter-add), padding masked below
        pos = torch.arange(seq_len, device=x_BSH.device)
        width = min(self.window, seq_len)
        window_SW = pos[:, None] - (width - 1) + torch.arange(width, device=x_BSH.device)
        kv_win_BSDW = F.pad(kv_BSD.float(), (0, 0, width - 1, 0)).unfold(1, width, 1)
        # scores, softmax and the value sums in fp32 (the official sparse-attention kernel's precision)
        q32_BSND = q_BSND.float()
        logits_BNSW = torch.einsum("bsnd,bsdw->bnsw", q32_BSND, kv_win_BSDW) * self.head_dim**-0.5
        logits_BNSK = logits_BNSW.masked_fill(window_SW < 0, float("-inf"))
        if self.compressor is not None:
            compressed_BTD = self.compressor(x_BSH, cache_SR).float()
            causal_ST = torch.arange(compressed_BTD.shape[1], device=x_BSH.device)[None, :] < ((pos + 1) // self.compress_ratio)[:, None]
            visible_BST = causal_ST[None] if self.indexer is None else self.indexer(x_BSH, q_residual_BSQ, cache_SR, causal_ST)
            logits_BNST = torch.einsum("bsnd,btd->bnst", q32_BSND, compressed_BTD) * self.head_dim**-0.5
            # keys = the window, then the compressed entries: [B, N, S, W + T]
            logits_BNSK = torch.cat([logits_BNSK, logits_BNST.masked_fill(~visible_BST[:, None], float("-inf"))], dim=-1)
        # per-head sink: an extra logit in the softmax normaliser with no value
        sink_BNS1 = self.attn_sink.float()[None, :, None, None].expand(batch, -1, seq_len, 1)
        probs_BNSK = torch.cat([logits_BNSK, sink_BNS1], dim=-1).softmax(dim=-1)[..., :-1]
        o_BSND = torch.einsum("bnsw,bsdw->bsnd", probs_BNSK[..., :width], kv_win_BSDW)
        if self.compressor is not None:
            o_BSND = o_BSND + torch.einsum("bnst,btd->bsnd", probs_BNSK[..., width:], compressed_BTD)
        o_BSND = o_BSND.to(x_BSH.dtype)
        # values carry RoPE on their last R dims: rotate back to the query's position
        o_BSND = apply_tail_rope(o_BSND, cache_SR, inverse=True)
        # [B, S, N, D] -> [B, S, G, N·D/G]; wo_a as G blocks [L, N·D/G]
        o_BSGF = o_BSND.reshape(batch, seq_len, self.o_groups, -1)
        wo_a_GLF = self.wo_a.weight.view(self.o_groups, -1, o_BSGF.shape[-1])
        return self.wo_b(torch.einsum("bsgf,glf->bsgl", o_BSGF, wo_a_GLF).flatten(2))

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
