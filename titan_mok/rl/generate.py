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

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from titan_mok.models.common.decoder import MLADecoder
from titan_mok.models.common.mla import MLAttention
from titan_mok.models.common.rope import apply_rope
from titan_mok.rl.invariant import invariant_attention
from titan_mok.rl.sampling import sample


def check_supported(model: torch.nn.Module) -> None:
    """Rollouts decode MLA decoders (Kimi K2.7 Code); other attentions need their own cache step."""
    if not isinstance(model, MLADecoder):
        raise NotImplementedError(f"RL rollouts support MLADecoder models; {type(model).__name__} has no KV-cache step yet")
    for layer_id in range(model.model_args.n_layers):
        attention = model.layers[str(layer_id)].attention
        if type(attention) is not MLAttention:
            raise NotImplementedError(
                f"RL rollouts support plain MLAttention layers; layer {layer_id} is {type(attention).__name__} "
                "(no KV-cache step yet)"
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


def _rope_at(x_BTNR: torch.Tensor, rope_BTR: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``apply_rope`` with a position per (sequence, token): the B·T rows as one sequence."""
    bsz, n_new = x_BTNR.shape[:2]
    rows_1MNR = x_BTNR.reshape(1, bsz * n_new, *x_BTNR.shape[2:])  # [B, T, N, R] -> [1, B·T, N, R]
    return apply_rope(rows_1MNR, rope_BTR.reshape(bsz * n_new, -1), interleaved).view(x_BTNR.shape)


def _mla_step(
    attn: MLAttention, x_BTH: torch.Tensor, rope_BTR: torch.Tensor, pos_BT: torch.Tensor, layer: int, cache: KVCache
) -> torch.Tensor:
    """``MLAttention.forward`` for T new tokens per sequence at positions ``pos_BT``, with a cache."""
    bsz, n_new, _ = x_BTH.shape
    q_BTNE = attn.wq_b(attn.q_norm(attn.wq_a(x_BTH))).view(bsz, n_new, -1, attn.qk_head_dim)
    q_nope_BTNP, q_rope_BTNR = q_BTNE.split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    q_BTNE = torch.cat([q_nope_BTNP, _rope_at(q_rope_BTNR, rope_BTR, attn.rope_interleaved)], dim=-1)

    kv_latent_BTC, k_rope_BTR = attn.wkv_a(x_BTH).split([attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    k_rope_BT1R = _rope_at(k_rope_BTR.unsqueeze(2), rope_BTR, attn.rope_interleaved)
    kv_BTNX = attn.wkv_b(attn.kv_norm(kv_latent_BTC)).view(bsz, n_new, -1, attn.qk_nope_head_dim + attn.v_head_dim)
    k_nope_BTNP, v_BTND = kv_BTNX.split([attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)
    k_BTNE = torch.cat([k_nope_BTNP, k_rope_BT1R.expand(-1, -1, k_nope_BTNP.shape[2], -1)], dim=-1)

    rows_BT = torch.arange(bsz, device=pos_BT.device)[:, None].expand(bsz, n_new)
    cache.k_BNSE[layer].transpose(1, 2)[rows_BT, pos_BT] = k_BTNE  # [B, S, N, E] view: write at (b, pos)
    cache.v_BNSD[layer].transpose(1, 2)[rows_BT, pos_BT] = v_BTND
    out_BNTD = invariant_attention(
        q_BTNE.transpose(1, 2), cache.k_BNSE[layer], cache.v_BNSD[layer], attn.softmax_scale, pos_BT
    )
    return attn.wo(out_BNTD.transpose(1, 2).reshape(bsz, n_new, -1))  # [B, T, N·D]


def forward_step(model: MLADecoder, tokens_BT: torch.Tensor, pos_BT: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """``model(tokens)`` for T new tokens per sequence at positions ``pos_BT``; logits ``[B, T, V]``."""
    h_BTH = model.tok_embeddings(tokens_BT)
    rope_BTR = model.rope_cache[pos_BT]
    for layer_id in range(model.model_args.n_layers):
        block = model.layers[str(layer_id)]
        h_BTH = h_BTH + _mla_step(block.attention, block.attention_norm(h_BTH), rope_BTR, pos_BT, layer_id, cache)
        ffn = block.moe if block.moe_enabled else block.feed_forward
        h_BTH = h_BTH + ffn(block.ffn_norm(h_BTH))
    return model.output(model.norm(h_BTH))


@contextmanager
def unsharded(model: torch.nn.Module):
    """All FSDP-sharded parameters gathered for the duration (an inference engine's full
    weights); ``forward_step`` calls submodules, which FSDP's forward hooks would not see."""
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if isinstance(model, FSDPModule):
        # NOTE: private FSDP2 API (torch 2.11-2.13). The root's forward normally does this; without
        # it, the first FSDP-wrapped submodule called directly (e.g. the final norm) claims the root.
        model._get_fsdp_state()._lazy_init()
    for module in fsdp_modules:
        module.unshard()
    try:
        yield
    finally:
        for module in fsdp_modules:
            module.reshard()


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
    model: MLADecoder,
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
    """Sample up to ``max_new_tokens`` per prompt (stream ``keys_B[b]`` for prompt b)."""
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

    cache = KVCache(model, bsz, seq_len, model.tok_embeddings.weight.dtype, device)
    max_prompt = max(len(p) for p in prompts)
    pos_BP = torch.arange(max_prompt, device=device).expand(bsz, max_prompt)
    logits_BPV = forward_step(model, tokens_BS[:, :max_prompt], pos_BP, cache)  # prefill
    logits_BV = logits_BPV[torch.arange(bsz, device=device), prompt_len_B - 1]

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
        logits_BV = forward_step(model, token_B[:, None], (prompt_len_B + t)[:, None], cache)[:, 0]
    return Rollout(tokens_BS, prompt_len_B, completion_BG, logprobs_BG, mask_BG)
