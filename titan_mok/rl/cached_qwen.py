"""Cached decode step of Qwen3.5: gated full attention with a KV cache, Gated DeltaNet
with its chunk state.

Legend: B sequences, T new tokens per step, S cache length, H hidden, M = B·T,
Hq query heads, Hkv key/value heads, D attention head dim, F = Hq·D, P prefill
length, N chunks, C DeltaNet chunk length, Hv DeltaNet value heads, Dk/Dv its
key/value head dims, W conv width, J conv channels.

Full-attention layers: the module's own ``project`` and ``project_out`` around a KV
cache and ``invariant_attention`` (as ``cached_mla``).

DeltaNet layers: the trainer runs the chunked rule with chunk length C. A token at
position p (slot r = p mod C of chunk n = p // C) comes out of chunk n's products as a
function of the chunk's slots 0..r and the state entering chunk n: later slots enter
only through exactly-zero coefficients (masked decay, the strictly-lower solve). So a
decode step recomputes the whole chunk — its written slots, zeros in the others — from
the cached state entering it, with the trainer's function and per-chunk shapes, and
gets the trainer's bits; when a token fills slot C − 1 the chunk's end state becomes
the next chunk's. Per layer the cache holds that state [B, Hv, Dk, Dv], the current
chunk's prepared q/k/v/g/beta and the W − 1 last pre-conv rows (the conv's left
context). Per step and value head: O(C·(C + Dk)·Dv), whatever the position.
"""

import torch
from torch import nn

from titan_mok.models.qwen3_5_397b_a17b.gated_deltanet import GatedDeltaNet, gated_delta_chunks, prepare_delta_inputs
from titan_mok.models.qwen3_5_397b_a17b.model import GatedAttention, Qwen35Model
from titan_mok.rl.invariant import invariant_attention
from titan_mok.rl.kv_cache import LayerKVCache, Positions, per_sequence


def supports(model: nn.Module) -> bool:
    """Qwen3.5 trunks whose token mixers are the model's own GatedAttention / GatedDeltaNet."""
    if not isinstance(model, Qwen35Model):
        return False
    blocks = [model.layers[str(i)] for i in range(model.model_args.n_layers)]
    return all(
        type(block.attention) is GatedAttention
        if block.full_attention
        else type(block.linear_attention) is GatedDeltaNet
        for block in blocks
    )


def stand_ins(
    model: Qwen35Model, positions: Positions, batch: int, seq_len: int
) -> list[tuple[nn.Module, str, nn.Module]]:
    """(block, "attention" or "linear_attention", its cached stand-in) for every trunk layer
    (the MTP module is not part of ``forward``)."""
    swaps = []
    for i in range(model.model_args.n_layers):
        block = model.layers[str(i)]
        if block.full_attention:
            cache = LayerKVCache(batch, seq_len)
            swaps.append((block, "attention", CachedGatedAttention(block.attention, cache, positions)))
        else:
            swaps.append((block, "linear_attention", CachedGatedDeltaNet(block.linear_attention, positions)))
    return swaps


class CachedGatedAttention(nn.Module):
    """Stands in for one layer's GatedAttention during a cached rollout (same call signature)."""

    def __init__(self, attn: GatedAttention, cache: LayerKVCache, positions: Positions):
        super().__init__()
        self.attn, self.cache, self.positions = attn, cache, positions

    def forward(self, x_BTH: torch.Tensor, rope_SR: torch.Tensor) -> torch.Tensor:
        """``rope_SR``: the model's whole rotary cache; each new token takes its position's row."""
        attn, pos_BT = self.attn, self.positions.pos_BT
        bsz, n_new, dim = x_BTH.shape
        # The B·T new tokens as one sequence whose rotary rows are their own positions.
        x_1MH = x_BTH.reshape(1, bsz * n_new, dim)
        q_1HqMD, gate_1MF, k_1HkvMD, v_1HkvMD = attn.project(x_1MH, rope_SR[pos_BT.reshape(-1)])
        k_BHkvSD, v_BHkvSD = self.cache.write(
            pos_BT, per_sequence(k_1HkvMD, bsz, n_new), per_sequence(v_1HkvMD, bsz, n_new)
        )
        group = attn.n_heads // attn.n_kv_heads  # query head h reads kv head h // group, as the trainer's SDPA
        out_BHqTD = invariant_attention(
            per_sequence(q_1HqMD, bsz, n_new),
            k_BHkvSD.repeat_interleave(group, dim=1),
            v_BHkvSD.repeat_interleave(group, dim=1),
            attn.head_dim**-0.5,
            self.positions.start,
        )
        return attn.project_out(out_BHqTD, gate_1MF.view(bsz, n_new, -1))  # [1, B·T, F] -> [B, T, F]


