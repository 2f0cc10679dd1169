"""Cached decode step of DeepSeek-V4 attention (sliding window + HCA/CSA compressed entries).

Legend: B sequences, T new tokens per step, S cache length (= ``[training] seq_len``),
H hidden, N query heads, D head dim (the shared key/value), R rope dims, W window
keys, E compressed entries (S // M), M compression ratio, P compressor projection
width, I indexer heads, J indexer head dim, Y = B·T, X = E + 1 (the entries and a scratch row).

Each layer's ``Attention`` is stood in for by one that runs the module's own pieces
(``project``, ``attend``, ``project_out``; the compressors' ``project``/``windows``/
``pool``; the indexer's ``queries``/``top``) on the new tokens against a cache of
one sequence's keys, sized as the trainer's sequence (S positions, E = S // M entries):

- the rotated shared key/value of every position; a query's window is the last
  W = min(window, S) positions up to its own, zero and masked before position 0;
- per compressor (the layer's, and the indexer's for CSA), the fp32 per-position
  projections (kv, gate scores + ``ape``) and the entries: an entry is pooled from
  its positions when the token that completes its window is written, the same
  ``windows``/``pool`` code the trainer runs over all entries at once; entries not yet
  complete stay masked by causality (w < (pos + 1) // M), exactly as in the trainer.

So each query meets the trainer's key set, in the same layout, with the same
reduction lengths (W window keys, E entries, one sink), and its logits equal the
trainer's bit for bit under ``BatchInvariantMode``.
"""

import torch
from torch import nn

from titan_mok.models.deepseek_v4_pro.attention import Attention, Compressor
from titan_mok.models.deepseek_v4_pro.model import DeepSeekV4Model
from titan_mok.rl.kv_cache import PositionRows, Positions, write_at


def supports(model: nn.Module) -> bool:
    """DeepSeek-V4 models (every block's attention is the V4 ``Attention``)."""
    return isinstance(model, DeepSeekV4Model) and all(isinstance(block.attention, Attention) for block in model.layers.values())


def stand_ins(model: DeepSeekV4Model, positions: Positions, batch: int, seq_len: int) -> list[tuple[nn.Module, str, nn.Module]]:
    """(block, "attention", its cached stand-in) for every trunk layer (the MTP module is not
    part of ``forward``)."""
    return [
        (block, "attention", CachedDSV4Attention(block.attention, positions, batch, seq_len)) for block in model.layers.values()
    ]


