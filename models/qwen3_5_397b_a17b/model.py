"""Qwen3.5-397B-A17B (text): hybrid Gated DeltaNet / gated full attention with a
512-expert MoE in every layer.

Legend: B batch, S sequence, H hidden, V vocab, Hq query heads, Hkv key/value
heads, D head dim, R rotary dims, F = Hq·D.

Checked against transformers' ``qwen3_5_moe`` (tests/models/test_model_qwen3_5.py).
transformers lacks the MTP module (it drops ``mtp.*`` on load); ours follows
the published layout (vLLM's qwen3_5_mtp): zero-centred norms of the token
embedding and of the trunk's hidden state, concatenated (embedding first),
``fc`` [H, 2H], one full-attention MoE block, a final norm, the shared head.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.protocols.model import ModelProtocol

from titan_mok.kernels.row_tiles import pointwise_padded
from titan_mok.models.common.mtp import logits_with_mtp_loss, mtp_enabled
from titan_mok.models.common.norm import RMSNorm
from titan_mok.models.common.rope import apply_rope, rope_cache
from titan_mok.moe import MoE

from .args import Qwen35ModelArgs
from .gated_deltanet import GatedDeltaNet


def zero_centred_norm(dim: int, eps: float) -> RMSNorm:
    """Qwen3.5's RMSNorm: ``rmsnorm(x) · (1 + w)``, w initialised to 0."""
    return RMSNorm(dim, eps, zero_centered=True)


def qwen_rope_cache(args: Qwen35ModelArgs) -> torch.Tensor:
    """RoPE cache of the first R = head_dim·partial_rotary_factor dims: [max_seq_len, R]."""
    return rope_cache(args.max_seq_len, args.rotary_dim, args.rope_theta)


