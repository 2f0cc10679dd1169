"""Multi-token prediction (MTP) block, DeepSeek-V3 style.

Legend: B batch, S sequence, H hidden, R rotary dims.

Depth 1: position i pairs the main model's final (normed) hidden state h_i with
the embedding of token i+1 and predicts token i+2:
``eh_proj(cat(enorm(emb_{i+1}), hnorm(h_i)))`` → decoder block → ``final_norm`` →
the main model's output head (shared, as is the embedding).
"""

import torch
from torch import nn

from torchtitan.models.utils import trunc_normal_

from .decoder import DecoderBlock
from .norm import RMSNorm


class MTPBlock(DecoderBlock):
    """A DecoderBlock (always MoE) with the MTP input projection and its own final norm.
    It sits in ``model.layers`` after the main layers, as in the HF checkpoints
    (``model.layers.{n_layers}.*``), so parallelize and the load-balancing hook see it."""

    def __init__(self, layer_id: int, model_args, attention: nn.Module):
        if layer_id < model_args.n_dense_layers:
            raise ValueError(f"MTP block {layer_id} would be dense; it must come after the {model_args.n_dense_layers} dense layers")
        super().__init__(layer_id, model_args, attention)
        self.enorm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.hnorm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.eh_proj = nn.Linear(2 * model_args.dim, model_args.dim, bias=False)
        self.final_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)

    def forward(self, emb_next_BSH: torch.Tensor, h_BSH: torch.Tensor, rope_SR: torch.Tensor) -> torch.Tensor:
        """``emb_next_BSH[:, i]`` = embedding of token i+1, ``h_BSH[:, i]`` = main hidden at i;
        returns the normed MTP hidden state (feed it to the shared output head)."""
        x_BSH = self.eh_proj(torch.cat([self.enorm(emb_next_BSH), self.hnorm(h_BSH)], dim=-1))
        x_BSH, _ = super().forward(x_BSH, rope_SR)
        return self.final_norm(x_BSH)

    def init_weights(self, buffer_device: torch.device) -> None:
        super().init_weights(buffer_device)
        for norm in (self.enorm, self.hnorm, self.final_norm):
            norm.reset_parameters()
        trunc_normal_(self.eh_proj.weight, mean=0.0, std=0.02)
