"""GLM-5.2 HF ⇄ titan-mok names: the MLA + MoE layout plus the DSA indexer and the
MTP block (HF ``model.layers.{n_layers}.*``, as in the GLM-5 checkpoints).

The MTP layer's ``embed_tokens.weight`` and ``shared_head.head.weight`` are
copies of the main embedding and head, which titan-mok shares (DeepSeek-V3's
design, and transformers' MtpModel): from_hf skips them, to_hf does not write them.
"""

from titan_mok.models.common.state_dict_adapter import BLOCK_KEYS, MLAStateDictAdapter


class GLM52StateDictAdapter(MLAStateDictAdapter):
    block_keys = {
        **BLOCK_KEYS,
        "attention.indexer.wq_b.weight": "self_attn.indexer.wq_b.weight",
        "attention.indexer.wk.weight": "self_attn.indexer.wk.weight",
        "attention.indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
        "attention.indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
        "attention.indexer.weights_proj.weight": "self_attn.indexer.weights_proj.weight",
        "enorm.weight": "enorm.weight",
        "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight",
        "final_norm.weight": "shared_head.norm.weight",
    }
    ignored_hf_keys = ("embed_tokens.weight", "shared_head.head.weight")
