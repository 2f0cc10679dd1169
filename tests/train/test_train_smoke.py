"""The training entry end to end: 2 ranks, gloo, EP=2; every model's debug flavor
(GLM-5.2's with the sparse DSA path, IndexShare and the MTP loss on), eager and
compiled. Same-seed runs ending in bitwise-equal weights: tests/train/test_compare.py,
on its three runs."""

import json
import math

import pytest

from tests import torchrun

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
