"""The pre-norm MLA decoder both Kimi K2.7 Code and GLM-5.2 are built from.

Legend: B batch, S sequence, H hidden, V vocab, R rotary dims, K selected keys.

Names follow TorchTitan's DeepSeek-V3 (tok_embeddings, layers["i"].attention /
attention_norm / ffn_norm / feed_forward or moe, norm, output), so TorchTitan's
parallelize functions and its MoE load-balancing optimizer hook apply as-is.
"""

import torch
from torch import nn

from torchtitan.models.moe import FeedForward
from torchtitan.models.utils import trunc_normal_
from torchtitan.protocols.model import ModelProtocol

from titan_mok.moe import MoE

from .mla import MLAttention
from .norm import RMSNorm
from .rope import rope_cache


class DecoderBlock(nn.Module):
    """``x + attn(norm(x))``, then ``x + ffn(norm(x))``; the FFN is dense SwiGLU on
    the first ``n_dense_layers`` layers and titan-mok's MoE on the others."""

    def __init__(self, layer_id: int, model_args, attention: nn.Module):
        super().__init__()
        a = model_args
        self.attention = attention
        self.attention_norm = RMSNorm(a.dim, eps=a.norm_eps)
        self.ffn_norm = RMSNorm(a.dim, eps=a.norm_eps)
        self.moe_enabled = layer_id >= a.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(a.moe_args, a.dim)
        else:
            self.feed_forward = FeedForward(a.dim, a.dense_inter_dim)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(
        self, x_BSH: torch.Tensor, rope_SR: torch.Tensor, topk_idx_BSK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the new hidden state and the attention's key selection (DSA IndexShare; None otherwise)."""
        attn_BSH, topk_idx_BSK = self.attention(self.attention_norm(x_BSH), rope_SR, topk_idx_BSK)
        x_BSH = x_BSH + attn_BSH
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return x_BSH + ffn(self.ffn_norm(x_BSH)), topk_idx_BSK

    def init_weights(self, buffer_device: torch.device) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        if self.moe_enabled:
            self.moe.init_weights(self.weight_init_std, buffer_device)
        else:
            self.feed_forward.init_weights(self.weight_init_std)


class MLADecoder(ModelProtocol):
    """Embedding → ``n_layers`` DecoderBlocks → RMSNorm → untied output head.
    ``forward(tokens_BS) -> logits_BSV`` (TorchTitan's signature). Subclasses pick
    the attention of each layer (``build_attention``)."""

    def __init__(self, model_args):
        super().__init__(model_args)
        self.model_args = model_args
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)
        self.layers = nn.ModuleDict(
            {str(i): DecoderBlock(i, model_args, self.build_attention(i)) for i in range(model_args.n_layers)}
        )
        self.norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)

    def build_attention(self, layer_id: int) -> nn.Module:
        return MLAttention(self.model_args)

    def _rope_cache(self) -> torch.Tensor:
        a = self.model_args
        return rope_cache(a.max_seq_len, a.qk_rope_head_dim, a.rope_theta, a.yarn)

    def decode(self, h_BSH: torch.Tensor) -> torch.Tensor:
        """The ``n_layers`` main blocks (an MTP block may follow them in ``layers``)."""
        topk_idx_BSK = None
        for layer_id in range(self.model_args.n_layers):
            h_BSH, topk_idx_BSK = self.layers[str(layer_id)](h_BSH, self.rope_cache, topk_idx_BSK)
        return h_BSH

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        self.check_tokens(tokens_BS)
        h_BSH = self.decode(self.tok_embeddings(tokens_BS))
        return self.output(self.norm(h_BSH))

    def check_tokens(self, tokens_BS: torch.Tensor) -> None:
        """Shape checks only (no host sync)."""
        if tokens_BS.dim() != 2:
            raise ValueError(f"tokens_BS must be [batch, seq], got shape {tuple(tokens_BS.shape)}")
        if tokens_BS.shape[1] > self.rope_cache.shape[0]:
            raise ValueError(
                f"sequence length {tokens_BS.shape[1]} exceeds the rotary cache ({self.rope_cache.shape[0]} "
                "positions, set from [training] seq_len)"
            )

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        buffer_device = buffer_device or self.rope_cache.device
        with torch.device(buffer_device):
            self.rope_cache = self._rope_cache()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights(buffer_device)
        self.norm.reset_parameters()
        std = self.model_args.dim**-0.5
        trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
