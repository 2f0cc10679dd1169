"""GLM-5.2: MLA + DSA (IndexShare) decoder with MoE and one MTP block.

Legend: B batch, S sequence, H hidden, V vocab.
"""

import torch
from torch import nn

from titan_mok.models.common.decoder import MLADecoder
from titan_mok.models.common.mtp import MTPBlock, logits_with_mtp_loss, mtp_enabled

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
        if not mtp_enabled(self.model_args.mtp_loss_coef, tokens_BS):
            return self.output(h_BSH)
        # MTP: position i (0..S-2) sees h_i and the embedding of token i+1, predicts token i+2.
        mtp_BSH = self.layers[str(self.model_args.n_layers)](emb_BSH[:, 1:], h_BSH[:, :-1], self.rope_cache)
        return logits_with_mtp_loss(self.output, h_BSH, mtp_BSH, tokens_BS, self.model_args.mtp_loss_coef)
