"""titan_mok.metrics and titan_mok.moe_stats, single process (the end-to-end runs are in test_compare.py)."""

import math

import pytest
import torch
from torch import nn
from torchtitan.config import ConfigManager

from titan_mok.metrics import mfu_peak, wandb_run_settings
from titan_mok.moe import MoE, MoEArgs
from titan_mok.moe.aux_loss import load_balance_aux_loss
from titan_mok.moe_stats import MoEStats, layer_label


def _job_config(*overrides: str):
    return ConfigManager().parse_args(["--job.custom_config_module", "titan_mok.config", *overrides])


def test_wandb_settings_toml_then_environment():
    config = _job_config(
        "--metrics.wandb_run_name", "toml-name", "--metrics.wandb_group", "g", "--metrics.wandb_tags", "a,b",
        "--metrics.wandb_notes", "n", "--model.name", "kimi_k2_7_code",
    )
    settings = wandb_run_settings(config, environ={})
    assert settings == {
        "project": "titan-mok", "entity": None, "name": "toml-name", "group": "g", "tags": ["a", "b"],
        "notes": "n", "mode": "offline",
    }
    env = {"WANDB_RUN_NAME": "env-name", "WANDB_TAGS": "x, y", "WANDB_TEAM": "team", "WANDB_API_KEY": "k"}
    settings = wandb_run_settings(config, environ=env)
    assert (settings["name"], settings["tags"], settings["entity"], settings["group"]) == ("env-name", ["x", "y"], "team", "g")
    assert settings["mode"] == "online"  # an API key and no WANDB_MODE
    assert wandb_run_settings(config, environ={**env, "WANDB_MODE": "offline"})["mode"] == "offline"
    # W&B's own name wins over TorchTitan's alias
    assert wandb_run_settings(config, environ={**env, "WANDB_NAME": "wandb-name"})["name"] == "wandb-name"


def test_default_run_name_says_what_runs():
    config = _job_config("--model.name", "kimi_k2_7_code", "--model.flavor", "debug", "--debug.seed", "3",
                         "--mok.precision", "mxfp8", "--parallelism.expert_parallel_degree", "2")
    assert wandb_run_settings(config, environ={})["name"] == "kimi_k2_7_code-debug-mok-mxfp8-ep2-seed3"
    # TorchTitan's own model at Kimi's dims (titan_mok.baseline) has no [mok] layers to name
    config = _job_config("--model.name", "deepseek_v3_titan_mok_dims", "--model.flavor", "one_gpu", "--debug.seed", "3")
    assert wandb_run_settings(config, environ={})["name"] == "deepseek_v3_titan_mok_dims-one_gpu-ep1-seed3"


def test_mfu_peak():
    config = _job_config()
    peak, source = mfu_peak(config, "cpu", "x86_64")
    assert math.isnan(peak) and "not meaningful" in source
    assert mfu_peak(config, "cuda", "NVIDIA H200")[0] == 800e12  # measured on the project's machines
    assert mfu_peak(config, "cuda", "NVIDIA H100 80GB HBM3")[0] == 775e12
    assert mfu_peak(config, "cuda", "NVIDIA H100 PCIe")[1].startswith("torchtitan.tools.utils.get_peak_flops")
    assert mfu_peak(_job_config("--metrics.mfu_peak_tflops", "500"), "cuda", "NVIDIA H200") == (500e12, "[metrics] mfu_peak_tflops")
    with pytest.raises(ValueError, match="mfu_peak_tflops = -1.0"):
        mfu_peak(_job_config("--metrics.mfu_peak_tflops", "-1"), "cuda", "NVIDIA H200")


def test_layer_label_strips_wrappers():
    assert layer_label("layers.3.moe") == "layers_3"
    assert layer_label("layers.3._checkpoint_wrapped_module.moe") == "layers_3"
    assert layer_label("_orig_mod.mtp.0.moe") == "mtp_0"


class _TwoLayers(nn.Module):
    def __init__(self, args: MoEArgs, dim: int):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.ModuleDict({"moe": MoE(args, dim)}) for i in range(2)})
        for block in self.layers.values():
            block["moe"].init_weights(0.02, torch.device("cpu"))

    def forward(self, x_BSH):
        for block in self.layers.values():
            x_BSH = x_BSH + block["moe"](x_BSH)
        return x_BSH


