"""What every cached decode step shares: where the new tokens sit, and per-position
tensors (a layer's keys/values, other per-token state) written at each sequence's own
positions.

Legend: B sequences, T new tokens per step, S cache length (= ``[training]
seq_len``), N heads, E key head dim, D value head dim, M = B·T.
"""

from dataclasses import dataclass

import torch


@dataclass
class Positions:
    """Where the tokens of the next cached ``model(tokens_BT)`` call sit; shared by a
    rollout's stand-ins and updated by the decoder before each call."""

    start: int | torch.Tensor = 0
    """0 for a prefill, a ``[B]`` tensor for one decoded token per sequence."""
    pos_BT: torch.Tensor | None = None
    prompt_len_B: torch.Tensor | None = None
    """Each sequence's prompt length, set before the prefill (its rows from there on are padding)."""


def write_at(buffer_BX_: torch.Tensor, index_BT: torch.Tensor, x_BT_: torch.Tensor) -> None:
    """``buffer[b, index[b, t]] = x[b, t]``: each sequence's new rows at its own indices."""
    rows_BT = torch.arange(buffer_BX_.shape[0], device=index_BT.device)[:, None].expand_as(index_BT)
    buffer_BX_[rows_BT, index_BT] = x_BT_


class PositionRows:
    """One per-position tensor of every sequence, ``[B, S, ·]``, zero where nothing was
    written; allocated at the first write, in the dtype of the rows written."""

    def __init__(self, batch: int, seq_len: int):
        self.batch, self.seq_len = batch, seq_len
        self.rows_BSX: torch.Tensor | None = None

    def write(self, pos_BT: torch.Tensor, x_BTX: torch.Tensor) -> torch.Tensor:
        """Store the new rows at their positions; returns the whole tensor."""
        if self.rows_BSX is None:
            self.rows_BSX = x_BTX.new_zeros(self.batch, self.seq_len, *x_BTX.shape[2:])
        write_at(self.rows_BSX, pos_BT, x_BTX)
        return self.rows_BSX


class LayerKVCache:
    """One layer's keys ``[B, N, S, E]`` and values ``[B, N, S, D]`` as the trainer's
    attention sees them, zero where nothing was written. Allocated at the first write,
    in the dtype the projections produce (FSDP's compute dtype)."""

    def __init__(self, batch: int, seq_len: int):
        self.batch, self.seq_len = batch, seq_len
        self.k_BNSE: torch.Tensor | None = None
        self.v_BNSD: torch.Tensor | None = None

    def write(self, pos_BT: torch.Tensor, k_BNTE: torch.Tensor, v_BNTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values at their positions; returns the whole cache."""
        if self.k_BNSE is None:
            n_heads = k_BNTE.shape[1]
            self.k_BNSE = k_BNTE.new_zeros(self.batch, n_heads, self.seq_len, k_BNTE.shape[-1])
            self.v_BNSD = v_BNTD.new_zeros(self.batch, n_heads, self.seq_len, v_BNTD.shape[-1])
        # [B, N, S, ·] caches seen as [B, S, N, ·]: each new token lands at (b, pos)
        write_at(self.k_BNSE.transpose(1, 2), pos_BT, k_BNTE.transpose(1, 2))
        write_at(self.v_BNSD.transpose(1, 2), pos_BT, v_BNTD.transpose(1, 2))
        return self.k_BNSE, self.v_BNSD


def per_sequence(x_1NMX: torch.Tensor, bsz: int, n_new: int) -> torch.Tensor:
    """``[1, N, B·T, X]`` → ``[B, N, T, X]``."""
    return x_1NMX.view(x_1NMX.shape[1], bsz, n_new, x_1NMX.shape[-1]).transpose(0, 1)
