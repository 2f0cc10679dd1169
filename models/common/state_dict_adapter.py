"""HF ⇄ titan-mok state-dict names for the MLA + MoE decoders (DeepSeek-V3 layout).

HF checkpoints store each routed expert as three 2-D matrices
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight [I, H]`` …); titan-mok stores
them stacked (``layers.{i}.moe.experts.w_gate [E, I, H]`` …, no transpose).
Splitting/stacking, including EP/FSDP-sharded DTensors, reuses TorchTitan's
``MoEStateDictAdapter`` helpers. Unknown keys raise (nothing is dropped silently).
"""

import re
from typing import Any

from torch.distributed.tensor import DTensor

from torchtitan.models.utils import MoEStateDictAdapter

# titan-mok name inside a block → HF name inside ``model.layers.{i}``
BLOCK_KEYS = {
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_expert.w_gate.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_expert.w_up.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_expert.w_down.weight": "mlp.shared_experts.down_proj.weight",
}
# stacked routed-expert tensor inside a block → per-expert HF name inside ``mlp.experts.{e}``
EXPERT_KEYS = {
    "moe.experts.w_gate": "gate_proj.weight",
    "moe.experts.w_up": "up_proj.weight",
    "moe.experts.w_down": "down_proj.weight",
}
TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_OURS_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(.+)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class MLAStateDictAdapter(MoEStateDictAdapter):
    """Subclasses extend ``block_keys`` (e.g. GLM's indexer and MTP names) and
    ``ignored_hf_keys`` (HF keys that hold copies of tensors we share)."""

    block_keys: dict[str, str] = BLOCK_KEYS
    ignored_hf_keys: tuple[str, ...] = ()

    def __init__(self, model_args, hf_assets_path: str | None):
        super().__init__(model_args, hf_assets_path)
        # Multimodal checkpoints (Kimi-K2.5 style) keep the text model under this prefix.
        hf_names = self.fqn_to_index_mapping or {}
        self.hf_prefix = "language_model." if any(n.startswith("language_model.") for n in hf_names) else ""
        self.from_hf_block = {hf: ours for ours, hf in self.block_keys.items()}
        self.from_hf_expert = {hf: ours for ours, hf in EXPERT_KEYS.items()}
        self.from_hf_top = {hf: ours for ours, hf in TOP_KEYS.items()}

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        hf_state_dict = self._to_hf_unprefixed(state_dict)
        return {self.hf_prefix + key: value for key, value in hf_state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        unprefixed = {}
        for key, value in hf_state_dict.items():
            if not key.startswith(self.hf_prefix):
                raise KeyError(f"from_hf: HF key {key!r} lacks the checkpoint's prefix {self.hf_prefix!r}")
            unprefixed[key[len(self.hf_prefix):]] = value
        return self._from_hf_unprefixed(unprefixed)

    def _to_hf_unprefixed(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        hf_state_dict = {}
        for key, value in state_dict.items():
            if key in TOP_KEYS:
                hf_state_dict[TOP_KEYS[key]] = value
                continue
            match = _OURS_BLOCK.match(key)
            if match is None:
                raise KeyError(f"to_hf: no HF name for {key!r}")
            layer, inner = match.groups()
            if inner in self.block_keys:
                hf_state_dict[f"model.layers.{layer}.{self.block_keys[inner]}"] = value
            elif inner in EXPERT_KEYS:
                hf_template = f"model.layers.{{}}.mlp.experts.{{}}.{EXPERT_KEYS[inner]}"
                titan_template = f"layers.{{}}.{inner}"
                if isinstance(value, DTensor):  # EP/FSDP-sharded: this rank's experts only
                    self.grouped_expert_weight_placements[titan_template] = value.placements
                    self.grouped_expert_weight_shape[titan_template] = value.shape
                    self.grouped_expert_weight_mesh[titan_template] = value.device_mesh
                    hf_state_dict.update(self._get_local_experts_weights(hf_template, titan_template, layer, value))
                else:
                    for expert, weight in enumerate(value.unbind(0)):
                        hf_state_dict[hf_template.format(layer, expert)] = weight
            else:
                raise KeyError(f"to_hf: no HF name for {key!r}")
        return hf_state_dict

    def _from_hf_unprefixed(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict = {}
        experts_by_layer: dict[str, dict[str, dict[int, Any]]] = {}  # layer -> titan template -> expert -> 2-D
        for key, value in hf_state_dict.items():
            if key in self.from_hf_top:
                state_dict[self.from_hf_top[key]] = value
                continue
            expert_match = _HF_EXPERT.match(key)
            block_match = _HF_BLOCK.match(key)
            if expert_match is not None and expert_match.group(3) in self.from_hf_expert:
                layer, expert, inner = expert_match.groups()
                titan_template = f"layers.{{}}.{self.from_hf_expert[inner]}"
                experts_by_layer.setdefault(layer, {}).setdefault(titan_template, {})[int(expert)] = value
                if titan_template in self.local_experts_indices:  # rank-local experts (after to_hf of DTensors)
                    stacked = self._concatenate_expert_weights_dtensor(experts_by_layer, titan_template, layer)
                else:
                    stacked = self._concatenate_expert_weights(
                        experts_by_layer, titan_template, layer, self.model_args.moe_args.num_experts
                    )
                if stacked is not None:
                    state_dict[titan_template.format(layer)] = stacked
            elif block_match is not None and block_match.group(2) in self.from_hf_block:
                layer, inner = block_match.groups()
                state_dict[f"layers.{layer}.{self.from_hf_block[inner]}"] = value
            elif block_match is not None and block_match.group(2) in self.ignored_hf_keys:
                continue
            else:
                raise KeyError(f"from_hf: no titan-mok name for HF key {key!r}")
        missing = {
            f"{template.format(layer)}: experts {sorted(experts)}"
            for layer, templates in experts_by_layer.items()
            for template, experts in templates.items()
        }
        if missing:
            raise KeyError(f"from_hf: incomplete routed experts (have only) {sorted(missing)}")
        return state_dict
