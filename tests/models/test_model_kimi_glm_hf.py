"""Helpers shared by the Kimi and GLM parity tests (transformers is the test-only
reference), and the behaviour common to both models (adapter prefix, causality, bf16)."""

import copy
import dataclasses
import json
import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from safetensors.torch import load_file

from titan_mok import registry
from titan_mok.config_check import MokConfigManager
from titan_mok.models.common.state_dict_adapter import MLAStateDictAdapter
from titan_mok.models.kimi_k2_7_code import kimi_k2_7_code_configs


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Every parameter and the routers' correction biases: O(1)-scale random values
    (HF's init leaves norms at 1 and biases at 0, which would hide mapping errors)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def save_and_load_hf(hf_model, folder) -> dict[str, torch.Tensor]:
    """The HF checkpoint format (per-expert tensors), as ``save_pretrained`` writes it."""
    hf_model.save_pretrained(folder, safe_serialization=True)
    hf_sd = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            hf_sd.update(load_file(os.path.join(folder, name)))
    return hf_sd


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


def test_multimodal_prefix_is_detected_from_the_index(tmp_path):
    args = kimi_k2_7_code_configs["debug"]
    weight_map = {"language_model.model.embed_tokens.weight": "model-00001.safetensors",
                  "vision_tower.patch_embed.proj.weight": "model-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    adapter = MLAStateDictAdapter(args, str(tmp_path))
    hf = adapter.to_hf({"tok_embeddings.weight": torch.ones(2), "layers.0.attention.wo.weight": torch.zeros(3)})
    assert set(hf) == {"language_model.model.embed_tokens.weight", "language_model.model.layers.0.self_attn.o_proj.weight"}
    assert set(adapter.from_hf(hf)) == {"tok_embeddings.weight", "layers.0.attention.wo.weight"}
    with pytest.raises(KeyError, match="lacks the checkpoint's prefix"):
        adapter.from_hf({"model.norm.weight": torch.ones(2)})


@pytest.mark.parametrize("name", ["kimi_k2_7_code", "glm_5_2"])
def test_debug_flavor_is_causal_and_trains_in_bf16(name):
    """Changing token j leaves the logits before j bit for bit unchanged (GLM: seq 48 >
    index_topk 32, so the indexer and sparse attention run); bf16 forward/backward is finite."""
    args = registry.flavors(name)["debug"]
    model = registry.model_module(name).get_train_spec().model_cls(args)
    torch.manual_seed(0)
    model.init_weights(torch.device("cpu"))
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(8))
    changed = tokens.clone()
    changed[:, 40] = (changed[:, 40] + 1) % args.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :40], after[:, :40])
    assert not torch.equal(before[:, 40:], after[:, 40:])

    model = model.to(torch.bfloat16)
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
    assert logits.dtype == torch.bfloat16
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_adapter_round_trips_ep_sharded_experts(one_rank_gloo):
    """Routed experts as DTensors Shard(0) (EP/FSDP; here a 1-rank gloo mesh) split into
    this rank's per-expert HF tensors and stack back into the same DTensor layout."""
    args = registry.flavors("glm_5_2")["debug"]
    model = registry.model_module("glm_5_2").get_train_spec().model_cls(args)
    model.init_weights(torch.device("cpu"))
    plain = model.state_dict()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) if ".moe.experts." in k else v for k, v in plain.items()}
    adapter = registry.model_module("glm_5_2").get_train_spec().state_dict_adapter(args, None)
    hf = adapter.to_hf(sharded)
    assert "model.layers.4.mlp.experts.7.down_proj.weight" in hf  # the MTP block's experts too
    back = adapter.from_hf(hf)
    assert set(back) == set(plain)
    for key, value in back.items():
        if ".moe.experts." in key:
            assert isinstance(value, DTensor) and value.placements == (Shard(0),)
            value = value.full_tensor()
        assert torch.equal(value, plain[key]), key


@pytest.mark.parametrize("name", ["kimi_k2_7_code", "glm_5_2"])
def test_update_from_config_sets_seq_len_and_mok_section(name):
    """Through the real config manager: [training] seq_len sizes the rotary cache, [mok] reaches MoEArgs."""
    args = copy.deepcopy(registry.flavors(name)["debug"])
    job = MokConfigManager().parse_args(["--job.config_file", f"train_configs/{name}/debug.toml", "--training.seq_len", "96",
                                         "--mok.backend", "torchtitan", "--mok.kernels", "reference",
                                         "--parallelism.expert_parallel_degree", "1"])  # this process is 1 rank
    args.update_from_config(job)
    assert (args.max_seq_len, args.moe_args.backend, args.moe_args.kernels) == (96, "torchtitan", "reference")
    model = registry.model_module(name).get_train_spec().model_cls(args)
    assert model.rope_cache.shape == (96, args.qk_rope_head_dim)


def test_bad_arguments_and_inputs_raise_clear_errors():
    args = registry.flavors("glm_5_2")["debug"]
    with pytest.raises(ValueError, match="GLM52Args.kv_lora_rank = 0"):
        dataclasses.replace(args, kv_lora_rank=0)
    with pytest.raises(ValueError, match="GLM52Args.index_topk = 0"):
        dataclasses.replace(args, index_topk=0)
    model = registry.model_module("glm_5_2").get_train_spec().model_cls(copy.deepcopy(args))
    with pytest.raises(ValueError, match=r"sequence length 4097 exceeds the rotary cache \(4096"):
        model(torch.zeros(1, 4097, dtype=torch.long))
    with pytest.raises(ValueError, match=r"tokens_BS must be \[batch, seq\]"):
        model(torch.zeros(8, dtype=torch.long))
