"""Kimi K2.7 Code (text): the shared MLA decoder, MLA attention on every layer."""

from titan_mok.models.common.decoder import MLADecoder


class KimiK27CodeModel(MLADecoder):
    """Embedding → 61 × (MLA, dense FFN on layer 0 / MoE after) → RMSNorm → untied head;
    built from ``KimiK27CodeArgs``."""