class CompressorCache:
    """One compressor's rollout state: fp32 projections per position [B, S, P] and the
    pooled entries [B, E, D] (plus one scratch row that absorbs the writes of tokens that
    complete no window)."""

    def __init__(self, compressor: Compressor, batch: int, seq_len: int):
        self.compressor, self.batch = compressor, batch
        self.n_entries = seq_len // compressor.ratio
        self.kv, self.score = PositionRows(batch, seq_len), PositionRows(batch, seq_len)
        self.entries_BXD: torch.Tensor | None = None  # the scratch row last

    def update(self, x_BTH: torch.Tensor, pos_BT: torch.Tensor, rope_SR: torch.Tensor) -> torch.Tensor:
        """Write the new tokens' projections, pool the entry each token completes; returns
        all E entries [B, E, D] (zeros where never pooled: those are not causal yet)."""
        comp, m = self.compressor, self.compressor.ratio
        kv_BTP, score_BTP = comp.project(x_BTH, pos_BT)
        kv_BSP, score_BSP = self.kv.write(pos_BT, kv_BTP), self.score.write(pos_BT, score_BTP)
        if self.entries_BXD is None:
            self.entries_BXD = x_BTH.new_zeros(self.batch, self.n_entries + 1, comp.head_dim)
        # the entry whose window ends at or before each token (pooled for every token, kept
        # only where the token is that window's last position)
        entry_BT = ((pos_BT + 1) // m - 1).clamp(min=0)
        pooled_BTD = comp.pool(*comp.windows(kv_BSP, score_BSP, entry_BT), entry_BT, rope_SR, x_BTH.dtype)
        completes_BT = (pos_BT + 1) % m == 0
        write_at(self.entries_BXD, torch.where(completes_BT, entry_BT, self.n_entries), pooled_BTD)
        return self.entries_BXD[:, : self.n_entries]


class CachedDSV4Attention(nn.Module):
    """Stands in for one layer's ``Attention`` during a cached rollout (same call signature)."""

    def __init__(self, attn: Attention, positions: Positions, batch: int, seq_len: int):
        super().__init__()
        self.attn, self.positions, self.batch = attn, positions, batch
        self.width = min(attn.window, seq_len)  # the trainer's window width (its S is the cache's)
        self.kv = PositionRows(batch, seq_len)  # the rotated shared key/value per position
        self.compressed = CompressorCache(attn.compressor, batch, seq_len) if attn.compressor is not None else None
        self.index_keys = CompressorCache(attn.indexer.compressor, batch, seq_len) if attn.indexer is not None else None

    def forward(self, x_BTH: torch.Tensor, rope_SR: torch.Tensor) -> torch.Tensor:
        """``rope_SR``: the layer's whole rotary cache, as the block received it; each new
        token takes the row of its own position."""
        attn, pos_BT = self.attn, self.positions.pos_BT
        bsz, n_new, dim = x_BTH.shape
        # per-token pieces on the B·T new tokens as one sequence whose rotary rows are their own positions
        x_1YH = x_BTH.reshape(1, bsz * n_new, dim)
        rope_YR = rope_SR[pos_BT.reshape(-1)]
        q_residual_1YQ, q_1YND, kv_1YD = attn.project(x_1YH, rope_YR)
        window_keep_BTW, kv_win_BTWD = self._window(pos_BT, kv_1YD.view(bsz, n_new, -1))
        entries_BED = visible_BTE = None
        if self.compressed is not None:
            entries_BED = self.compressed.update(x_BTH, pos_BT, rope_SR)
            causal_BTE = torch.arange(self.compressed.n_entries, device=x_BTH.device) < ((pos_BT + 1) // attn.compress_ratio)[..., None]
            visible_BTE = causal_BTE
            if self.index_keys is not None:
                keys_BEJ = self.index_keys.update(x_BTH, pos_BT, rope_SR)
                q_1YIJ, weights_1YI = attn.indexer.queries(x_1YH, q_residual_1YQ, rope_YR)
                # [1, B·T, I, ·] -> [B, T, I, ·]
                q_BTIJ, weights_BTI = q_1YIJ.view(bsz, n_new, *q_1YIJ.shape[2:]), weights_1YI.view(bsz, n_new, -1)
                visible_BTE = attn.indexer.top(q_BTIJ, weights_BTI, keys_BEJ, causal_BTE)
        q_BTND = q_1YND.view(bsz, n_new, *q_1YND.shape[2:])  # [1, B·T, N, D] -> [B, T, N, D]
        o_BTND = attn.attend(q_BTND, kv_win_BTWD, window_keep_BTW, entries_BED, visible_BTE)
        return attn.project_out(o_BTND.reshape(1, bsz * n_new, *o_BTND.shape[2:]), rope_YR).view(bsz, n_new, dim)

    def _window(self, pos_BT: torch.Tensor, kv_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys at their positions; each new query's window: keep [B, T, W] and
        fp32 keys [B, T, W, D] (zero before position 0, as the trainer's padding)."""
        kv_BSD = self.kv.write(pos_BT, kv_BTD)
        window_BTW = pos_BT[..., None] - (self.width - 1) + torch.arange(self.width, device=pos_BT.device)
        keep_BTW = window_BTW >= 0
        rows_B11 = torch.arange(self.batch, device=pos_BT.device)[:, None, None]
        kv_win_BTWD = kv_BSD[rows_B11, window_BTW.clamp(min=0)].float().masked_fill(~keep_BTW[..., None], 0.0)
        return keep_BTW, kv_win_BTWD
