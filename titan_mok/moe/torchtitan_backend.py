"""backend = "torchtitan": TorchTitan 0.2.2's GroupedExperts (and, under EP, its
all-to-all ExpertParallel), the baseline every benchmark compares against.

Legend: T tokens, K top-k, R = T·K routed rows, H hidden, E experts.

The router, shared expert and the fp32 slot-ordered combine are titan-mok's
(the same as the mok backend), so the two backends differ only in how rows
reach the experts and come back, and in the expert GEMMs.
"""

import torch
from torchtitan.models.moe.moe import GroupedExperts
from torchtitan.tools.utils import has_cuda_capability

from titan_mok.kernels.grouped_ffn import grouped_swiglu_ffn
from titan_mok.moe.experts import init_expert_weights, local_expert_weights

# TorchTitan's parameter names → titan-mok's (the state dict is the same for both backends).
_TT_TO_MOK = {"w1": "w_gate", "w3": "w_up", "w2": "w_down"}


class TorchTitanExperts(GroupedExperts):
    """TorchTitan's GroupedExperts under titan-mok's parameter names
    (``w_gate, w_up [E, I, H]``, ``w_down [E, H, I]``); TorchTitan's code reads them
    through the ``w1/w3/w2`` properties. TorchTitan's ExpertParallel applies to it
    unchanged. Its GEMMs are ``torch._grouped_mm`` on SM90+, its for-loop elsewhere
    (as TorchTitan's DeepSeek-V3 decides at build time)."""

    w1 = property(lambda self: self.w_gate)
    w3 = property(lambda self: self.w_up)
    w2 = property(lambda self: self.w_down)

    def __init__(self, dim: int, expert_dim: int, num_experts: int, swiglu_limit: float | None):
        super().__init__(dim, expert_dim, num_experts, use_grouped_mm=has_cuda_capability(9, 0))
        for tt_name, name in _TT_TO_MOK.items():
            self.register_parameter(name, self._parameters.pop(tt_name))
        self.swiglu_limit = swiglu_limit
        self.ep_mesh = None

    def forward(self, x_RH: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if self.swiglu_limit is None:
            return super().forward(x_RH, num_tokens_per_expert)
        # TorchTitan's grouped experts have no SwiGLU clamp (DeepSeek-V4): the reference FFN
        # (kernels/grouped_ffn.py) on TorchTitan's layout (groups padded with zero rows, rows past the groups unused).
        group_end = torch.cumsum(num_tokens_per_expert, dim=0)
        weights = (w.to(x_RH.dtype) for w in self.local_weights())
        return grouped_swiglu_ffn(x_RH, group_end, *weights, precision="bf16", swiglu_limit=self.swiglu_limit)

    def init_weights(self, init_std: float) -> None:
        init_expert_weights(self, init_std)  # TorchTitan draws w2 (down) before w3 (up)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return local_expert_weights(self)


def routed_torchtitan(experts: TorchTitanExperts, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor) -> torch.Tensor:
    """Rows sorted by expert (stable, as TorchTitan's TokenReorderer), through the
    experts (and TorchTitan's EP hooks), back to (token, slot) order: [T, K, H]."""
    num_tokens, top_k = topk_idx_TK.shape
    order_R = torch.sort(topk_idx_TK.reshape(-1), stable=True).indices  # by (expert, token, slot)
    counts_E = torch.bincount(topk_idx_TK.reshape(-1), minlength=experts.num_experts)
    y_sorted_RH = experts(x_TH[order_R // top_k], counts_E)
    y_RH = torch.empty_like(y_sorted_RH)
    y_RH[order_R] = y_sorted_RH
    return y_RH.view(num_tokens, top_k, -1)
