"""GLM-5.2 debug flavor through the training entry: 2 ranks, gloo, EP=2, with the
sparse attention path (seq 128 > index_topk 32), IndexShare and the MTP loss on."""

import math

import pytest

from tests import torchrun

CONFIG = "train_configs/glm_5_2/debug.toml"
pytestmark = pytest.mark.slow


def test_glm_debug_trains_with_ep2(tmp_path):
    _, out = torchrun.run("titan_mok.train", CONFIG, "--training.steps", "12", "--metrics.log_freq", "1",
                          "--job.dump_folder", str(tmp_path))
    loss = torchrun.losses(out)
    assert sorted(loss) == list(range(1, 13)), out[-3000:]
    assert all(math.isfinite(v) for v in loss.values())
    assert loss[12] < 0.75 * loss[1], loss
