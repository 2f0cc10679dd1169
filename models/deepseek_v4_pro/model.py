"""DeepSeek-V4-Pro: shared-KV MQA with sliding window + compressed branches
(attention.py), manifold-constrained hyper-connections (hyper_connections.py)
and an all-MoE stack whose first layers are hash-routed.

Legend: B batch, S sequence, H hidden, C residual streams (hc_mult), V vocab.

Checked against transformers' ``deepseek_v4`` (tests/models/test_model_deepseek_v4.py).
Where transformers and the official release differ, we follow the official one:
- layer schedule: the official ``compress_ratios`` (HCA, HCA, then CSA/HCA
  alternating from layer 2, CSA last); transformers' default ``layer_types``
  starts the alternation one layer later (it is right when loading the official
  config, which carries ``compress_ratios``);
- checkpoint names: the official ones; transformers converts them on load, but
  its ``save_pretrained`` does not restore them (``model.`` prefix, ``attn.norm``);
- MTP: transformers lacks it (drops ``mtp.*``); ours follows the official
  inference code's MTPBlock: ``x = e_proj(enorm(embed(t+1))) + h_proj(hnorm(h))``
  on every stream, one full block (sliding-window attention, learned router), its
  own hyper-connection head and norm, then the shared output head;
- shared-expert SwiGLU clamp: the first release of the official inference code
  did not clamp the shared expert, the updated one does (as transformers): we clamp.
"""

import torch
from torch import nn
from torchtitan.protocols.model import ModelProtocol

from titan_mok.models.common.mtp import logits_with_mtp_loss, mtp_enabled
from titan_mok.models.common.norm import RMSNorm
from titan_mok.moe import MoE

from .args import DeepSeekV4ModelArgs
from .attention import Attention, rope_caches
from .hyper_connections import HyperConnection, HyperHead, merge


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: DeepSeekV4ModelArgs, compress_ratio: int):
        super().__init__()
        self.compressed = compress_ratio != 0
        self.attention = Attention(args, compress_ratio)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        hc = (args.dim, args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps, args.norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)
        self.moe_enabled = True
        self.moe = MoE(args.layer_moe_args(layer_id), args.dim)
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x_BSCH, tokens_BS, rope) -> torch.Tensor:
        """``rope``: (plain, compressed) RoPE caches; the layer picks its own."""
        h_BSH, post, comb = self.attn_hc(x_BSCH)
        a_BSH = self.attention(self.attention_norm(h_BSH), rope[self.compressed])
        x_BSCH = merge(a_BSH, x_BSCH, post, comb)
        h_BSH, post, comb = self.ffn_hc(x_BSCH)
        return merge(self.moe(self.ffn_norm(h_BSH), tokens_BS), x_BSCH, post, comb)

    def init_weights(self, buffer_device: torch.device):
        self.attention.init_weights(self.init_std)
        for module in (self.attention_norm, self.ffn_norm):
            module.reset_parameters()
        for module in (self.attn_hc, self.ffn_hc):
            module.init_weights()
        self.moe.init_weights(self.init_std, buffer_device)


class MultiTokenPrediction(nn.Module):
    def __init__(self, layer_id: int, args: DeepSeekV4ModelArgs):
        super().__init__()
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.e_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.h_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.block = TransformerBlock(layer_id, args, compress_ratio=0)
        self.hc_head = HyperHead(args.dim, args.hc_mult, args.hc_eps, args.norm_eps)
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, h_BSCH, next_embed_BSH, next_tokens_BS, rope) -> torch.Tensor:
        x_BSCH = self.e_proj(self.enorm(next_embed_BSH))[:, :, None] + self.h_proj(self.hnorm(h_BSCH))
        return self.norm(self.hc_head(self.block(x_BSCH, next_tokens_BS, rope)))

    def init_weights(self, buffer_device: torch.device):
        for module in (self.enorm, self.hnorm, self.norm):
            module.reset_parameters()
        for linear in (self.e_proj, self.h_proj):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        self.hc_head.init_weights()
        self.block.init_weights(buffer_device)


class DeepSeekV4Model(ModelProtocol):
    def __init__(self, args: DeepSeekV4ModelArgs):
        super().__init__(args)
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        plain, compressed = rope_caches(args)
        self.register_buffer("rope_plain", plain, persistent=False)
        self.register_buffer("rope_compressed", compressed, persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args, r) for i, r in enumerate(args.compress_ratios)})
        self.hc_head = HyperHead(args.dim, args.hc_mult, args.hc_eps, args.norm_eps)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.mtp = nn.ModuleDict({str(k): MultiTokenPrediction(args.n_layers + k, args) for k in range(args.n_mtp_layers)})

    def _angles(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole RoPE caches (each attention takes the rows of its own positions: the
        first S in a forward, a new token's own row in RL's cached decode step)."""
        if seq_len > self.model_args.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.model_args.max_seq_len}")
        return self.rope_plain, self.rope_compressed

    def trunk(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """The C residual streams after the last block: [B, S, C, H]."""
        rope = self._angles(tokens_BS.shape[1])
        h_BSH = self.tok_embeddings(tokens_BS)
        # every stream starts as the embedding: [B, S, H] -> [B, S, C, H]
        x_BSCH = h_BSH[:, :, None].expand(-1, -1, self.model_args.hc_mult, -1)
        for layer in self.layers.values():
            x_BSCH = layer(x_BSCH, tokens_BS, rope)
        return x_BSCH

    def forward(self, tokens_BS: torch.Tensor, attention_masks=None) -> torch.Tensor:
        if attention_masks is not None:
            raise ValueError("DeepSeek-V4 builds its own sliding-window/compressed masks; attention_masks must be None")
        x_BSCH = self.trunk(tokens_BS)
        h_BSH = self.norm(self.hc_head(x_BSCH))
        if not mtp_enabled(self.model_args.mtp_loss_coef, tokens_BS):
            return self.output(h_BSH)
        # MTP: position i (0..S-2) sees the streams at i and token i+1, predicts token i+2.
        next_BS = tokens_BS[:, 1:]
        mtp_BSH = self.mtp["0"](x_BSCH[:, :-1], self.tok_embeddings(next_BS), next_BS, self._angles(tokens_BS.shape[1]))
        return logits_with_mtp_loss(self.output, h_BSH, mtp_BSH, tokens_BS, self.model_args.mtp_loss_coef)

    def mtp_logits(self, h_BSCH: torch.Tensor, next_tokens_BS: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """Logits of MTP module ``depth`` from the streams at t (``h_BSCH``) and the
        tokens at t+1: predicts t+2."""
        rope = self._angles(h_BSCH.shape[1])
        mtp = self.mtp[str(depth)]
        return self.output(mtp(h_BSCH, self.tok_embeddings(next_tokens_BS), next_tokens_BS, rope))

    def init_weights(self, buffer_device: torch.device | None = None):
        buffer_device = buffer_device or self.rope_plain.device
        with torch.device(buffer_device):
            self.rope_plain, self.rope_compressed = rope_caches(self.model_args)
        nn.init.normal_(self.tok_embeddings.weight)
        for module in (*self.layers.values(), *self.mtp.values()):
            module.init_weights(buffer_device)
        self.hc_head.init_weights()
        self.norm.reset_parameters()
        std = self.model_args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
