"""The one_gpu flavors, built on the meta device: full-width MoE layers (the full flavor's hidden
size, expert FFN size, top-k, shared expert and routing), training state within one 80 GB GPU
with room for activations, and the train configs that run them. And the end-to-end baseline:
TorchTitan's deepseek_v3 at Kimi's flavors has our parameter count and FLOPs per token."""

import copy
import dataclasses

import pytest
import tomli
import torch

from titan_mok import registry
from titan_mok.baseline import BASELINE_MODEL, baseline_flavors, deepseek_v3_args
from titan_mok.inspect import inspect_model
from titan_mok.models.common import one_gpu

# Parameters of each one_gpu flavor (its module docstring states them), and the most a flavor may
# have: 16 B/param of training state within 66 GB of the 80 GB GPU, the rest for activations.
PARAMS = {"kimi_k2_7_code": 4_076_657_664, "glm_5_2": 3_695_944_448, "qwen3_5_397b_a17b": 3_999_995_136,
          "deepseek_v4_pro": 3_357_537_777}
MAX_TRAINING_STATE_BYTES = 66e9
SEQ_LEN, BATCH = 4096, 1


@pytest.mark.parametrize("model", registry.MODELS)
def test_one_gpu_flavor_fits_and_keeps_the_moe_layer(model):
    report = inspect_model(model, "one_gpu", seq_len=SEQ_LEN)
    assert report["total_params"] == PARAMS[model]
    assert PARAMS[model] * one_gpu.TRAINING_BYTES_PER_PARAM <= MAX_TRAINING_STATE_BYTES < one_gpu.GPU_BYTES

    flavors = registry.flavors(model)
    small, full = flavors["one_gpu"], flavors["full"]
    assert small.vocab_size == one_gpu.VOCAB_SIZE and small.dim == full.dim
    # the MoE layer as published, but for its expert count
    assert dataclasses.replace(small.moe_args, num_experts=full.moe_args.num_experts) == full.moe_args
    assert small.moe_args.num_experts < full.moe_args.num_experts and small.n_layers < full.n_layers
    assert small.moe_args.num_experts >= 2 * small.moe_args.top_k  # routing still picks among experts
    # rows per expert at the config's tokens per step, as the module docstring states
    rows = SEQ_LEN * BATCH * small.moe_args.top_k / small.moe_args.num_experts
    doc = " ".join(registry.model_module(model).__doc__.split())
    assert f"{rows:,.0f} rows per expert" in doc
    assert f"{PARAMS[model] / 1e9:.2f} B parameters: {PARAMS[model] * 16 / 1e9:.1f} GB of fp32 weights" in doc


@pytest.mark.parametrize("model", registry.MODELS)
def test_one_gpu_config(model):
    with open(f"train_configs/{model}/one_gpu.toml", "rb") as f:
        config = tomli.load(f)
    assert (config["model"]["name"], config["model"]["flavor"]) == (model, "one_gpu")
    assert (config["training"]["seq_len"], config["training"]["local_batch_size"]) == (SEQ_LEN, BATCH)
    assert config["training"]["mixed_precision_param"] == "bfloat16"
    assert config["parallelism"]["expert_parallel_degree"] == 1
    assert config["activation_checkpoint"]["mode"] == "full"
    assert (config["mok"]["backend"], config["mok"]["kernels"]) == ("mok", "auto")


@pytest.mark.parametrize("flavor", ["debug", "one_gpu", "h200"])
def test_baseline_has_our_parameters_and_flops(flavor):
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    ours = inspect_model("kimi_k2_7_code", flavor, seq_len=SEQ_LEN)
    args = copy.deepcopy(baseline_flavors()[flavor])
    args.moe_impl = "standard"  # update_from_config's, from [parallelism] expert_parallel_comm_backend
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    params, flops = args.get_nparams_and_flops(model, SEQ_LEN)
    assert (params, flops) == (ours["total_params"], ours["flops_per_token"])
    assert registry.flavors(BASELINE_MODEL).keys() == registry.flavors("kimi_k2_7_code").keys()


def test_baseline_refuses_what_deepseek_v3_cannot_express():
    glm = registry.flavors("glm_5_2")["one_gpu"]
    kimi = registry.flavors("kimi_k2_7_code")["one_gpu"]
    with pytest.raises(ValueError, match="moe_args.swiglu_limit"):
        deepseek_v3_args(dataclasses.replace(kimi, moe_args=dataclasses.replace(kimi.moe_args, swiglu_limit=10.0)))
    with pytest.raises(ValueError, match="rope_interleaved"):
        deepseek_v3_args(dataclasses.replace(kimi, rope_interleaved=False))
    with pytest.raises(ValueError, match="index_head_dim"):  # the DSA indexer
        deepseek_v3_args(glm)
    with pytest.raises(ValueError, match="MLA decoders only"):
        deepseek_v3_args(registry.flavors("qwen3_5_397b_a17b")["one_gpu"])
