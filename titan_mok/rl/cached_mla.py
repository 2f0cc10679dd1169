"""Cached decode step of MLA decoders (Kimi K2.7 Code's MLA, GLM-5.2's DSA layers).

Legend: B sequences, T new tokens per step, S cache length, H hidden, N heads,
E qk head dim (P nope + R rope), C kv latent rank, D v head dim, M = B·T,
Q q latent rank, I indexer heads, J indexer head dim, K top-k.

Each layer's attention module is stood in for by one that calls the module's own
``qkv`` and ``project_out`` and only replaces the core: new keys/values are
written into the cache at each sequence's own positions and queries attend to the
whole cache through ``invariant_attention`` (the function the trainer's forward
uses under ``BatchInvariantMode``). DSA layers also cache the lightning indexer's
keys and select each new query's top-k keys over the whole cache, as the trainer's
full pass does.
"""

import torch
from torch import nn

from titan_mok.models.common.decoder import MLADecoder
from titan_mok.models.common.mla import MLAttention
from titan_mok.models.glm_5_2.dsa import DSAttention
from titan_mok.rl.invariant import invariant_attention
from titan_mok.rl.kv_cache import LayerKVCache, PositionRows, Positions, per_sequence


def supports(model: nn.Module) -> bool:
    """MLA decoders whose every layer is MLA or DSA."""
    return isinstance(model, MLADecoder) and all(
        type(model.layers[str(i)].attention) in (MLAttention, DSAttention) for i in range(model.model_args.n_layers)
    )


def stand_ins(model: MLADecoder, positions: Positions, batch: int, seq_len: int) -> list[tuple[nn.Module, str, nn.Module]]:
    """(block, "attention", its cached stand-in) for every layer."""
    blocks = [model.layers[str(i)] for i in range(model.model_args.n_layers)]
    return [
        (block, "attention", CachedMLAttention(block.attention, LayerKVCache(batch, seq_len), positions))
        for block in blocks
    ]


class CachedMLAttention(nn.Module):
    """Stands in for one layer's MLAttention or DSAttention during a cached rollout (same call
    signature): the module's own ``qkv`` and ``project_out`` around a cached attention core;
    DSA layers also select their keys from a cache of the lightning indexer's keys."""

    def __init__(self, attn: MLAttention, cache: LayerKVCache, positions: Positions):
        super().__init__()
        self.attn, self.cache, self.positions = attn, cache, positions
        self.index_keys = PositionRows(cache.batch, cache.seq_len)  # DSA: the indexer's (rotated) key per position

    def forward(self, x_BTH: torch.Tensor, rope_SR: torch.Tensor, topk_idx_BSK: torch.Tensor | None = None):
        """``rope_SR``: the model's whole rotary cache, as the block received it (FSDP casts it
        like any input); each new token takes the row of its own position."""
        attn, pos_BT = self.attn, self.positions.pos_BT
        bsz, n_new, dim = x_BTH.shape
        # The B·T new tokens as one sequence whose rotary rows are their own positions: every op
        # of qkv (projections, latent norms, RoPE) is per token.
        x_1MH = x_BTH.reshape(1, bsz * n_new, dim)
        rope_MR = rope_SR[pos_BT.reshape(-1)]
        q_latent_1MQ = attn.q_norm(attn.wq_a(x_1MH))
        q_1NME, k_1NME, v_1NMD = attn.qkv(x_1MH, q_latent_1MQ, rope_MR)
        k_BNSE, v_BNSD = self.cache.write(pos_BT, per_sequence(k_1NME, bsz, n_new), per_sequence(v_1NMD, bsz, n_new))
        keep_B1TS = None
        if isinstance(attn, DSAttention):
            if attn.indexer is not None:  # a "full" IndexShare layer selects; the others reuse its choice
                topk_idx_BSK = self._select(x_1MH, q_latent_1MQ, rope_MR, bsz, n_new)
            if topk_idx_BSK is not None:
                keep_BTS = torch.zeros(bsz, n_new, self.cache.seq_len, dtype=torch.bool, device=x_BTH.device)
                keep_B1TS = keep_BTS.scatter_(-1, topk_idx_BSK, True).unsqueeze(1)  # broadcast over heads
        q_BNTE = per_sequence(q_1NME, bsz, n_new)
        out_BNTD = invariant_attention(q_BNTE, k_BNSE, v_BNSD, attn.softmax_scale, self.positions.start, keep_B1TS)
        return attn.project_out(out_BNTD), topk_idx_BSK

    def _select(self, x_1MH, q_latent_1MQ, rope_MR, bsz: int, n_new: int) -> torch.Tensor | None:
        """``LightningIndexer.forward`` + ``select`` for the new queries against every cached
        position (the trainer's sequence is the whole cache: same per-query shapes, same ops)."""
        indexer, seq_len = self.attn.indexer, self.cache.seq_len
        if seq_len <= self.attn.index_topk:
            return None  # as in training: every causal key is selected, the indexer is skipped
        q_1MIJ, k_1MJ = indexer.project(x_1MH, q_latent_1MQ, rope_MR)
        k_BTJ = k_1MJ.view(bsz, n_new, indexer.head_dim)  # [1, B·T, J] -> [B, T, J]
        pos_BT = self.positions.pos_BT
        index_k_BSJ = self.index_keys.write(pos_BT, k_BTJ)
        q_BTIJ = q_1MIJ.view(bsz, n_new, -1, indexer.head_dim)  # [1, B·T, I, J] -> [B, T, I, J]
        # per query the trainer's [I, J] @ [J, S] against every cached key
        index_BTS = indexer.score(q_BTIJ, index_k_BSJ, x_1MH.view(bsz, n_new, -1))
        future_BTS = torch.arange(seq_len, device=pos_BT.device) > pos_BT[..., None]
        return indexer.select(index_BTS.masked_fill(future_BTS, float("-inf")))
