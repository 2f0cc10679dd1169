"""Qwen3.5-397B-A17B ↔ Hugging Face checkpoint names.

The HF side is the published checkpoint layout (``Qwen3_5MoeForConditionalGeneration``):
``model.language_model.*`` for the text trunk, ``lm_head.weight``, ``mtp.*`` for the
multi-token-prediction module; routed experts one tensor per expert
(``mlp.experts.{e}.{gate,up,down}_proj.weight``). ``model.visual.*`` (the vision
tower) is not modelled and is skipped by ``from_hf``.

Legend: E experts, I expert FFN size, H hidden.
"""

import re

from titan_mok.models.common.state_dict_adapter import StackedExpertsAdapter, split_prefix

from .args import Qwen35ModelArgs

TEXT = "model.language_model."

# native block-relative name -> HF block-relative name (shared by trunk layers and the MTP block)
BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    **{
        f"linear_attention.{leaf}": f"linear_attn.{leaf}"
        for leaf in (
            "in_proj_qkv.weight",
            "in_proj_z.weight",
            "in_proj_b.weight",
            "in_proj_a.weight",
            "conv1d.weight",
            "dt_bias",
            "A_log",
            "norm.weight",
            "out_proj.weight",
        )
    },
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.shared_expert.w_gate.weight": "mlp.shared_expert.gate_proj.weight",
    "moe.shared_expert.w_up.weight": "mlp.shared_expert.up_proj.weight",
    "moe.shared_expert.w_down.weight": "mlp.shared_expert.down_proj.weight",
    "moe.shared_expert.output_gate.weight": "mlp.shared_expert_gate.weight",
}
# stacked native expert weights -> per-expert HF leaf
EXPERT_NAMES = {"moe.experts.w_gate": "gate_proj", "moe.experts.w_up": "up_proj", "moe.experts.w_down": "down_proj"}
# native buffers that have no HF counterpart (Qwen3.5's softmax router has no correction bias)
NATIVE_ONLY = ("moe.expert_bias",)
TOP_NAMES = {
    "tok_embeddings.weight": TEXT + "embed_tokens.weight",
    "norm.weight": TEXT + "norm.weight",
    "output.weight": "lm_head.weight",
    "mtp.fc.weight": "mtp.fc.weight",
    "mtp.pre_fc_norm_embedding.weight": "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight": "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight": "mtp.norm.weight",
}
# native block prefix pattern -> HF block prefix
BLOCK_PREFIXES = ((re.compile(r"^layers\.(\d+)\."), TEXT + r"layers.\1."), (re.compile(r"^mtp\.block\."), "mtp.layers.0."))
HF_BLOCK_PREFIXES = ((re.compile(r"^model\.language_model\.layers\.(\d+)\."), r"layers.\1."), (re.compile(r"^mtp\.layers\.0\."), "mtp.block."))


class Qwen35StateDictAdapter(StackedExpertsAdapter):
    def __init__(self, model_args: Qwen35ModelArgs, hf_assets_path: str | None):
        super().__init__(model_args, hf_assets_path)
        self.hf_block_names = {hf: native for native, hf in BLOCK_NAMES.items()}
        self.hf_top_names = {hf: native for native, hf in TOP_NAMES.items()}

    def to_hf(self, state_dict: dict) -> dict:
        hf = {}
        for key, tensor in state_dict.items():
            if key in TOP_NAMES:
                hf[TOP_NAMES[key]] = tensor
                continue
            split = split_prefix(key, BLOCK_PREFIXES)
            if split is None:
                raise KeyError(f"{key}: no Hugging Face name for this Qwen3.5 parameter")
            prefix, rest = split
            if rest in NATIVE_ONLY:
                continue
            if rest in EXPERT_NAMES:
                # [E, I, H] (or [E, H, I]) -> E tensors of [I, H] ([H, I])
                hf.update(self.experts_to_hf(prefix, rest, "{}mlp.experts.{}." + EXPERT_NAMES[rest] + ".weight", tensor))
            elif rest in BLOCK_NAMES:
                hf[prefix + BLOCK_NAMES[rest]] = tensor
            else:
                raise KeyError(f"{key}: no Hugging Face name for this Qwen3.5 block parameter")
        return hf

    def from_hf(self, hf_state_dict: dict) -> dict:
        native, pending = {}, {}
        hf_leaf_to_native = {leaf: name for name, leaf in EXPERT_NAMES.items()}
        for key, tensor in hf_state_dict.items():
            if key.startswith("model.visual."):
                continue  # vision tower: not modelled (text only)
            if key in self.hf_top_names:
                native[self.hf_top_names[key]] = tensor
                continue
            split = split_prefix(key, HF_BLOCK_PREFIXES)
            if split is None:
                raise KeyError(f"{key}: not a Qwen3.5 text checkpoint key")
            prefix, rest = split
            expert = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", rest)
            if expert:
                self.collect_expert(pending, prefix, hf_leaf_to_native[expert[2]], int(expert[1]), tensor, native)
            elif rest in self.hf_block_names:
                native[prefix + self.hf_block_names[rest]] = tensor
            else:
                raise KeyError(f"{key}: not a Qwen3.5 text checkpoint key")
        self.check_complete(pending)
        return native
