"""titan-mok's MoE layer and its expert-parallel strategies (docs/design.md)."""

from titan_mok.moe.args import MoEArgs
from titan_mok.moe.moe import MoE

__all__ = ["MoE", "MoEArgs"]
