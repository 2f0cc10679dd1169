"""Building blocks shared by titan-mok's models: RMSNorm, RoPE (plain/YaRN,
interleaved/half), MLA attention, the pre-norm decoder block and skeleton, the
MTP block, parameter counting and the HF state-dict adapter of the MLA decoders."""

from .norm import RMSNorm
from .rope import YaRN, apply_rope, rope_cache

__all__ = ["RMSNorm", "YaRN", "apply_rope", "rope_cache"]
