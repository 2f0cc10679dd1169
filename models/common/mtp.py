"""Multi-token prediction (MTP): the DeepSeek-V3-style block (GLM-5.2), and the
training loss every titan-mok model with an MTP module attaches the same way
(``mtp_enabled``, ``logits_with_mtp_loss``).

Legend: B batch, S sequence, H hidden, R rotary dims.

Depth 1: position i pairs the main model's final (normed) hidden state h_i with
the embedding of token i+1 and predicts token i+2:
``eh_proj(cat(enorm(emb_{i+1}), hnorm(h_i)))`` → decoder block → ``final_norm`` →
the main model's output head (shared, as is the embedding).
"""

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.utils import trunc_normal_

from titan_mok.attached_loss import attach_loss, attaching

from .decoder import DecoderBlock
from .norm import RMSNorm


def mtp_enabled(coef: float, tokens_BS: torch.Tensor) -> bool:
    """Whether a forward trains the MTP module: a positive coefficient, autograd on, the "mtp"
    loss not switched off (``attached_loss.without_losses``), and a sequence long enough
    (S >= 3) to hold a t+2 target."""
    return coef > 0 and torch.is_grad_enabled() and attaching("mtp") and tokens_BS.shape[1] >= 3


def logits_with_mtp_loss(
    output: nn.Module, h_BSH: torch.Tensor, mtp_BSH: torch.Tensor, tokens_BS: torch.Tensor, coef: float
) -> torch.Tensor:
    """The main logits [B, S, V], carrying the MTP cross-entropy (``attach_loss`` "mtp").

    ``mtp_BSH[:, i]`` (i = 0..S-2) is the MTP state that saw token i+1: it predicts token
    i+2, whose target is in the input for i <= S-3. One call of the (FSDP-wrapped) head
    serves both: [B, S + S-1, V], split back."""
    seq_len = tokens_BS.shape[1]
    logits_BSV, mtp_logits_BSV = output(torch.cat([h_BSH, mtp_BSH], dim=1)).split([seq_len, seq_len - 1], dim=1)
    mtp_loss = F.cross_entropy(mtp_logits_BSV[:, :-1].flatten(0, 1).float(), tokens_BS[:, 2:].flatten())
    return attach_loss(logits_BSV, mtp_loss, coef, "mtp")


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
