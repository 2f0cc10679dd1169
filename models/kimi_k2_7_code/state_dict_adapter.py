"""Kimi K2.7 Code HF ⇄ titan-mok names: the DeepSeek-V3 layout of the shared MLA adapter.

Text-only checkpoints name tensors ``model.layers.…`` / ``lm_head.weight``; the
Kimi-K2.5-style multimodal ones put the text model under ``language_model.``
(detected from ``model.safetensors.index.json``). Checkpoints whose routed experts
are stored INT4-packed (``weight_packed``/``weight_scale``) must be dequantized
first: from_hf rejects those names.
"""

from titan_mok.models.common.state_dict_adapter import MLAStateDictAdapter


class KimiK27CodeStateDictAdapter(MLAStateDictAdapter):
    pass
