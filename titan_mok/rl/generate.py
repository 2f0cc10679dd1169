"""KV-cache generation through the training model's own modules.

Legend: B sequences, T new tokens per step, S cache length (= ``[training]
seq_len``, also the trainer's sequence length), H hidden, N heads, E qk head dim
(P nope + R rope), C kv latent rank, D v head dim, V vocab, G completion tokens.

No second model: :func:`forward_step` walks the model's embedding, blocks
(their norms, MLA projections, dense FFN or MoE) and head, and only the
attention core differs from ``model.forward``: new keys/values are written into
a cache at each sequence's own positions, and queries attend to the whole
cache through ``invariant_attention`` (the function the trainer's forward uses
under ``BatchInvariantMode``), so every logit equals, bit for bit, the one the
trainer recomputes for the same position.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_mok.models.common.decoder import MLADecoder
from titan_mok.models.common.mla import MLAttention
from titan_mok.rl.invariant import invariant_attention
from titan_mok.rl.sampling import sample


def has_kv_cache_step(model: torch.nn.Module) -> bool:
    """True for MLA decoders with plain MLAttention layers (Kimi K2.7 Code): the cached path.
    Other attentions (DSA, Gated DeltaNet, DeepSeek-V4's) decode by recomputation."""
    return isinstance(model, MLADecoder) and all(
        type(model.layers[str(i)].attention) is MLAttention for i in range(model.model_args.n_layers)
    )


class KVCache:
    """Per layer: keys ``[B, N, S, E]`` and values ``[B, N, S, D]`` after RoPE/up-projection
    (the tensors the trainer's attention sees), zero where nothing was written."""

    def __init__(self, model: MLADecoder, batch: int, seq_len: int, dtype: torch.dtype, device: torch.device):
        a = model.model_args
        self.k_BNSE = [
            torch.zeros(batch, a.n_heads, seq_len, a.qk_head_dim, dtype=dtype, device=device) for _ in range(a.n_layers)
        ]
        self.v_BNSD = [
            torch.zeros(batch, a.n_heads, seq_len, a.v_head_dim, dtype=dtype, device=device) for _ in range(a.n_layers)
        ]


def _per_sequence(x_1NMX: torch.Tensor, bsz: int, n_new: int) -> torch.Tensor:
    """``[1, N, B·T, X]`` → ``[B, N, T, X]``."""
    return x_1NMX.view(x_1NMX.shape[1], bsz, n_new, x_1NMX.shape[-1]).transpose(0, 1)


def _mla_step(
    attn: MLAttention,
    x_BTH: torch.Tensor,
    rope_BTR: torch.Tensor,
    start: int | torch.Tensor,
    pos_BT: torch.Tensor,
    layer: int,
    cache: KVCache,
) -> torch.Tensor:
    """``MLAttention.forward`` for T new tokens per sequence at positions ``pos_BT``
    (``start`` + 0..T-1), with a cache: the module's own ``qkv`` and ``project_out``
    around a cached attention core."""
    bsz, n_new, dim = x_BTH.shape
    # The B·T new tokens as one sequence whose rotary rows are their own positions: every op
    # of qkv (projections, latent norms, RoPE) is per token.
    x_1MH = x_BTH.reshape(1, bsz * n_new, dim)
    q_1NME, k_1NME, v_1NMD = attn.qkv(x_1MH, attn.q_norm(attn.wq_a(x_1MH)), rope_BTR.reshape(bsz * n_new, -1))
    q_BNTE = _per_sequence(q_1NME, bsz, n_new)
    rows_BT = torch.arange(bsz, device=pos_BT.device)[:, None].expand(bsz, n_new)
    # [B, N, S, ·] caches seen as [B, S, N, ·]: write each new token at (b, pos)
    cache.k_BNSE[layer].transpose(1, 2)[rows_BT, pos_BT] = _per_sequence(k_1NME, bsz, n_new).transpose(1, 2)
    cache.v_BNSD[layer].transpose(1, 2)[rows_BT, pos_BT] = _per_sequence(v_1NMD, bsz, n_new).transpose(1, 2)
    out_BNTD = invariant_attention(q_BNTE, cache.k_BNSE[layer], cache.v_BNSD[layer], attn.softmax_scale, start)
    return attn.project_out(out_BNTD)


def forward_step(model: MLADecoder, tokens_BT: torch.Tensor, start: int | torch.Tensor, cache: KVCache) -> torch.Tensor:
    """``model(tokens)`` for T new tokens per sequence at positions ``start`` + 0..T-1
    (``start``: 0 for a prefill, a ``[B]`` tensor for one decoded token); logits ``[B, T, V]``."""
    bsz, n_new = tokens_BT.shape
    start_B1 = torch.as_tensor(start, device=tokens_BT.device).view(-1, 1)
    pos_BT = (start_B1 + torch.arange(n_new, device=tokens_BT.device)).expand(bsz, n_new)
    h_BTH = model.tok_embeddings(tokens_BT)
    rope_BTR = model.rope_cache[pos_BT]
    for layer_id in range(model.model_args.n_layers):
        block = model.layers[str(layer_id)]
        h_BTH = h_BTH + _mla_step(
            block.attention, block.attention_norm(h_BTH), rope_BTR, start, pos_BT, layer_id, cache
        )
        ffn = block.moe if block.moe_enabled else block.feed_forward
        h_BTH = h_BTH + ffn(block.ffn_norm(h_BTH))
    return model.output(model.norm(h_BTH))


class CachedDecoder:
    """Prefill the prompts once, then one token per sequence per step against the KV cache."""

    def __init__(self, model: MLADecoder, tokens_BS: torch.Tensor):
        self.model = model
        self.tokens_BS = tokens_BS
        self.cache = KVCache(model, *tokens_BS.shape, model.tok_embeddings.weight.dtype, tokens_BS.device)

    def prefill(self, prompt_len_B: torch.Tensor, max_prompt: int) -> torch.Tensor:
        logits_BPV = forward_step(self.model, self.tokens_BS[:, :max_prompt], 0, self.cache)
        return logits_BPV[torch.arange(len(prompt_len_B), device=prompt_len_B.device), prompt_len_B - 1]

    def next_logits(self, pos_B: torch.Tensor) -> torch.Tensor:
        """Logits after the token just written at ``pos_B`` of each sequence."""
        token_B1 = self.tokens_BS.gather(1, pos_B[:, None])
        return forward_step(self.model, token_B1, pos_B, self.cache)[:, 0]


class RecomputeDecoder:
    """No cache, for attentions without a cache step: each step runs ``model.forward`` on
    the whole ``[B, S]`` buffer — exactly the trainer's input shape — and reads the rows
    it needs (causal: the unwritten tail does not reach them). Costs S-token forwards per
    generated token instead of one token's."""

    def __init__(self, model: torch.nn.Module, tokens_BS: torch.Tensor):
        self.model = model
        self.tokens_BS = tokens_BS

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

    decoder = (CachedDecoder if has_kv_cache_step(model) else RecomputeDecoder)(model, tokens_BS)
    logits_BV = decoder.prefill(prompt_len_B, max(len(p) for p in prompts))

    rows_B = torch.arange(bsz, device=device)
    stop_ids_X = torch.tensor(stop_ids, device=device)
    completion_BG = torch.full((bsz, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs_BG = torch.zeros(bsz, max_new_tokens, dtype=torch.float32, device=device)
    mask_BG = torch.zeros(bsz, max_new_tokens, dtype=torch.bool, device=device)
    done_B = torch.zeros(bsz, dtype=torch.bool, device=device)
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
