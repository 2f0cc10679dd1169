"""KV-cache generation through the training model's own modules.

Legend: B sequences, T new tokens per step, S cache length (= ``[training]
seq_len``, also the trainer's sequence length), H hidden, N heads, E qk head dim
(P nope + R rope), C kv latent rank, D v head dim, V vocab, G completion tokens.

No second model: a cached step is ``model(tokens_BT)`` itself — embedding,
blocks (norms, residuals, dense FFN or MoE), head, and FSDP's hooks around them
(gathering, mixed-precision casts) — with each layer's attention module swapped,
for the rollout, for a stand-in that calls the module's own ``qkv`` and
``project_out`` and only replaces the core: new keys/values are written into a
cache at each sequence's own positions, and queries attend to the whole cache
through ``invariant_attention`` (the function the trainer's forward uses under
``BatchInvariantMode``). So every logit equals, bit for bit, the one the trainer
recomputes for the same position. DSA layers (GLM-5.2) also cache the lightning
indexer's keys and select each new query's top-k keys over the whole cache, as
the trainer's full pass does.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from titan_mok.models.common.decoder import MLADecoder
from titan_mok.models.common.mla import MLAttention
from titan_mok.models.glm_5_2.dsa import DSAttention
from titan_mok.rl.invariant import invariant_attention
from titan_mok.rl.sampling import sample


def has_kv_cache_step(model: torch.nn.Module) -> bool:
    """True for MLA decoders with MLA or DSA layers (Kimi K2.7 Code, GLM-5.2): the cached path.
    Other attentions (Gated DeltaNet, DeepSeek-V4's) decode by recomputation."""
    return isinstance(model, MLADecoder) and all(
        type(model.layers[str(i)].attention) in (MLAttention, DSAttention) for i in range(model.model_args.n_layers)
    )


class KVCache:
    """Per layer: keys ``[B, N, S, E]`` and values ``[B, N, S, D]`` after RoPE/up-projection
    (the tensors the trainer's attention sees), zero where nothing was written. Allocated at
    a layer's first write, in the dtype its projections produce (FSDP's compute dtype)."""

    def __init__(self, n_layers: int, batch: int, seq_len: int):
        self.batch, self.seq_len = batch, seq_len
        self.k_BNSE: list[torch.Tensor | None] = [None] * n_layers
        self.v_BNSD: list[torch.Tensor | None] = [None] * n_layers

    def write(
        self, layer: int, pos_BT: torch.Tensor, k_BNTE: torch.Tensor, v_BNTD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values at their positions; returns the layer's whole cache."""
        if self.k_BNSE[layer] is None:
            n_heads = k_BNTE.shape[1]
            self.k_BNSE[layer] = k_BNTE.new_zeros(self.batch, n_heads, self.seq_len, k_BNTE.shape[-1])
            self.v_BNSD[layer] = v_BNTD.new_zeros(self.batch, n_heads, self.seq_len, v_BNTD.shape[-1])
        rows_BT = torch.arange(self.batch, device=pos_BT.device)[:, None].expand_as(pos_BT)
        # [B, N, S, ·] caches seen as [B, S, N, ·]: each new token lands at (b, pos)
        self.k_BNSE[layer].transpose(1, 2)[rows_BT, pos_BT] = k_BNTE.transpose(1, 2)
        self.v_BNSD[layer].transpose(1, 2)[rows_BT, pos_BT] = v_BNTD.transpose(1, 2)
        return self.k_BNSE[layer], self.v_BNSD[layer]


def _per_sequence(x_1NMX: torch.Tensor, bsz: int, n_new: int) -> torch.Tensor:
    """``[1, N, B·T, X]`` → ``[B, N, T, X]``."""
    return x_1NMX.view(x_1NMX.shape[1], bsz, n_new, x_1NMX.shape[-1]).transpose(0, 1)


@dataclass
class _Positions:
    """Where the tokens of the next cached ``model(tokens_BT)`` call sit."""

    start: int | torch.Tensor = 0
    """0 for a prefill, a ``[B]`` tensor for one decoded token per sequence."""
    pos_BT: torch.Tensor | None = None


class _CachedMLAttention(nn.Module):
    """Stands in for one layer's MLAttention or DSAttention during a cached rollout (same call
    signature): the module's own ``qkv`` and ``project_out`` around a cached attention core;
    DSA layers also select their keys from a cache of the lightning indexer's keys."""

    def __init__(self, attn: MLAttention, layer: int, cache: KVCache, positions: _Positions):
        super().__init__()
        self.attn, self.layer, self.cache, self.positions = attn, layer, cache, positions
        self.index_k_BSJ: torch.Tensor | None = None  # DSA: the indexer's (rotated) key per position

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
        k_BNSE, v_BNSD = self.cache.write(
            self.layer, pos_BT, _per_sequence(k_1NME, bsz, n_new), _per_sequence(v_1NMD, bsz, n_new)
        )
        keep_B1TS = None
        if isinstance(attn, DSAttention):
            if attn.indexer is not None:  # a "full" IndexShare layer selects; the others reuse its choice
                topk_idx_BSK = self._select(x_1MH, q_latent_1MQ, rope_MR, bsz, n_new)
            if topk_idx_BSK is not None:
                keep_BTS = torch.zeros(bsz, n_new, self.cache.seq_len, dtype=torch.bool, device=x_BTH.device)
                keep_B1TS = keep_BTS.scatter_(-1, topk_idx_BSK, True).unsqueeze(1)  # broadcast over heads
        q_BNTE = _per_sequence(q_1NME, bsz, n_new)
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
        if self.index_k_BSJ is None:
            self.index_k_BSJ = k_BTJ.new_zeros(bsz, seq_len, indexer.head_dim)
        pos_BT = self.positions.pos_BT
        self.index_k_BSJ[torch.arange(bsz, device=pos_BT.device)[:, None], pos_BT] = k_BTJ
        q_BTIJ = q_1MIJ.view(bsz, n_new, -1, indexer.head_dim)  # [1, B·T, I, J] -> [B, T, I, J]
        # per query the trainer's [I, J] @ [J, S] against every cached key
        index_BTS = indexer.score(q_BTIJ, self.index_k_BSJ, x_1MH.view(bsz, n_new, -1))
        future_BTS = torch.arange(seq_len, device=pos_BT.device) > pos_BT[..., None]
        return indexer.select(index_BTS.masked_fill(future_BTS, float("-inf")))


class CachedDecoder:
    """Prefill the prompts once, then one token per sequence per step against the KV cache.
    Decode inside ``running()``: the layers' attention modules are swapped for its duration."""

    def __init__(self, model: MLADecoder, tokens_BS: torch.Tensor):
        self.model = model
        self.tokens_BS = tokens_BS
        self.positions = _Positions()
        self.cache = KVCache(model.model_args.n_layers, *tokens_BS.shape)

    @contextmanager
    def running(self):
        blocks = [self.model.layers[str(i)] for i in range(self.model.model_args.n_layers)]
        originals = [block.attention for block in blocks]
        for layer, block in enumerate(blocks):
            block.attention = _CachedMLAttention(block.attention, layer, self.cache, self.positions)
        try:
            yield self
        finally:
            for block, attention in zip(blocks, originals):
                block.attention = attention

    def _step(self, tokens_BT: torch.Tensor, start: int | torch.Tensor) -> torch.Tensor:
        bsz, n_new = tokens_BT.shape
        start_B1 = torch.as_tensor(start, device=tokens_BT.device).view(-1, 1)
        self.positions.start = start
        self.positions.pos_BT = (start_B1 + torch.arange(n_new, device=tokens_BT.device)).expand(bsz, n_new)
        return self.model(tokens_BT)

    def prefill(self, prompt_len_B: torch.Tensor, max_prompt: int) -> torch.Tensor:
        logits_BPV = self._step(self.tokens_BS[:, :max_prompt], 0)
        return logits_BPV[torch.arange(len(prompt_len_B), device=prompt_len_B.device), prompt_len_B - 1]

    def next_logits(self, pos_B: torch.Tensor) -> torch.Tensor:
        """Logits after the token just written at ``pos_B`` of each sequence."""
        return self._step(self.tokens_BS.gather(1, pos_B[:, None]), pos_B)[:, 0]


class RecomputeDecoder:
    """No cache, for attentions without a cache step: each step runs ``model.forward`` on
    the whole ``[B, S]`` buffer — exactly the trainer's input shape — and reads the rows
    it needs (causal: the unwritten tail does not reach them). Costs S-token forwards per
    generated token instead of one token's."""

    def __init__(self, model: torch.nn.Module, tokens_BS: torch.Tensor):
        self.model = model
        self.tokens_BS = tokens_BS

    @contextmanager
    def running(self):
        yield self  # the model runs as it is

    def _logits_at(self, pos_B: torch.Tensor) -> torch.Tensor:
        return self.model(self.tokens_BS)[torch.arange(len(pos_B), device=pos_B.device), pos_B]

    def prefill(self, prompt_len_B: torch.Tensor, max_prompt: int) -> torch.Tensor:
        return self._logits_at(prompt_len_B - 1)

    def next_logits(self, pos_B: torch.Tensor) -> torch.Tensor:
        return self._logits_at(pos_B)


@dataclass
class Rollout:
    tokens_BS: torch.Tensor
    """Prompt, completion, then padding: the trainer's input (S = cache length)."""
    prompt_len_B: torch.Tensor
    completion_BG: torch.Tensor
    """Sampled tokens; padding after a sequence's stop token."""
    logprobs_BG: torch.Tensor
    """fp32 logprob of each sampled token under the rollout's logits (0 where masked)."""
    mask_BG: torch.Tensor
    """True for generated tokens up to and including the stop token."""


def _all_done_across_ranks(done_B: torch.Tensor) -> bool:
    """NOTE: host sync and an all-reduce, once per decode step: every rank runs the
    same number of steps (the MoE layer's EP collectives need it)."""
    flag = done_B.all().to(torch.int64)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    keys_B: torch.Tensor,
    *,
    seq_len: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: tuple[int, ...],
    pad_id: int,
) -> Rollout:
    """Sample up to ``max_new_tokens`` per prompt (stream ``keys_B[b]`` for prompt b), with the
    KV cache where the model has a cache step (``has_kv_cache_step``), by recomputation otherwise."""
    device = keys_B.device
    bsz = len(prompts)
    for b, prompt in enumerate(prompts):
        if not prompt or len(prompt) + max_new_tokens > seq_len:
            raise ValueError(
                f"prompt {b} has {len(prompt)} tokens: it must be non-empty and leave room for "
                f"[rl] max_new_tokens = {max_new_tokens} within [training] seq_len = {seq_len}"
            )
    prompt_len_B = torch.tensor([len(p) for p in prompts], device=device)
    tokens_BS = torch.full((bsz, seq_len), pad_id, dtype=torch.long, device=device)
    for b, prompt in enumerate(prompts):
        tokens_BS[b, : len(prompt)] = torch.tensor(prompt, device=device)

    rows_B = torch.arange(bsz, device=device)
    stop_ids_X = torch.tensor(stop_ids, device=device)
    completion_BG = torch.full((bsz, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs_BG = torch.zeros(bsz, max_new_tokens, dtype=torch.float32, device=device)
    mask_BG = torch.zeros(bsz, max_new_tokens, dtype=torch.bool, device=device)
    done_B = torch.zeros(bsz, dtype=torch.bool, device=device)

    decoder = (CachedDecoder if has_kv_cache_step(model) else RecomputeDecoder)(model, tokens_BS)
    with decoder.running():
        logits_BV = decoder.prefill(prompt_len_B, max(len(p) for p in prompts))
        for t in range(max_new_tokens):
            token_B, logprob_B = sample(logits_BV, keys_B, t, temperature, top_p)
            active_B = ~done_B
            token_B = torch.where(active_B, token_B, pad_id)
            completion_BG[:, t] = token_B
            logprobs_BG[:, t] = torch.where(active_B, logprob_B, 0.0)
            mask_BG[:, t] = active_B
            tokens_BS[rows_B, prompt_len_B + t] = token_B
            done_B = done_B | torch.isin(token_B, stop_ids_X)
            if t + 1 == max_new_tokens or _all_done_across_ranks(done_B):
                break
            logits_BV = decoder.next_logits(prompt_len_B + t)
    return Rollout(tokens_BS, prompt_len_B, completion_BG, logprobs_BG, mask_BG)
