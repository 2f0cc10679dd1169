"""`titan_mok.rl` end to end under torchrun (2 ranks, gloo, the Kimi debug flavor):
logprob parity 0 on every step, the reward rises, two runs are bitwise identical,
and a run resumed from a mid-run DCP checkpoint continues bitwise. The other three
models: a short run each, cached decoding with parity 0.

One 24-step run at EP 2 (checkpoints at steps 12 and 24) serves all tests; a second
run of 12 steps, a resume from step 12 and one step at EP 1 compare against it.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests import torchrun

CONFIG = "train_configs/kimi_k2_7_code/rl_debug.toml"
STEPS, MID = 24, 12
pytestmark = pytest.mark.slow

# Wall-clock and memory series differ between runs by nature; everything else must not.
_NOT_COMPARED = ("throughput", "tflops", "mfu", "time_metrics/", "memory/", "/time_share", "tokens_per_s")


def _run(folder: Path, steps: int, *overrides: str) -> dict[int, dict]:
    torchrun.run(
        "titan_mok.rl", CONFIG, "--training.steps", str(steps), "--job.dump_folder", str(folder),
        "--checkpoint.enable", "--checkpoint.interval", str(MID), "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype", "float32", *overrides,
    )
    (jsonl,) = folder.glob("tb/*/metrics.jsonl")
    records = [json.loads(line) for line in jsonl.read_text().splitlines()[1:]]
    return {r["step"]: r["metrics"] for r in records}


def _comparable(metrics: dict, resumed: bool = False) -> dict:
    kept = {k: v for k, v in metrics.items() if not any(part in k for part in _NOT_COMPARED)}
    if resumed:  # the checksum chains the losses since the run (not the checkpoint) started
        kept.pop("determinism/loss_checksum")
    return kept


def _weights(folder: Path, step: int) -> dict[str, torch.Tensor]:
    out = folder / f"weights-{step}.pt"
    dcp_to_torch_save(folder / "checkpoint" / f"step-{step}", out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


def _assert_same_weights(a: dict, b: dict) -> None:
    shared = a.keys() & b.keys()
    assert len(shared) > 10, (sorted(a)[:5], sorted(b)[:5])
    different = [k for k in shared if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ: {different[:5]}"


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rl_full")
    return folder, _run(folder, STEPS)


def test_parity_is_zero_every_step_and_reward_rises(full_run):
    _, metrics = full_run
    assert sorted(metrics) == list(range(1, STEPS + 1))
    assert all(m["rl/logprob_max_abs_diff"] == 0.0 for m in metrics.values())
    half = STEPS // 2
    first = sum(metrics[s]["rl/reward_mean"] for s in range(1, half + 1)) / half
    second = sum(metrics[s]["rl/reward_mean"] for s in range(half + 1, STEPS + 1)) / half
    # measured (2 CPU cores, 2026-11-30): 0.065 over steps 1-12, 0.101 over steps 13-24
    assert second > first + 0.01, f"mean reward of steps 1-{half}: {first:.4f}, of steps {half + 1}-{STEPS}: {second:.4f}"


def test_two_runs_are_bitwise_identical(full_run, tmp_path):
    folder, metrics = full_run
    again = _run(tmp_path / "again", MID)
    for step in range(1, MID + 1):
        assert _comparable(again[step]) == _comparable(metrics[step]), f"step {step} differs"
    _assert_same_weights(_weights(tmp_path / "again", MID), _weights(folder, MID))


def test_resume_continues_bitwise(full_run, tmp_path):
    folder, metrics = full_run
    resumed_folder = tmp_path / "resumed"
    shutil.copytree(folder / "checkpoint" / f"step-{MID}", resumed_folder / "checkpoint" / f"step-{MID}")
    resumed = _run(resumed_folder, STEPS)
    assert sorted(resumed) == list(range(MID + 1, STEPS + 1)), "the run did not resume at the checkpoint"
    for step in resumed:
        assert _comparable(resumed[step], True) == _comparable(metrics[step], True), f"step {step} differs"
    _assert_same_weights(_weights(resumed_folder, STEPS), _weights(folder, STEPS))


def test_rollouts_do_not_depend_on_the_ep_degree(full_run, tmp_path):
    """Same weights (step 1), EP 1 instead of 2: the same sampled tokens, logprobs and rewards.
    (Later steps may differ: gradient reductions under EP 1 and 2 round differently.)"""
    _, metrics = full_run
    ep1 = _run(tmp_path / "ep1", 1, "--parallelism.expert_parallel_degree", "1")
    assert ep1[1]["rl/rollout_digest"] == metrics[1]["rl/rollout_digest"]
    assert ep1[1]["rl/reward_mean"] == metrics[1]["rl/reward_mean"]


@pytest.mark.parametrize("model", ["glm_5_2", "qwen3_5_397b_a17b", "deepseek_v4_pro"])
def test_other_models_decode_cached_with_parity_zero(model, tmp_path):
    """The other three debug flavors, 3 RL steps at EP 2 under FSDP: each decodes through its
    own cached step (titan_mok/rl/cached_*.py) and the trainer recomputes the same bits; the
    MTP loss stays off."""
    _, out = torchrun.run(
        "titan_mok.rl", f"train_configs/{model}/rl_debug.toml", "--training.steps", "3",
        "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path), "--rl.parity", "fail",
    )
    assert "RL rollouts: KV-cache decoding" in out, out[-3000:]
    (jsonl,) = tmp_path.glob("tb/*/metrics.jsonl")
    metrics = [json.loads(line)["metrics"] for line in jsonl.read_text().splitlines()[1:]]
    assert [m["rl/logprob_max_abs_diff"] for m in metrics] == [0.0, 0.0, 0.0]
    assert all(m["rl/completion_tokens"] > 0 for m in metrics)
    # the MTP module (all three have one, trained in pretraining) is not trained on rollouts;
    # the other attached losses still are (GLM-5.2's indexer KL: the metric is logged)
    assert not any("attached_loss/mtp" in m for m in metrics), sorted(metrics[0])
    assert model != "glm_5_2" or all("attached_loss/indexer_kl" in m for m in metrics), sorted(metrics[0])