def apply_partial_rope(x_BSND: torch.Tensor, rope_SR: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dims of each head by the first S rows of ``rope_SR`` (half-split
    pairs, rotate_half), pass the rest through."""
    rotary_dim = rope_SR.shape[-1]
    return torch.cat([apply_rope(x_BSND[..., :rotary_dim], rope_SR, interleaved=False), x_BSND[..., rotary_dim:]], dim=-1)


class GatedAttention(nn.Module):
    """Full causal GQA attention with per-head RMSNorm on q and k, partial RoPE
    and a sigmoid output gate. ``wq`` produces, per head, the query then the gate
    ([Hq, 2D] layout, as the checkpoints)."""

    def __init__(self, args: Qwen35ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim * 2, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = zero_centred_norm(args.head_dim, args.norm_eps)
        self.k_norm = zero_centred_norm(args.head_dim, args.norm_eps)

    def forward(self, x_BSH: torch.Tensor, rope_SR: torch.Tensor) -> torch.Tensor:
        """``rope_SR``: the rotary cache from position 0 (its first S rows are used)."""
        q_BHqSD, gate_BSF, k_BHkvSD, v_BHkvSD = self.project(x_BSH, rope_SR)
        o_BHqSD = F.scaled_dot_product_attention(q_BHqSD, k_BHkvSD, v_BHkvSD, is_causal=True, enable_gqa=True)
        return self.project_out(o_BHqSD, gate_BSF)

    def project(self, x_BSH: torch.Tensor, rope_SR: torch.Tensor):
        """Head-major queries [B, Hq, S, D], keys and values [B, Hkv, S, D] (normed, rotated
        by the first S rows of ``rope_SR``), and the output gate's logits [B, S, F], F = Hq·D."""
        batch, seq_len, _ = x_BSH.shape
        # [B, S, Hq·2D] -> [B, S, Hq, 2D] -> query, gate [B, S, Hq, D]
        q_BSHqD, gate_BSHqD = self.wq(x_BSH).view(batch, seq_len, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q_BSHqD = apply_partial_rope(self.q_norm(q_BSHqD), rope_SR)
        k_BSHkvD = self.wk(x_BSH).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        k_BSHkvD = apply_partial_rope(self.k_norm(k_BSHkvD), rope_SR)
        v_BSHkvD = self.wv(x_BSH).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        gate_BSF = gate_BSHqD.reshape(batch, seq_len, -1)
        return q_BSHqD.transpose(1, 2), gate_BSF, k_BSHkvD.transpose(1, 2), v_BSHkvD.transpose(1, 2)

    def project_out(self, o_BHqSD: torch.Tensor, gate_BSF: torch.Tensor) -> torch.Tensor:
        """Sigmoid-gated attention output through ``wo``: [B, S, H]."""
        batch, seq_len, _ = gate_BSF.shape
        o_BSF = o_BHqSD.transpose(1, 2).reshape(batch, seq_len, -1)  # [B, Hq, S, D] -> [B, S, Hq·D]
        return self.wo(o_BSF * pointwise_padded(torch.sigmoid, gate_BSF))

    def init_weights(self, init_std: float):
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class TransformerBlock(nn.Module):
    """Pre-norm block: token mixer (Gated DeltaNet, or gated full attention every
    ``full_attention_interval``-th layer), then the MoE."""

    def __init__(self, layer_id: int, args: Qwen35ModelArgs, full_attention: bool):
        super().__init__()
        self.full_attention = full_attention
        if full_attention:
            self.attention = GatedAttention(args)
        else:
            self.linear_attention = GatedDeltaNet(
                args.dim,
                args.linear_num_key_heads,
                args.linear_num_value_heads,
                args.linear_key_head_dim,
                args.linear_value_head_dim,
                args.linear_conv_kernel,
                args.norm_eps,
                args.deltanet_chunk_size,
            )
        self.attention_norm = zero_centred_norm(args.dim, args.norm_eps)
        self.ffn_norm = zero_centred_norm(args.dim, args.norm_eps)
        self.moe_enabled = True
        self.moe = MoE(args.moe_args, args.dim)
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x_BSH: torch.Tensor, rope_SR: torch.Tensor) -> torch.Tensor:
        h_BSH = self.attention_norm(x_BSH)
        if self.full_attention:
            x_BSH = x_BSH + self.attention(h_BSH, rope_SR)
        else:
            x_BSH = x_BSH + self.linear_attention(h_BSH)
        return x_BSH + self.moe(self.ffn_norm(x_BSH))

    def init_weights(self, buffer_device: torch.device):
        mixer = self.attention if self.full_attention else self.linear_attention
        mixer.init_weights(self.init_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.moe.init_weights(self.init_std, buffer_device)


class MultiTokenPrediction(nn.Module):
    """One MTP module: predicts token t+2 from the trunk's hidden state at t and
    the embedding of token t+1 (see the module docstring for the layout)."""

    def __init__(self, layer_id: int, args: Qwen35ModelArgs):
        super().__init__()
        self.pre_fc_norm_embedding = zero_centred_norm(args.dim, args.norm_eps)
        self.pre_fc_norm_hidden = zero_centred_norm(args.dim, args.norm_eps)
        self.fc = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = TransformerBlock(layer_id, args, full_attention=True)
        self.norm = zero_centred_norm(args.dim, args.norm_eps)

    def forward(self, h_BSH, next_embed_BSH, rope_SR) -> torch.Tensor:
        x_BS2H = torch.cat([self.pre_fc_norm_embedding(next_embed_BSH), self.pre_fc_norm_hidden(h_BSH)], dim=-1)
        return self.norm(self.block(self.fc(x_BS2H), rope_SR))

    def init_weights(self, buffer_device: torch.device):
        for norm in (self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm):
            norm.reset_parameters()
        nn.init.trunc_normal_(self.fc.weight, mean=0.0, std=0.02)
        self.block.init_weights(buffer_device)


class Qwen35Model(ModelProtocol):
    def __init__(self, args: Qwen35ModelArgs):
        super().__init__(args)
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("rope_cache", qwen_rope_cache(args), persistent=False)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args, args.is_full_attention(i)) for i in range(args.n_layers)}
        )
        self.norm = zero_centred_norm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.mtp = MultiTokenPrediction(args.n_layers, args) if args.n_mtp_layers else None

    def trunk(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """Hidden states after the last block, before the final norm: [B, S, H]."""
        seq_len = tokens_BS.shape[1]
        if seq_len > self.model_args.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.model_args.max_seq_len}")
        h_BSH = self.tok_embeddings(tokens_BS)
        for layer in self.layers.values():
            h_BSH = layer(h_BSH, self.rope_cache)  # the whole cache: attention reads its first S rows
        return h_BSH

    def forward(self, tokens_BS: torch.Tensor, attention_masks=None) -> torch.Tensor:
        if attention_masks is not None:
            raise ValueError("Qwen3.5 uses plain causal attention; attention_masks must be None")
        h_BSH = self.norm(self.trunk(tokens_BS))
        if not mtp_enabled(self.model_args.mtp_loss_coef, tokens_BS):  # coef > 0 implies the module
            return self.output(h_BSH)
        # MTP: position i (0..S-2) sees the final-normed h_i and token i+1, predicts token i+2.
        mtp_BSH = self.mtp(h_BSH[:, :-1], self.tok_embeddings(tokens_BS[:, 1:]), self.rope_cache)
        return logits_with_mtp_loss(self.output, h_BSH, mtp_BSH, tokens_BS, self.model_args.mtp_loss_coef)

    def mtp_logits(self, h_BSH: torch.Tensor, next_tokens_BS: torch.Tensor) -> torch.Tensor:
        """Logits of the MTP module given hidden states ``h_BSH`` of the trunk at
        positions t and the tokens at t+1 (``next_tokens_BS``): predicts t+2.
        vLLM feeds the final-normed states; ``pre_fc_norm_hidden`` renormalises
        whichever the caller passes."""
        if self.mtp is None:
            raise ValueError("this flavor has n_mtp_layers = 0: no MTP module")
        return self.output(self.mtp(h_BSH, self.tok_embeddings(next_tokens_BS), self.rope_cache))

    def init_weights(self, buffer_device: torch.device | None = None):
        buffer_device = buffer_device or self.rope_cache.device
        with torch.device(buffer_device):
            self.rope_cache = qwen_rope_cache(self.model_args)
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights(buffer_device)
        if self.mtp is not None:
            self.mtp.init_weights(buffer_device)
        self.norm.reset_parameters()
        std = self.model_args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
