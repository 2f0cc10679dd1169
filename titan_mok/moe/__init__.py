"""titan-mok's MoE layer (DESIGN §4) and its expert-parallel strategies (§5)."""

from titan_mok.moe.args import MoEArgs
from titan_mok.moe.moe import MoE

__all__ = ["MoE", "MoEArgs"]
