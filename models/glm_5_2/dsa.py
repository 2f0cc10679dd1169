"""DeepSeek Sparse Attention as GLM-5 uses it: MLA whose queries each attend to
the top-k keys chosen by a lightning indexer; with IndexShare, only some layers
run an indexer and the layers after them reuse its selection.

Legend: B batch, S queries, T keys (= S), H hidden, Q q_lora_rank, R rotary
dims, I indexer heads, J indexer head dim (U = J − R unrotated), K selected keys (min(index_topk, S)),
N attention heads (n: a chunk of them), E qk head dim.

The language-model loss does not reach the indexer (its selection is discrete).
With ``index_loss_coef > 0`` the indexer learns DeepSeek-V3.2's sparse-stage
objective instead: KL(p ‖ softmax(index)) over each query's selected keys, p being
the main attention's probabilities summed over heads (no gradient), with the
indexer's inputs detached so that this loss trains the indexer alone.
"""

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.utils import trunc_normal_

from titan_mok.models.common.mla import MLAttention, keep_mask, sparse_causal_sdpa
from titan_mok.models.common.rope import apply_rope
from titan_mok.attached_loss import attach_loss


class LightningIndexer(nn.Module):
    """index(s, t) = Σ_i w_i(s) · relu(q_i(s) · k(t) / √J); picks the top-K causal keys per query.

    q comes from the attention's query latent, k from the hidden state (one head,
    LayerNorm'd); the first R dims of each are rotated (interleaved layout)."""

    def __init__(self, model_args):
        super().__init__()
        a = model_args
        self.n_heads = a.index_n_heads
        self.head_dim = a.index_head_dim
        self.rope_dim = a.qk_rope_head_dim
        self.topk = a.index_topk
        self.rope_interleaved = a.rope_interleaved
        self.wq_b = nn.Linear(a.q_lora_rank, a.index_n_heads * a.index_head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(a.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(a.dim, a.index_n_heads, bias=False)

    def project(self, x_BSH: torch.Tensor, q_latent_BSQ: torch.Tensor, rope_SR: torch.Tensor):
        """Rotated index queries ``q_BSIJ`` [B, S, I, J] and keys ``k_BSJ`` [B, S, J] (one key head)."""
        bsz, seqlen, _ = x_BSH.shape
        q_BSIJ = self.wq_b(q_latent_BSQ).view(bsz, seqlen, -1, self.head_dim)  # [B, S, I, J]
        q_rope_BSIR, q_rest_BSIU = q_BSIJ.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k_BS1J = self.k_norm(self.wk(x_BSH)).unsqueeze(2)  # [B, S, 1, J]: one key head
        k_rope_BS1R, k_rest_BS1U = k_BS1J.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        q_BSIJ = torch.cat([apply_rope(q_rope_BSIR, rope_SR, self.rope_interleaved), q_rest_BSIU], dim=-1)
        k_BSJ = torch.cat([apply_rope(k_rope_BS1R, rope_SR, self.rope_interleaved), k_rest_BS1U], dim=-1).squeeze(2)
        return q_BSIJ, k_BSJ

    def score(self, q_BSIJ: torch.Tensor, k_BTJ: torch.Tensor, x_BSH: torch.Tensor) -> torch.Tensor:
        """Unmasked index scores ``[B, S, T]`` fp32 of queries S against keys T."""
        # [B, S, I, J] @ [B, 1, J, T] -> [B, S, I, T]
        scores_BSIT = F.relu(torch.matmul(q_BSIJ.float(), k_BTJ.float().transpose(-1, -2).unsqueeze(1)) * self.head_dim**-0.5)
        weights_BS1I = (self.weights_proj(x_BSH).float() * self.n_heads**-0.5).unsqueeze(-2)
        return torch.matmul(weights_BS1I, scores_BSIT).squeeze(-2)  # [B, S, 1, T] -> [B, S, T]

    def forward(self, x_BSH: torch.Tensor, q_latent_BSQ: torch.Tensor, rope_SR: torch.Tensor) -> torch.Tensor:
        """Index scores ``[B, S, T]`` fp32, −inf on future keys."""
        seqlen = x_BSH.shape[1]
        q_BSIJ, k_BTJ = self.project(x_BSH, q_latent_BSQ, rope_SR)
        index_BST = self.score(q_BSIJ, k_BTJ, x_BSH)
        future_ST = torch.ones(seqlen, seqlen, dtype=torch.bool, device=x_BSH.device).triu(1)
        return index_BST.masked_fill(future_ST, float("-inf"))

    def select(self, index_BST: torch.Tensor) -> torch.Tensor:
        """``topk_idx_BSK`` (int64) of the K best keys. Rows with fewer than K causal keys
        also select some future keys; the attention mask drops them again."""
        return index_BST.detach().topk(min(self.topk, index_BST.shape[-1]), dim=-1).indices

    def init_weights(self) -> None:
        for linear in (self.wq_b, self.wk, self.weights_proj):
            trunc_normal_(linear.weight, mean=0.0, std=0.02)
        self.k_norm.reset_parameters()


class DSAttention(MLAttention):
    """MLA + DSA. ``runs_indexer``: this layer computes its own top-k ("full" layer);
    otherwise it reuses the selection handed to it by the previous layer ("shared")."""

    def __init__(self, model_args, runs_indexer: bool):
        super().__init__(model_args)
        self.index_topk = model_args.index_topk
        self.index_loss_coef = model_args.index_loss_coef
        self.indexer = LightningIndexer(model_args) if runs_indexer else None

    def forward(
        self, x_BSH: torch.Tensor, rope_SR: torch.Tensor, topk_idx_BSK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q_latent_BSQ = self.q_norm(self.wq_a(x_BSH))
        index_BST = None
        if self.indexer is not None:
            # NOTE: with S ≤ index_topk every causal key is selected, so DSA is exactly
            # causal attention and the indexer is skipped (None = no extra restriction).
            topk_idx_BSK = None
            if x_BSH.shape[1] > self.index_topk:
                train_indexer = self.index_loss_coef > 0 and torch.is_grad_enabled()
                with torch.set_grad_enabled(train_indexer):
                    index_BST = self.indexer(x_BSH.detach(), q_latent_BSQ.detach(), rope_SR)
                topk_idx_BSK = self.indexer.select(index_BST)
                index_BST = index_BST if train_indexer else None
        q_BNSE, k_BNSE, v_BNSD = self.qkv(x_BSH, q_latent_BSQ, rope_SR)
        out_BSH = self.project_out(sparse_causal_sdpa(q_BNSE, k_BNSE, v_BNSD, self.softmax_scale, topk_idx_BSK))
        if index_BST is not None:
            loss = indexer_kl_loss(q_BNSE.detach(), k_BNSE.detach(), self.softmax_scale, index_BST, topk_idx_BSK)
            out_BSH = attach_loss(out_BSH, loss, self.index_loss_coef, "indexer_kl")  # trains the indexer
        return out_BSH, topk_idx_BSK

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        if self.indexer is not None:
            self.indexer.init_weights()


def indexer_kl_loss(
    q_BNSE: torch.Tensor, k_BNSE: torch.Tensor, scale: float, index_BST: torch.Tensor, topk_idx_BSK: torch.Tensor,
    heads_per_chunk: int = 8,
) -> torch.Tensor:
    """Mean over queries of KL(p ‖ softmax(index)) on the keys each query attends to;
    p = the attention probabilities summed over heads / N (computed without gradient,
    ``heads_per_chunk`` heads at a time to bound the [B, n, S, T] scores)."""
    keep_BST = keep_mask(topk_idx_BSK)
    n_heads = q_BNSE.shape[1]
    with torch.no_grad():
        p_BST = torch.zeros(keep_BST.shape, dtype=torch.float32, device=q_BNSE.device)
        for h in range(0, n_heads, heads_per_chunk):
            q_BnSE, k_BnTE = q_BNSE[:, h : h + heads_per_chunk].float(), k_BNSE[:, h : h + heads_per_chunk].float()
            logits_BnST = torch.matmul(q_BnSE, k_BnTE.transpose(-1, -2)) * scale
            p_BST += logits_BnST.masked_fill(~keep_BST.unsqueeze(1), float("-inf")).softmax(-1).sum(1)
        p_BST /= n_heads
    log_q_BST = index_BST.masked_fill(~keep_BST, float("-inf")).log_softmax(-1).masked_fill(~keep_BST, 0.0)
    kl_BS = (torch.special.xlogy(p_BST, p_BST) - p_BST * log_q_BST).sum(-1)
    return kl_BS.mean()
