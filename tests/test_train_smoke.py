"""The training entry end to end: 2 ranks, gloo, EP=2; every model's debug flavor
(GLM-5.2's with the sparse DSA path, IndexShare and the MTP loss on), then the
Kimi debug flavor for same-seed bitwise runs."""

import json
import math

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests import torchrun

CONFIG = "train_configs/kimi_k2_7_code/debug.toml"
pytestmark = pytest.mark.slow
ATTACHED = {"kimi_k2_7_code": set(), "glm_5_2": {"mtp", "indexer_kl"}, "qwen3_5_397b_a17b": {"moe_aux", "mtp"},
            "deepseek_v4_pro": {"mtp"}}
"""Losses each debug flavor trains beside the cross-entropy (non-zero coefficients)."""


@pytest.fixture(scope="module", params=["kimi_k2_7_code", "glm_5_2", "qwen3_5_397b_a17b", "deepseek_v4_pro"])
def eager_run(request, tmp_path_factory):
    """(model, losses by step, dump folder) of 12 eager training steps of a model's debug flavor: one run
    serves both tests below."""
    model, folder = request.param, tmp_path_factory.mktemp(request.param)
    _, out = torchrun.run("titan_mok.train", f"train_configs/{model}/debug.toml", "--training.steps", "12",
                          "--metrics.log_freq", "1", "--job.dump_folder", str(folder))
    loss = torchrun.losses(out)
    assert sorted(loss) == list(range(1, 13)), out[-3000:]
    return model, loss, folder


def test_loss_finite_and_falling(eager_run):
    model, loss, folder = eager_run
    assert all(math.isfinite(v) for v in loss.values())
    assert loss[12] < 0.75 * loss[1], loss
    # the losses trained beside the cross-entropy are logged (titan_mok.attached_loss)
    (jsonl,) = folder.glob("tb/*/metrics.jsonl")
    logged = json.loads(jsonl.read_text().splitlines()[-1])["metrics"]
    attached = {k.split("/")[1]: v for k, v in logged.items() if k.startswith("attached_loss/")}
    assert set(attached) == ATTACHED[model] and all(math.isfinite(v) and v >= 0 for v in attached.values()), logged


def test_compiled_training(tmp_path, eager_run):
    """`[compile]`: every block part but the MoE layer compiled (fullgraph), the MoE eager; two steps
    train, and the first loss equals the eager run's to rounding (inductor fuses differently)."""
    model, eager, _ = eager_run
    _, out = torchrun.run("titan_mok.train", f"train_configs/{model}/debug.toml", "--training.steps", "2",
                          "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path), "--compile.enable")
    compiled = torchrun.losses(out)
    assert sorted(compiled) == [1, 2] and all(math.isfinite(v) for v in compiled.values()), out[-3000:]
    assert compiled[1] == pytest.approx(eager[1], rel=1e-4), (compiled, eager)


def _final_weights(tmp_path, tag: str, seed: int) -> dict[str, torch.Tensor]:
    folder = tmp_path / tag
    torchrun.run(
        "titan_mok.train", CONFIG, "--training.steps", "4", "--debug.seed", str(seed),
        "--job.dump_folder", str(folder), "--checkpoint.enable", "--checkpoint.interval", "4",
        "--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "float32",
    )
    dcp_to_torch_save(folder / "checkpoint" / "step-4", folder / "weights.pt")
    return torch.load(folder / "weights.pt", weights_only=True)


def test_same_seed_runs_are_bitwise_identical(tmp_path):
    a, b = _final_weights(tmp_path, "a", 7), _final_weights(tmp_path, "b", 7)
    assert a.keys() == b.keys() and len(a) > 10
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ between same-seed runs: {different[:5]}"
    c = _final_weights(tmp_path, "c", 8)
    assert any(not torch.equal(a[k], c[k]) for k in a), "a different seed gave the same weights"
