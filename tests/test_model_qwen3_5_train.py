"""Qwen3.5-397B-A17B debug flavor through the training entry: 2 ranks, gloo, FSDP."""

import math

import pytest

from tests import torchrun

CONFIG = "train_configs/qwen3_5_397b_a17b/debug.toml"
pytestmark = pytest.mark.slow


def test_debug_flavor_trains(tmp_path):
    _, out = torchrun.run(
        "titan_mok.train", CONFIG, "--training.steps", "12", "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path)
    )
    loss = torchrun.losses(out)
    assert sorted(loss) == list(range(1, 13)), out[-3000:]
    assert all(math.isfinite(v) for v in loss.values())
    assert loss[12] < 0.75 * loss[1], loss
