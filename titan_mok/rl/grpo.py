"""GRPO: group-relative advantages and the clipped policy-gradient loss.

Legend: B sequences (prompts × group, a prompt's samples adjacent), P prompts,
G completion tokens per sequence.
"""

import torch


def group_advantages(rewards_B: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """``(r − mean_group) / (std_group + eps)``; a group whose rewards are all equal gets 0."""
    if rewards_B.shape[0] % group_size:
        raise ValueError(f"{rewards_B.shape[0]} rewards do not split into groups of [rl] group_size = {group_size}")
    rewards_PG = rewards_B.view(-1, group_size)  # [P, group]
    centred_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    return (centred_PG / (rewards_PG.std(dim=1, keepdim=True) + eps)).view(-1)


def clipped_pg_loss_sum(
    logprobs_BG: torch.Tensor,
    old_logprobs_BG: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BG: torch.Tensor,
    clip_eps: float,
    ref_logprobs_BG: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over generated tokens of ``−min(ρA, clip(ρ, 1±ε)A)``, ρ = exp(logp − logp_old),
    plus ``kl_coef · k3(ref ‖ new)`` per token when reference logprobs are given (k3:
    Schulman's ``exp(r) − r − 1``, r = logp_ref − logp, ≥ 0; GRPO's penalty). Also
    returns (detached) sums for metrics: clipped tokens, k3 KL(old ‖ new), k3 KL to the reference."""
    log_ratio_BG = logprobs_BG - old_logprobs_BG
    ratio_BG = torch.exp(log_ratio_BG)
    adv_B1 = advantages_B[:, None]
    surrogate_BG = torch.minimum(ratio_BG * adv_B1, ratio_BG.clamp(1 - clip_eps, 1 + clip_eps) * adv_B1)
    loss_sum = -(surrogate_BG * mask_BG).sum()
    ref_kl_sum = torch.zeros((), device=logprobs_BG.device)
    if ref_logprobs_BG is not None:
        to_ref_BG = ref_logprobs_BG - logprobs_BG
        ref_kl_sum = ((torch.exp(to_ref_BG) - to_ref_BG - 1) * mask_BG).sum()
        loss_sum = loss_sum + kl_coef * ref_kl_sum
    with torch.no_grad():
        clipped_BG = ((ratio_BG < 1 - clip_eps) | (ratio_BG > 1 + clip_eps)) & mask_BG
        kl_BG = torch.exp(-log_ratio_BG) - 1 + log_ratio_BG
        stats = {
            "clipped_tokens": clipped_BG.sum().float(),
            "kl_sum": (kl_BG * mask_BG).sum(),
            "ref_kl_sum": ref_kl_sum.detach(),
        }
    return loss_sum, stats
