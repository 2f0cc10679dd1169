"""Parameter counts: total, and active per token (routed experts × top-k / E).

Works on meta-device models (nothing is allocated) and on DTensor parameters
(``numel`` is the global size).
"""

from dataclasses import dataclass

from torch import nn

from titan_mok.moe import MoE


@dataclass
class ParamCount:
    total: int
    active: int
    """Parameters a token touches: all but the (E − K)/E share of routed experts."""


def count_params(module: nn.Module) -> ParamCount:
    total = sum(p.numel() for p in module.parameters())
    inactive = 0
    for m in module.modules():
        if isinstance(m, MoE):
            routed = sum(p.numel() for p in m.experts.parameters())
            inactive += routed - routed * m.args.top_k // m.args.num_experts
    return ParamCount(total=total, active=total - inactive)
