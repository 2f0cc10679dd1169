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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over generated tokens of ``−min(ρA, clip(ρ, 1±ε)A)``, ρ = exp(logp − logp_old).
    Also returns (detached) sums for metrics: clipped tokens and the k3 KL estimate
    of KL(old ‖ new) (Schulman's ``ρ⁻¹ − 1 + log ρ`` form, ≥ 0)."""
    log_ratio_BG = logprobs_BG - old_logprobs_BG
    ratio_BG = torch.exp(log_ratio_BG)
    adv_B1 = advantages_B[:, None]
    surrogate_BG = torch.minimum(ratio_BG * adv_B1, ratio_BG.clamp(1 - clip_eps, 1 + clip_eps) * adv_B1)
    loss_sum = -(surrogate_BG * mask_BG).sum()
    with torch.no_grad():
        clipped_BG = ((ratio_BG < 1 - clip_eps) | (ratio_BG > 1 + clip_eps)) & mask_BG
        kl_BG = torch.exp(-log_ratio_BG) - 1 + log_ratio_BG
        stats = {"clipped_tokens": clipped_BG.sum().float(), "kl_sum": (kl_BG * mask_BG).sum()}
    return loss_sum, stats
