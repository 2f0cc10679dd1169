"""GLM-5.2: MLA + DSA (IndexShare) decoder with MoE and one MTP block.

Legend: B batch, S sequence, H hidden, V vocab.
"""

import torch
import torch.nn.functional as F
from torch import nn

from titan_mok.models.common.decoder import MLADecoder
from titan_mok.models.common.mtp import MTPBlock
from titan_mok.attached_loss import attach_loss

from .args import GLM52Args
from .dsa import DSAttention


class GLM52Model(MLADecoder):
    def __init__(self, model_args: GLM52Args):
        super().__init__(model_args)
        if model_args.n_mtp_layers:
            mtp_id = model_args.n_layers
            self.layers[str(mtp_id)] = MTPBlock(mtp_id, model_args, self.build_attention(mtp_id))

    def build_attention(self, layer_id: int) -> nn.Module:
        return DSAttention(self.model_args, runs_indexer=self.model_args.runs_indexer(layer_id))

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        self.check_tokens(tokens_BS)
        emb_BSH = self.tok_embeddings(tokens_BS)
        h_BSH = self.norm(self.decode(emb_BSH))
        coef, seqlen = self.model_args.mtp_loss_coef, tokens_BS.shape[1]
        if coef == 0 or not torch.is_grad_enabled() or seqlen < 3:  # (S < 3: no MTP target in the input)
            return self.output(h_BSH)
        # MTP: position i (0..S-2) sees h_i and the embedding of token i+1, predicts token i+2.
        mtp_BSH = self.layers[str(self.model_args.n_layers)](emb_BSH[:, 1:], h_BSH[:, :-1], self.rope_cache)
        # one call of the (FSDP-wrapped) head for both: [B, S + S-1, V], split back
        logits_BSV, mtp_logits_BSV = self.output(torch.cat([h_BSH, mtp_BSH], dim=1)).split([seqlen, seqlen - 1], dim=1)
        # targets t_{i+2} exist in the input for i ≤ S-3
        mtp_loss = F.cross_entropy(mtp_logits_BSV[:, :-1].flatten(0, 1).float(), tokens_BS[:, 2:].flatten())
        return attach_loss(logits_BSV, mtp_loss, coef, "mtp")  # trains the MTP block
