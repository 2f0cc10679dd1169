"""Multi-head Latent Attention (MLA, DeepSeek-V2/V3), optionally restricted to
per-query top-k key sets (DeepSeek Sparse Attention, see glm_5_2/dsa.py).

Legend: B batch, S sequence (queries and keys), H hidden, N heads,
Q q_lora_rank, C kv_lora_rank, P qk_nope_head_dim, R qk_rope_head_dim,
E qk_head_dim (P + R), D v_head_dim, K selected keys per query.

Parameter names follow TorchTitan's DeepSeek-V3 (wq_a, q_norm, wq_b, wkv_a,
kv_norm, wkv_b, wo); the state-dict adapters map them to HF names.
"""

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.utils import trunc_normal_

from .norm import RMSNorm
from .rope import apply_rope


class MLAttention(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        a = model_args
        self.n_heads = a.n_heads
        self.kv_lora_rank = a.kv_lora_rank
        self.qk_nope_head_dim = a.qk_nope_head_dim
        self.qk_rope_head_dim = a.qk_rope_head_dim
        self.qk_head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim
        self.v_head_dim = a.v_head_dim
        self.rope_interleaved = a.rope_interleaved
        self.softmax_scale = a.softmax_scale

        self.wq_a = nn.Linear(a.dim, a.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(a.q_lora_rank, eps=a.latent_norm_eps)
        self.wq_b = nn.Linear(a.q_lora_rank, a.n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(a.dim, a.kv_lora_rank + a.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(a.kv_lora_rank, eps=a.latent_norm_eps)
        self.wkv_b = nn.Linear(a.kv_lora_rank, a.n_heads * (a.qk_nope_head_dim + a.v_head_dim), bias=False)
        self.wo = nn.Linear(a.n_heads * a.v_head_dim, a.dim, bias=False)

    def forward(
        self, x_BSH: torch.Tensor, rope_SR: torch.Tensor, topk_idx_BSK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Causal attention; with ``topk_idx_BSK`` each query also sees only its selected keys.
        Returns the output and the selection it used (passed on for IndexShare)."""
        q_latent_BSQ = self.q_norm(self.wq_a(x_BSH))
        return self.attend(x_BSH, q_latent_BSQ, rope_SR, topk_idx_BSK), topk_idx_BSK

    def attend(
        self, x_BSH: torch.Tensor, q_latent_BSQ: torch.Tensor, rope_SR: torch.Tensor, topk_idx_BSK: torch.Tensor | None
    ) -> torch.Tensor:
        q_BNSE, k_BNSE, v_BNSD = self.qkv(x_BSH, q_latent_BSQ, rope_SR)
        return self.project_out(sparse_causal_sdpa(q_BNSE, k_BNSE, v_BNSD, self.softmax_scale, topk_idx_BSK))

    def project_out(self, out_BNSD: torch.Tensor) -> torch.Tensor:
        return self.wo(out_BNSD.transpose(1, 2).flatten(2))  # [B, N, S, D] -> [B, S, N·D] -> [B, S, H]

    def qkv(
        self, x_BSH: torch.Tensor, q_latent_BSQ: torch.Tensor, rope_SR: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head queries and keys (nope ‖ rope) and values, head-major for SDPA."""
        bsz, seqlen, _ = x_BSH.shape
        q_BSNE = self.wq_b(q_latent_BSQ).view(bsz, seqlen, -1, self.qk_head_dim)  # -1: local heads under TP
        q_nope_BSNP, q_rope_BSNR = q_BSNE.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_rope_BSNR = apply_rope(q_rope_BSNR, rope_SR, self.rope_interleaved)

        kv_BS_CR = self.wkv_a(x_BSH)
        kv_latent_BSC, k_rope_BSR = kv_BS_CR.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rope_BS1R = apply_rope(k_rope_BSR.unsqueeze(2), rope_SR, self.rope_interleaved)  # one key rope for all heads
        kv_BSN_PD = self.wkv_b(self.kv_norm(kv_latent_BSC))
        kv_BSN_PD = kv_BSN_PD.view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)  # [B, S, N, P+D]
        k_nope_BSNP, v_BSND = kv_BSN_PD.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        n_local = k_nope_BSNP.shape[2]

        q_BSNE = torch.cat([q_nope_BSNP, q_rope_BSNR], dim=-1)
        k_BSNE = torch.cat([k_nope_BSNP, k_rope_BS1R.expand(-1, -1, n_local, -1)], dim=-1)
        # [B, S, N, ·] -> [B, N, S, ·]
        return q_BSNE.transpose(1, 2), k_BSNE.transpose(1, 2), v_BSND.transpose(1, 2)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            trunc_normal_(linear.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.q_norm.reset_parameters()
        self.kv_norm.reset_parameters()


def keep_mask(topk_idx_BSK: torch.Tensor) -> torch.Tensor:
    """``[B, S, S]`` bool: key t is visible to query s iff t ≤ s and t is among s's selected keys."""
    bsz, seqlen = topk_idx_BSK.shape[:2]
    selected_BSS = torch.zeros(bsz, seqlen, seqlen, dtype=torch.bool, device=topk_idx_BSK.device)
    selected_BSS.scatter_(-1, topk_idx_BSK.long(), True)
    return selected_BSS & torch.ones(seqlen, seqlen, dtype=torch.bool, device=topk_idx_BSK.device).tril()


def sparse_causal_sdpa(
    q_BNSE: torch.Tensor, k_BNSE: torch.Tensor, v_BNSD: torch.Tensor, scale: float, topk_idx_BSK: torch.Tensor | None
) -> torch.Tensor:
    """Causal SDPA; if ``topk_idx_BSK`` is given, query s attends to key t only when
    t ≤ s and t is among its K selected keys (selected future keys stay masked)."""
    if topk_idx_BSK is None:
        return F.scaled_dot_product_attention(q_BNSE, k_BNSE, v_BNSD, is_causal=True, scale=scale)
    keep_B1SS = keep_mask(topk_idx_BSK).unsqueeze(1)  # broadcast over heads
    return F.scaled_dot_product_attention(q_BNSE, k_BNSE, v_BNSD, attn_mask=keep_B1SS, scale=scale)
