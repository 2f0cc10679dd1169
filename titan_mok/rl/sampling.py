"""Per-sequence sampling streams, temperature/top-p sampling and token logprobs.

Legend: B sequences, V vocab, M rows (any flattening of batch × positions).

Each sequence owns a counter-based random stream: its key is a hash of (run
seed, step, prompt index, sample index), and the noise for its t-th completion
token and vocabulary entry v is ``splitmix64(key + splitmix64(t·V + v))``. A
sequence's tokens are therefore a function of its own key and logits only —
not of its batch-mates, the batch size, the EP degree or the device — and a
stream needs no state beyond (seed, step) to be resumed.

Sampling is the exponential race (``argmax p_v / E_v`` with ``E_v ~ Exp(1)``,
gpt-fast's ``multinomial_sample_one_no_sync``), which draws from ``p`` exactly,
with no host sync and no scan whose order could vary. Top-p keeps the smallest
prefix of the probability-sorted vocabulary whose mass reaches ``top_p``.

Logprobs are of the sampling distribution before the top-p cut:
``log_softmax(logits / temperature)`` (the convention of vLLM and verl), computed
by the same function in the rollout and the trainer.
"""

import torch

from titan_mok.kernels.row_tiles import map_row_tiles

_MASK64 = (1 << 64) - 1


def _to_int64(u: int) -> int:
    """An unsigned 64-bit value as the signed int64 with the same bits."""
    return u - (1 << 64) if u >= 1 << 63 else u


def _splitmix64_int(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 on int64 tensors (wrap-around arithmetic = the unsigned bits)."""
    z = x + _to_int64(0x9E3779B97F4A7C15)
    z = (z ^ _shr(z, 30)) * _to_int64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _to_int64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def sequence_key(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """The stream key of one sequence (a signed int64 value)."""
    key = 0
    for part in (seed, step, prompt_index, sample_index):
        if part < 0:
            raise ValueError(f"sequence_key: seed/step/prompt/sample must be >= 0, got {part}")
        key = _splitmix64_int(key ^ part)
    return _to_int64(key)


def stream_uniforms(keys_B: torch.Tensor, t: int, vocab_size: int) -> torch.Tensor:
    """``[B, V]`` float64 uniforms in (0, 1) for completion token ``t`` of each stream."""
    counter_V = _splitmix64(t * vocab_size + torch.arange(vocab_size, dtype=torch.int64, device=keys_B.device))
    bits_BV = _splitmix64(keys_B[:, None] + counter_V)
    return (_shr(bits_BV, 11).double() + 0.5) * 2.0**-53  # 53 random bits, never 0 or 1


def token_logprobs(logits_MV: torch.Tensor, tokens_M: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / temperature)[token]`` per row, fp32, row-tiled (batch-invariant)."""

    def rows(logits_TV, tokens_T):
        logp_TV = torch.log_softmax(logits_TV.float() / temperature, dim=-1)
        return logp_TV.gather(-1, tokens_T[:, None]).squeeze(-1)

    return map_row_tiles(rows, logits_MV, tokens_M)


def sample(
    logits_BV: torch.Tensor, keys_B: torch.Tensor, t: int, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw completion token ``t`` of each stream; returns ``(tokens_B, logprobs_B)``."""
    uniforms_BV = stream_uniforms(keys_B, t, logits_BV.shape[-1])

    def rows(logits_TV, uniforms_TV):
        probs_TV = torch.softmax(logits_TV.float() / temperature, dim=-1)
        if top_p < 1.0:
            sorted_TV, order_TV = probs_TV.sort(dim=-1, descending=True, stable=True)
            mass_before_TV = sorted_TV.cumsum(dim=-1) - sorted_TV  # mass of the strictly better tokens
            drop_TV = torch.zeros_like(probs_TV, dtype=torch.bool).scatter(-1, order_TV, mass_before_TV >= top_p)
            probs_TV = probs_TV.masked_fill(drop_TV, 0.0)
        race_TV = probs_TV.double() / -torch.log(uniforms_TV)  # exponential race: argmax ~ Categorical(probs)
        return race_TV.argmax(dim=-1)

    tokens_B = map_row_tiles(rows, logits_BV, uniforms_BV)
    return tokens_B, token_logprobs(logits_BV, tokens_B, temperature)
