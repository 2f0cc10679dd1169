"""Kimi K2.7 Code arguments: exactly the shared MLA decoder's (DeepSeek-V3 layout)."""

from dataclasses import dataclass

from titan_mok.models.common.args import MLADecoderArgs


@dataclass
class KimiK27CodeArgs(MLADecoderArgs):
    """MLA + MoE decoder with YaRN RoPE (interleaved pairs); no MTP, no sparse attention."""
