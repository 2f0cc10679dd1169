"""A Hugging Face checkpoint that does not match the model, loaded by an EP=2 `titan_mok.train`
job (``initial_load_in_hf``; docs/faults.md): a missing key, an extra one inside the model's
names and a wrongly shaped one stop the start on every rank with one error naming each key
and its shapes (DCP alone ignores extra keys); keys outside the model's names (a vision tower)
are left out without an error."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.train import fault_jobs
from tests.models.test_model_kimi import hf_config
from tests.models.test_model_kimi_glm_hf import randomize_
from titan_mok.models.kimi_k2_7_code import kimi_k2_7_code_configs

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def test_hf_checkpoint_with_wrong_keys_is_refused_naming_them(tmp_path):
    args = kimi_k2_7_code_configs["debug"]
    hf = transformers.DeepseekV3ForCausalLM(hf_config(args)).float()
    randomize_(hf, 3)
    folder = tmp_path / "hf"
    hf.save_pretrained(folder, safe_serialization=True)
    (path,) = folder.glob("*.safetensors")
    tensors = load_file(path)
    missing, reshaped = "model.layers.1.mlp.experts.3.up_proj.weight", "model.norm.weight"
    extra, foreign = "model.layers.3.self_attn.o_proj.weight", "vision_tower.patch_embed.proj.weight"
    expected_missing_shape = list(tensors.pop(missing).shape)
    tensors[reshaped] = torch.ones(args.dim // 2)
    tensors[extra] = torch.zeros(args.dim, args.n_heads * args.v_head_dim)
    tensors[foreign] = torch.zeros(4, 4)
    save_file(tensors, path, metadata={"format": "pt"})

    rc, output = fault_jobs.run(tmp_path / "log", "--training.steps", "1", "--job.dump_folder", str(tmp_path / "run"),
                                "--checkpoint.enable", "--checkpoint.initial_load_path", str(folder),
                                "--checkpoint.initial_load_in_hf")
    assert rc != 0
    for rank in (0, 1):
        assert f"[rank{rank}]: titan_mok.checkpoint.CheckpointError: HF checkpoint {folder} does not match the model:" in output
    assert f"missing key {missing!r} (the model's shape {expected_missing_shape})" in output
    assert f"key {reshaped!r}: the model's shape [{args.dim}], the checkpoint's [{args.dim // 2}]" in output
    assert f"extra key {extra!r} (shape [{args.dim}, {args.n_heads * args.v_head_dim}]) that the model does not have" in output
    assert foreign not in output.split("does not match the model:")[1].split("[rank")[0]
    assert "step:" not in output
