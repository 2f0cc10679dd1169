"""Token-choice top-k router: scores, expert choice, combine weights. Math in fp32.

Legend: T tokens, H hidden, E experts, K top-k, G expert groups, V vocabulary.

Expert choice is deterministic: ties are broken towards the lower expert id
(a stable descending sort), and slots come out in descending score order.

Row invariance (docs/design.md, determinism): a token's routing must not depend on the batch around it. Every
op here is per row: elementwise maps, row-wise sort/softmax/gather, and sums over a handful
of columns added in a fixed order (``sum_columns``), never a reduction kernel whose order can
follow the tensor's shape. On CUDA that makes one call over all rows row-invariant; on CPU the
vector loops finish a tensor's tail with scalar code (other last bits for transcendentals,
tiles.py), so there the routing runs on fixed 64-row tiles.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.models.utils import trunc_normal_

from titan_mok.kernels.row_tiles import map_row_tiles, row_invariant_linear
from titan_mok.moe.args import MoEArgs

ROUTE_NORM_EPS = 1e-20
"""Added to the top-k score sum before renormalising (as DeepSeek-V3/V4)."""


def stable_topk_indices(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, largest first; on ties the lower index wins."""
    return torch.sort(scores_TE, dim=-1, descending=True, stable=True).indices[:, :k]


def sum_columns(x_tC: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a few columns) as x[..., 0] + x[..., 1] + ..., left to right,
    keeping that dim (size 1): the same order for every row on every device."""
    total = x_tC[..., :1]
    for c in range(1, x_tC.shape[-1]):
        total = total + x_tC[..., c : c + 1]
    return total


def hash_table_init(vocab_size: int, num_experts: int, top_k: int, device=None) -> torch.Tensor:
    """A fixed token-id → K distinct experts table [V, K] int64 (a seeded offset per
    token, then K consecutive experts mod E). Trained checkpoints bring their own."""
    generator = torch.Generator().manual_seed(0)
    offset_V1 = torch.randint(num_experts, (vocab_size, 1), generator=generator)
    table_VK = (offset_V1 + torch.arange(top_k)) % num_experts
    return table_VK.to(device)


class TopKRouter(nn.Module):
    """Parameters: ``gate.weight [E, H]``; buffer ``hash_table [V, K]`` int64 when hash-routed."""

    def __init__(self, args: MoEArgs, dim: int):
        super().__init__()
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.score_func = args.score_func
        self.route_norm = args.route_norm
        self.route_scale = args.route_scale
        self.num_expert_groups = args.num_expert_groups
        self.num_limited_groups = args.num_limited_groups
        self.hash_routing = args.hash_routing
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        if args.hash_routing:
            self.register_buffer(
                "hash_table", hash_table_init(args.hash_vocab_size, args.num_experts, args.top_k), persistent=True
            )

    def _scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        if self.score_func == "sigmoid":
            return torch.sigmoid(logits_TE)
        if self.score_func == "softmax":
            return F.softmax(logits_TE, dim=-1)
        return F.softplus(logits_TE).sqrt()  # sqrtsoftplus

    def _limit_groups(self, choice_TE: torch.Tensor) -> torch.Tensor:
        """Keep the num_limited_groups groups with the largest top-2 sums; -inf elsewhere."""
        num_tokens = choice_TE.shape[0]
        choice_TGe = choice_TE.view(num_tokens, self.num_expert_groups, -1)  # [T, G, E/G]
        group_score_TG = sum_columns(torch.sort(choice_TGe, dim=-1, descending=True).values[..., :2]).squeeze(-1)
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
        keep_TG.scatter_(1, stable_topk_indices(group_score_TG, self.num_limited_groups), True)
        return choice_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(num_tokens, -1)  # [T, E]

    def _route_rows(self, logits_tE, expert_bias_E, token_ids_t):
        scores_tE = self._scores(logits_tE)
        if self.hash_routing:
            topk_idx_tK = self.hash_table[token_ids_t]
        else:
            choice_tE = scores_tE.detach()
            if expert_bias_E is not None:
                choice_tE = choice_tE + expert_bias_E
            if self.num_expert_groups is not None:
                choice_tE = self._limit_groups(choice_tE)
            topk_idx_tK = stable_topk_indices(choice_tE, self.top_k)
        # The bias chooses experts but never weights them.
        weights_tK = scores_tE.gather(1, topk_idx_tK)
        if self.route_norm:
            weights_tK = weights_tK / (sum_columns(weights_tK) + ROUTE_NORM_EPS)
        return weights_tK * self.route_scale, topk_idx_tK, scores_tE

    def logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] in fp32."""
        return row_invariant_linear(x_TH.float(), self.gate.weight.float())

    def forward(
        self,
        logits_TE: torch.Tensor,
        expert_bias_E: torch.Tensor | None,
        token_ids_T: torch.Tensor | None,
        row_tiles: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """
        ``row_tiles``: route fixed 64-row tiles, or all rows in one call; by default tiles on
        CPU and one call on CUDA (both row-invariant there: module docstring).

        Returns:
            weights_TK: fp32 combine weights (normalised if route_norm, times route_scale).
            topk_idx_TK: int64 expert ids, slot order (descending score; hash: table order).
            scores_TE: fp32 scores of every expert (the auxiliary loss reads them).
        """
        if self.hash_routing:
            route, rows = (lambda logits, ids: self._route_rows(logits, None, ids)), (logits_TE, token_ids_T)
        else:
            route, rows = (lambda logits: self._route_rows(logits, expert_bias_E, None)), (logits_TE,)
        if row_tiles is None:
            row_tiles = not logits_TE.is_cuda
        return map_row_tiles(route, *rows) if row_tiles else route(*rows)

    def init_weights(self, init_std: float, buffer_device: torch.device) -> None:
        trunc_normal_(self.gate.weight, mean=0.0, std=init_std)
        if self.hash_routing:
            num_vocab = self.hash_table.shape[0]
            self.hash_table = hash_table_init(num_vocab, self.num_experts, self.top_k, device=buffer_device)