class CachedGatedDeltaNet(nn.Module):
    """Stands in for one layer's GatedDeltaNet during a cached rollout (same call signature).

    The prefill runs the trainer's chunked pass over the padded prompts and keeps, per
    sequence, what its first generated token (at its prompt length) needs; then one token
    per sequence per step."""

    def __init__(self, mixer: GatedDeltaNet, positions: Positions):
        super().__init__()
        self.mixer, self.positions = mixer, positions
        self.state_BHvDkDv: torch.Tensor | None = None  # entering each sequence's current chunk
        self.chunk: list[torch.Tensor] | None = None
        """The current chunk's prepared q, k [B, Hv, C, Dk], v [B, Hv, C, Dv], g, beta [B, Hv, C];
        zero in unwritten slots."""
        self.history_BWJ: torch.Tensor | None = None  # the W − 1 pre-conv rows before the next position

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        start = self.positions.start
        if isinstance(start, int):
            if start != 0 or self.positions.prompt_len_B is None:
                raise ValueError(
                    "CachedGatedDeltaNet: a multi-token step must be the prefill (start 0, with "
                    f"Positions.prompt_len_B set), got start {start}"
                )
            return self._prefill(x_BTH, self.positions.prompt_len_B)
        if x_BTH.shape[1] != 1:
            raise ValueError(f"CachedGatedDeltaNet: a decode step takes one token per sequence, got {x_BTH.shape[1]}")
        return self._decode(x_BTH, self.positions.pos_BT[:, 0])

    def _prefill(self, x_BPH: torch.Tensor, prompt_len_B: torch.Tensor) -> torch.Tensor:
        mixer = self.mixer
        qkv_BPJ = mixer.in_proj_qkv(x_BPH)
        inputs = mixer.delta_inputs(x_BPH, mixer.conv(qkv_BPJ))
        prepared = prepare_delta_inputs(*inputs)
        # each sequence's first generated token sits at its prompt length, in chunk prompt_len // C
        chunk_B = prompt_len_B // mixer.chunk_size
        o_BHvPDv, _, self.state_BHvDkDv = gated_delta_chunks(*prepared, mixer.chunk_size, chunk_B=chunk_B)
        self._start_chunk_at(prompt_len_B, qkv_BPJ, prepared)
        return mixer.project_out(o_BHvPDv.transpose(1, 2).to(inputs[2].dtype), x_BPH)

    def _start_chunk_at(self, pos_B: torch.Tensor, qkv_BPJ: torch.Tensor, prepared) -> None:
        """Sequence b's first generated token sits at ``pos_B[b]`` (its prompt length), in
        chunk n = pos // C: that chunk holds the prompt's positions from n·C to pos − 1, and
        the conv reads the W − 1 rows before pos (zeros before position 0)."""
        chunk_size, width = self.mixer.chunk_size, self.mixer.conv1d.kernel_size[0]
        rows_B1 = torch.arange(len(pos_B), device=pos_B.device)[:, None]
        n_B = pos_B // chunk_size
        chunk_pos_BC = n_B[:, None] * chunk_size + torch.arange(chunk_size, device=pos_B.device)
        written_BC = chunk_pos_BC < pos_B[:, None]
        taken_BC = torch.where(written_BC, chunk_pos_BC, 0)
        # [B, Hv, P, ·] indexed at (b, :, positions [B, C]) -> [B, C, Hv, ·] -> [B, Hv, C, ·]
        self.chunk = [
            torch.where(written_BC.view(*written_BC.shape, *[1] * (x.dim() - 2)), x[rows_B1, :, taken_BC], 0)
            .transpose(1, 2)
            .contiguous()
            for x in prepared
        ]
        hist_pos_BW = pos_B[:, None] - (width - 1) + torch.arange(width - 1, device=pos_B.device)
        history_BWJ = qkv_BPJ[rows_B1, hist_pos_BW.clamp(min=0)]
        self.history_BWJ = torch.where((hist_pos_BW >= 0)[..., None], history_BWJ, 0)

    def _decode(self, x_B1H: torch.Tensor, pos_B: torch.Tensor) -> torch.Tensor:
        mixer, chunk_size = self.mixer, self.mixer.chunk_size
        qkv_B1J = mixer.in_proj_qkv(x_B1H)
        inputs = mixer.delta_inputs(x_B1H, mixer.conv(qkv_B1J, self.history_BWJ))
        self.history_BWJ = torch.cat([self.history_BWJ, qkv_B1J], dim=1)[:, 1:]
        rows_B = torch.arange(len(pos_B), device=pos_B.device)
        slot_B = pos_B % chunk_size
        for buffer, new in zip(self.chunk, prepare_delta_inputs(*inputs)):  # new: [B, Hv, 1, ·]
            buffer[rows_B, :, slot_B] = new[:, :, 0]
        o_BHvCDv, end_BHvDkDv, _ = gated_delta_chunks(*self.chunk, chunk_size, self.state_BHvDkDv)
        o_B1HvDv = o_BHvCDv[rows_B, :, slot_B][:, None].to(inputs[2].dtype)  # indexed: [B, Hv, Dv] -> [B, 1, Hv, Dv]
        # sequences whose token filled its chunk's last slot move on to the next chunk
        full_B = slot_B == chunk_size - 1
        self.state_BHvDkDv = torch.where(full_B[:, None, None, None], end_BHvDkDv, self.state_BHvDkDv)
        self.chunk = [torch.where(full_B.view(-1, *[1] * (x.dim() - 1)), 0, x) for x in self.chunk]
        return mixer.project_out(o_B1HvDv, x_B1H)
