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


def split_prefix(key: str, prefixes) -> tuple[str, str] | None:
    """(translated block prefix, block-relative rest) of ``key``, or None."""
    for pattern, replacement in prefixes:
        match = pattern.match(key)
        if match:
            return match.expand(replacement), key[match.end() :]
    return None


class StackedExpertsAdapter(MoEStateDictAdapter):
    """Splits stacked routed-expert tensors ``{prefix}{native leaf} [E, ·, ·]`` into one
    HF tensor per expert and stacks them back, for plain tensors and for
    EP/FSDP-sharded DTensors (this rank's experts only), with TorchTitan's
    ``MoEStateDictAdapter`` helpers. A block ``prefix`` plays the helpers' layer id."""

    def experts_to_hf(self, prefix: str, native_leaf: str, hf_template: str, value) -> dict:
        """``hf_template`` has two ``{}``: the block prefix and the expert id."""
        titan_template = "{}" + native_leaf
        if isinstance(value, DTensor):
            self.grouped_expert_weight_placements[titan_template] = value.placements
            self.grouped_expert_weight_shape[titan_template] = value.shape
            self.grouped_expert_weight_mesh[titan_template] = value.device_mesh
            return self._get_local_experts_weights(hf_template, titan_template, prefix, value)
        return {hf_template.format(prefix, e): w for e, w in enumerate(value.unbind(0))}

    def collect_expert(self, pending: dict, prefix: str, native_leaf: str, expert: int, value, native: dict) -> None:
        """Add one HF expert tensor; once the block's experts are all there, store the stack in ``native``."""
        titan_template = "{}" + native_leaf
        pending.setdefault(prefix, {}).setdefault(titan_template, {})[expert] = value
        if titan_template in self.local_experts_indices:
            stacked = self._concatenate_expert_weights_dtensor(pending, titan_template, prefix)
        else:
            stacked = self._concatenate_expert_weights(pending, titan_template, prefix, self.model_args.moe_args.num_experts)
        if stacked is not None:
            native[titan_template.format(prefix)] = stacked

    @staticmethod
    def check_complete(pending: dict) -> None:
        incomplete = [f"{t.format(p)}: experts {sorted(e)}" for p, ts in pending.items() for t, e in ts.items()]
        if incomplete:
            raise KeyError(f"from_hf: incomplete routed experts (have only) {incomplete}")


class MLAStateDictAdapter(StackedExpertsAdapter):
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
                hf_template = "{}mlp.experts.{}." + EXPERT_KEYS[inner]
                hf_state_dict.update(self.experts_to_hf(f"model.layers.{layer}.", inner, hf_template, value))
            else:
                raise KeyError(f"to_hf: no HF name for {key!r}")
        return hf_state_dict

    def _from_hf_unprefixed(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict = {}
        pending: dict = {}  # routed experts read so far, per block
        for key, value in hf_state_dict.items():
            if key in self.from_hf_top:
                state_dict[self.from_hf_top[key]] = value
                continue
            expert_match = _HF_EXPERT.match(key)
            block_match = _HF_BLOCK.match(key)
            if expert_match is not None and expert_match.group(3) in self.from_hf_expert:
                layer, expert, inner = expert_match.groups()
                self.collect_expert(pending, f"layers.{layer}.", self.from_hf_expert[inner], int(expert), value, state_dict)
            elif block_match is not None and block_match.group(2) in self.from_hf_block:
                layer, inner = block_match.groups()
                state_dict[f"layers.{layer}.{self.from_hf_block[inner]}"] = value
            elif block_match is not None and block_match.group(2) in self.ignored_hf_keys:
                continue
            else:
                raise KeyError(f"from_hf: no titan-mok name for HF key {key!r}")
        self.check_complete(pending)
        return state_dict
