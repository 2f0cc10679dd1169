"""DeepSeek-V4-Pro ↔ the official checkpoint names (the layout of the published
safetensors, which transformers converts on load): ``embed``, ``head``, ``norm``,
``hc_head_{fn,base,scale}``, ``layers.{i}.{attn,ffn,attn_norm,ffn_norm,hc_attn_*,hc_ffn_*}``,
``mtp.{k}.*``; routed experts one tensor per expert (``ffn.experts.{e}.w{1,2,3}``),
the aux-free bias as ``ffn.gate.bias`` (learned-router layers), the hash table as
``ffn.gate.tid2eid`` (hash layers; loaded as int64). The published weights are
FP8/FP4 with ``*.scale`` companions: ``from_hf`` takes a dequantised checkpoint.

Legend: E experts, I expert FFN size, H hidden.
"""

import re

from titan_mok.models.common.state_dict_adapter import StackedExpertsAdapter, split_prefix

from .args import DeepSeekV4ModelArgs

# native block-relative name -> official block-relative name
BLOCK_NAMES = {
    "attention_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    **{f"{ours}_hc.{leaf}": f"hc_{ours}_{leaf}" for ours in ("attn", "ffn") for leaf in ("fn", "base", "scale")},
    "moe.router.gate.weight": "ffn.gate.weight",
    "moe.expert_bias": "ffn.gate.bias",
    "moe.router.hash_table": "ffn.gate.tid2eid",
    "moe.shared_expert.w_gate.weight": "ffn.shared_experts.w1.weight",
    "moe.shared_expert.w_up.weight": "ffn.shared_experts.w3.weight",
    "moe.shared_expert.w_down.weight": "ffn.shared_experts.w2.weight",
}
ATTENTION = ("attention.", "attn.")  # attention sub-tree: same leaves under another prefix
EXPERT_NAMES = {"moe.experts.w_gate": "w1", "moe.experts.w_up": "w3", "moe.experts.w_down": "w2"}
HEAD_NAMES = {"hc_head.fn": "hc_head_fn", "hc_head.base": "hc_head_base", "hc_head.scale": "hc_head_scale"}
TOP_NAMES = {"tok_embeddings.weight": "embed.weight", "output.weight": "head.weight", "norm.weight": "norm.weight", **HEAD_NAMES}
MTP_NAMES = {
    **{f"{n}.weight": f"{n}.weight" for n in ("enorm", "hnorm", "e_proj", "h_proj", "norm")},
    **HEAD_NAMES,
}
BLOCK_PREFIXES = ((re.compile(r"^layers\.(\d+)\."), r"layers.\1."), (re.compile(r"^mtp\.(\d+)\.block\."), r"mtp.\1."))
MTP_PREFIX = (re.compile(r"^mtp\.(\d+)\."), r"mtp.\1.")
HF_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")


class DeepSeekV4StateDictAdapter(StackedExpertsAdapter):
    def __init__(self, model_args: DeepSeekV4ModelArgs, hf_assets_path: str | None):
        super().__init__(model_args, hf_assets_path)
        self.hf_block_names = {hf: ours for ours, hf in BLOCK_NAMES.items()}
        self.hf_top_names = {hf: ours for ours, hf in TOP_NAMES.items()}
        self.hf_mtp_names = {hf: ours for ours, hf in MTP_NAMES.items()}
        self.hf_expert_names = {hf: ours for ours, hf in EXPERT_NAMES.items()}

    def to_hf(self, state_dict: dict) -> dict:
        hf = {}
        for key, tensor in state_dict.items():
            if key in TOP_NAMES:
                hf[TOP_NAMES[key]] = tensor
                continue
            split = split_prefix(key, BLOCK_PREFIXES)
            if split is None:
                split = split_prefix(key, (MTP_PREFIX,))
                if split is None or split[1] not in MTP_NAMES:
                    raise KeyError(f"{key}: no official name for this DeepSeek-V4 parameter")
                hf[split[0] + MTP_NAMES[split[1]]] = tensor
                continue
            prefix, rest = split
            if rest == "moe.expert_bias" and f"{key[: -len(rest)]}moe.router.hash_table" in state_dict:
                continue  # hash-routed layers have no correction bias
            if rest in EXPERT_NAMES:
                # [E, I, H] (or [E, H, I]) -> E tensors of [I, H] ([H, I])
                hf.update(self.experts_to_hf(prefix, rest, "{}ffn.experts.{}." + EXPERT_NAMES[rest] + ".weight", tensor))
            elif rest in BLOCK_NAMES:
                hf[prefix + BLOCK_NAMES[rest]] = tensor
            elif rest.startswith(ATTENTION[0]):
                hf[prefix + ATTENTION[1] + rest[len(ATTENTION[0]) :]] = tensor
            else:
                raise KeyError(f"{key}: no official name for this DeepSeek-V4 block parameter")
        return hf

    def from_hf(self, hf_state_dict: dict) -> dict:
        native, pending = {}, {}
        hf_block_prefixes = ((re.compile(r"^layers\.(\d+)\."), r"layers.\1."),)
        for key, tensor in hf_state_dict.items():
            if key.endswith(".scale"):
                raise KeyError(
                    f"{key}: a block-quantisation scale (the published FP8/FP4 weights); "
                    "dequantise the checkpoint to BF16/FP32 before loading it"
                )
            if key in self.hf_top_names:
                native[self.hf_top_names[key]] = tensor
                continue
            split = split_prefix(key, hf_block_prefixes + ((MTP_PREFIX[0], r"mtp.\1.block."),))
            if split is None:
                raise KeyError(f"{key}: not a DeepSeek-V4 checkpoint key")
            prefix, rest = split
            if prefix.startswith("mtp.") and rest in self.hf_mtp_names:
                native[prefix[: -len("block.")] + self.hf_mtp_names[rest]] = tensor
            elif expert := HF_EXPERT.fullmatch(rest):
                self.collect_expert(pending, prefix, self.hf_expert_names[expert[2]], int(expert[1]), tensor, native)
            elif rest == "ffn.gate.tid2eid":
                native[prefix + "moe.router.hash_table"] = tensor.long()
            elif rest in self.hf_block_names:
                native[prefix + self.hf_block_names[rest]] = tensor
            elif rest.startswith(ATTENTION[1]):
                native[prefix + ATTENTION[0] + rest[len(ATTENTION[1]) :]] = tensor
            else:
                raise KeyError(f"{key}: not a DeepSeek-V4 checkpoint key")
        self.check_complete(pending)
        return native
