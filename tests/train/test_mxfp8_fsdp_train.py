"""``precision = "mxfp8"`` under FSDP in the training entry: 2 ranks (gloo), the Kimi debug flavor at EP 1, so
FSDP shards every MoE layer's experts over both ranks and all-gathers them as MXFP8 (titan_mok.moe.mxfp8_fsdp).

Claims: two runs end with the same losses and weights, bit for bit; a run resumed from the step-3 checkpoint
continues bit for bit (the MXFP8 copies are derived state: made again from the loaded weights); with full
activation checkpointing (one all-gather then carries both layouts) the losses are the same bits; and the
losses equal those of the run whose experts FSDP does not split (EP 2: each rank holds its four experts
whole): step 1 bit for bit (the same weights), then within 2e-5 relative over the first three steps, the
same math with the expert gradients summed in another order (tests/moe/test_moe_train.py's tolerance and
step count for that). Later the two orders drift further apart as the loss falls fast, in bf16 as in mxfp8
(bf16: 2.4e-5 relative at step 4), so later steps are not compared.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests import torchrun

CONFIG = "train_configs/kimi_k2_7_code/debug.toml"
STEPS, MID = 6, 3
pytestmark = pytest.mark.slow


def _records(folder: Path, ep: int, *overrides: str, checkpoint: bool = True, config: str = CONFIG,
             steps: int = STEPS) -> list[dict]:
    saving = ("--checkpoint.enable", "--checkpoint.interval", str(MID), "--checkpoint.last_save_model_only",
              "--checkpoint.export_dtype", "float32") if checkpoint else ()
    torchrun.run(
        "titan_mok.train", config, "--mok.precision", "mxfp8", "--parallelism.expert_parallel_degree", str(ep),
        "--training.steps", str(steps), "--metrics.log_freq", "1", "--job.dump_folder", str(folder), *saving,
        *overrides,
    )
    (jsonl,) = folder.glob("tb/*/metrics.jsonl")
    return [json.loads(line) for line in jsonl.read_text().splitlines()[1:]]


def _run(folder: Path, ep: int, *overrides: str, checkpoint: bool = True) -> dict[int, float]:
    """Step -> loss of a Kimi debug run (full precision, from the metrics JSONL)."""
    return {r["step"]: r["metrics"]["loss_metrics/global_avg_loss"]
            for r in _records(folder, ep, *overrides, checkpoint=checkpoint)}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(folder / "checkpoint" / f"step-{STEPS}", folder / "weights.pt")
    return torch.load(folder / "weights.pt", weights_only=True)


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and any(".moe.experts.w_gate" in k for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ: {different[:5]}"


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ep1")
    losses = _run(folder, 1)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return folder, losses


def test_two_runs_are_bitwise_identical(sharded_run, tmp_path):
    folder, losses = sharded_run
    assert _run(tmp_path, 1) == losses
    _assert_same_weights(_weights(tmp_path), _weights(folder))


def test_resume_continues_bitwise(sharded_run, tmp_path):
    folder, losses = sharded_run
    mid = Path("checkpoint") / f"step-{MID}"
    shutil.copytree(folder / mid, tmp_path / mid)
    assert _run(tmp_path, 1) == {step: losses[step] for step in range(MID + 1, STEPS + 1)}
    _assert_same_weights(_weights(tmp_path), _weights(folder))


def test_activation_checkpointing_keeps_the_bits(sharded_run, tmp_path):
    _, losses = sharded_run
    assert _run(tmp_path, 1, "--activation_checkpoint.mode", "full", checkpoint=False) == losses


def test_losses_equal_the_run_with_unsplit_experts(sharded_run, tmp_path):
    _, losses = sharded_run
    whole = _run(tmp_path, 2, checkpoint=False)
    assert whole[1] == losses[1], (whole, losses)  # the same weights: the same bits
    for step in range(1, MID + 1):
        assert abs(whole[step] - losses[step]) <= 2e-5 * abs(losses[step]), (whole, losses)


def test_experts_outside_the_blocks_gather_as_mxfp8(tmp_path):
    """Qwen3.5's MTP module has its own MoE layer, outside ``model.layers``: FSDP's root group gathers its
    experts (as MXFP8, both layouts at once: the root is not resharded after forward). Its MTP loss trains;
    step 1 is the same bits whether or not FSDP splits the blocks' experts."""
    config = "train_configs/qwen3_5_397b_a17b/debug.toml"
    runs = {ep: _records(tmp_path / f"ep{ep}", ep, checkpoint=False, config=config, steps=2) for ep in (1, 2)}
    for ep, records in runs.items():
        assert [r["step"] for r in records] == [1, 2], records
        assert all(math.isfinite(r["metrics"]["attached_loss/mtp"]) for r in records), f"EP {ep}: no MTP loss"
    loss = {ep: [r["metrics"]["loss_metrics/global_avg_loss"] for r in records] for ep, records in runs.items()}
    assert all(math.isfinite(v) for v in loss[1]) and loss[1][0] == loss[2][0], loss