def _picks(model, x_BSH) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """Each layer's top-k picks per expert, token entropies and aux loss, recomputed from its router."""
    out = []
    for block in model.layers.values():
        moe = block["moe"]
        _, topk_idx_TK, scores_TE = moe.router(moe.router.logits(x_BSH.flatten(0, 1)), moe.expert_bias, None)
        p_TE = scores_TE / scores_TE.sum(-1, keepdim=True)
        out.append((torch.bincount(topk_idx_TK.flatten(), minlength=moe.args.num_experts).double(),
                    torch.special.entr(p_TE).sum(-1).double(),
                    load_balance_aux_loss(scores_TE, topk_idx_TK).item()))
        x_BSH = x_BSH + moe(x_BSH)
    return out


def test_moe_stats_match_a_recount():
    torch.manual_seed(0)
    args = MoEArgs(num_experts=4, top_k=2, expert_dim=16, shared_expert_dim=8)
    model = _TwoLayers(args, dim=8)
    with torch.no_grad():
        model.layers["1"]["moe"].expert_bias.copy_(torch.tensor([0.0, 0.5, 0.0, -1.0]))
    stats = MoEStats([model], group=None)
    x_BSH = torch.randn(3, 5, 8, requires_grad=True)
    model(x_BSH).square().sum().backward()
    with torch.no_grad():  # not a training forward: counts nothing
        model(torch.randn(2, 5, 8))
    metrics = stats.collect()
    # collect zeroes what it read; the layer's own counter too
    assert all(torch.equal(b["moe"].expert_load, torch.zeros(4)) for b in model.layers.values())

    stats.remove()
    with torch.no_grad():
        expected = _picks(model, x_BSH)
    for (load_E, entropy_T, aux), label in zip(expected, ("layers_0", "layers_1")):
        mean = load_E.mean()
        assert metrics[f"moe/{label}/load_max_over_mean"] == (load_E.max() / mean).item()
        assert metrics[f"moe/{label}/load_min_over_mean"] == (load_E.min() / mean).item()
        assert metrics[f"moe/{label}/load_cv"] == pytest.approx((load_E.std(unbiased=False) / mean).item(), rel=1e-12)
        assert metrics[f"moe/{label}/router_entropy"] == pytest.approx(entropy_T.mean().item(), rel=1e-6)
        assert metrics[f"moe/{label}/tokens_dropped"] == 0
        assert metrics[f"moe/{label}/aux_loss"] == aux
    assert metrics["moe/layers_0/bias_norm"] == 0
    assert metrics["moe/layers_1/bias_norm"] == pytest.approx(math.hypot(0.5, 1.0))
    assert metrics["moe/tokens_dropped"] == 0


def test_tokens_dropped_counts_rows_the_experts_did_not_compute():
    torch.manual_seed(0)
    model = _TwoLayers(MoEArgs(num_experts=4, top_k=2, expert_dim=16), dim=8)
    experts = model.layers["1"]["moe"].experts
    compute = experts.forward

    def drop_three_rows(x_RH, group_end_L):  # a dispatch bug that loses 3 rows
        y_RH = compute(x_RH, group_end_L)
        experts.rows_computed.sub_(3)
        return y_RH

    experts.forward = drop_three_rows
    stats = MoEStats([model], group=None)
    model(torch.randn(2, 5, 8, requires_grad=True)).sum().backward()
    metrics = stats.collect()
    stats.remove()
    assert metrics["moe/layers_0/tokens_dropped"] == 0 and metrics["moe/layers_1/tokens_dropped"] == 3
    assert metrics["moe/tokens_dropped"] == 3


def test_moe_stats_reset_between_logs():
    torch.manual_seed(0)
    model = _TwoLayers(MoEArgs(num_experts=4, top_k=1, expert_dim=16), dim=8)
    stats = MoEStats([model], group=None)
    model(torch.randn(2, 4, 8, requires_grad=True)).sum().backward()
    stats.collect()
    empty = stats.collect()  # nothing ran since the last log
    assert math.isnan(empty["moe/layers_0/load_cv"]) and math.isnan(empty["moe/layers_0/router_entropy"])
    assert empty["moe/tokens_dropped"] == 0
    stats.remove()
