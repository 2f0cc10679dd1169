"""KV-cache generation through the training model's own modules.

Legend: B sequences, T new tokens per step, S cache length (= ``[training]
seq_len``, also the trainer's sequence length), V vocab, G completion tokens.

No second model: a cached step is ``model(tokens_BT)`` itself — embedding,
blocks (norms, residuals, dense FFN or MoE), head, and FSDP's hooks around them
(gathering, mixed-precision casts) — with each layer's attention module swapped,
for the rollout, for a stand-in that calls the module's own ``qkv`` and
``project_out`` and only replaces the core: new keys/values are written into a
cache at each sequence's own positions, and queries attend to the whole cache
through ``invariant_attention`` (the function the trainer's forward uses under
``BatchInvariantMode``). So every logit equals, bit for bit, the one the trainer
recomputes for the same position. Each model family's stand-ins live in their
own module (``cached_mla``: Kimi K2.7 Code, GLM-5.2; ``cached_qwen``: Qwen3.5, whose
DeltaNet layers cache a chunk state, not keys/values; ``cached_dsv4``: DeepSeek-V4,
whose compressors cache per-position projections and pooled entries) behind
``supports`` and ``stand_ins``; a model without one decodes by recomputation.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_mok.moe import MoE
from titan_mok.rl import cached_dsv4, cached_mla, cached_qwen
from titan_mok.rl.kv_cache import Positions
from titan_mok.rl.sampling import sample

_CACHED_FAMILIES = (cached_mla, cached_qwen, cached_dsv4)
"""Modules with ``supports(model)`` and ``stand_ins(model, positions, batch, seq_len)``:
each model family's cached decode step."""


def _cached_family(model: torch.nn.Module):
    return next((family for family in _CACHED_FAMILIES if family.supports(model)), None)


def has_kv_cache_step(model: torch.nn.Module) -> bool:
    """True where a model family has a cached decode step; others decode by recomputation."""
    return _cached_family(model) is not None


class CachedDecoder:
    """Prefill the prompts once, then one token per sequence per step against the caches.
    Decode inside ``running()``: the modules the family's cached step replaces (each
    layer's attention) are swapped for their stand-ins for its duration."""

    def __init__(self, model: torch.nn.Module, tokens_BS: torch.Tensor):
        self.model = model
        self.tokens_BS = tokens_BS
        self.positions = Positions()
        self.swaps = _cached_family(model).stand_ins(model, self.positions, *tokens_BS.shape)

    @contextmanager
    def running(self):
        originals = [getattr(parent, name) for parent, name, _ in self.swaps]
        for parent, name, stand_in in self.swaps:
            setattr(parent, name, stand_in)
        try:
            yield self
        finally:
            for (parent, name, _), original in zip(self.swaps, originals):
                setattr(parent, name, original)

    def _step(self, tokens_BT: torch.Tensor, start: int | torch.Tensor) -> torch.Tensor:
        bsz, n_new = tokens_BT.shape
        start_B1 = torch.as_tensor(start, device=tokens_BT.device).view(-1, 1)
        self.positions.start = start
        self.positions.pos_BT = (start_B1 + torch.arange(n_new, device=tokens_BT.device)).expand(bsz, n_new)
        return self.model(tokens_BT)

    def prefill(self, prompt_len_B: torch.Tensor, max_prompt: int) -> torch.Tensor:
        self.positions.prompt_len_B = prompt_len_B
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


@contextmanager
def varying_token_counts(model: torch.nn.Module):
    """Rollout forwards: prefills of each rank's own length, then decode steps; so kernels = "auto" keeps
    the MoE layers on the reference schedule, whose buffers follow each call's counts (the fused path's
    are allocated per token count, collectively: ``titan_mok.moe.moe.routed_schedule``)."""
    saved = [(m, m.fixed_token_count) for m in model.modules() if isinstance(m, MoE)]
    for module, _ in saved:
        module.fixed_token_count = False
    try:
        yield
    finally:
        for module, fixed in saved:
            module.fixed_token_count = fixed


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
    with decoder.running(), varying_token_counts(model):
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
