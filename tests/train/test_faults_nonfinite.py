"""A NaN injected for real into one rank's forward of one step (``[debug] fault_nonfinite_*``:
a module's output poisoned, the NaN carried through the real forward, loss and backward) in an
EP=2 `titan_mok.train` job (docs/faults.md): ``[training] nonfinite = "stop"`` stops the run on
every rank naming the step and the module where the NaN began, before the update, so no
checkpoint holds non-finite weights; "skip" drops that step's update (the next checkpoint holds
exactly the weights and optimizer state of the one before); NaN router logits on one EP rank
stop every rank with the router's error and the module named."""

import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.train import fault_jobs
from tests.train.fault_jobs import checkpoint_args
from titan_mok import checkpoint_files

pytestmark = pytest.mark.slow


def _inject(step: int, module: str, rank: int) -> tuple[str, ...]:
    return ("--debug.fault_nonfinite_step", str(step), "--debug.fault_nonfinite_module", module,
            "--debug.fault_nonfinite_rank", str(rank))


def _load(step_folder: Path) -> dict:
    dcp_to_torch_save(step_folder, step_folder.parent / f"{step_folder.name}.pt")
    return torch.load(step_folder.parent / f"{step_folder.name}.pt", weights_only=False)


def _tensors(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_tensors(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[prefix + key] = value
    return out


def test_nonfinite_loss_stops_the_run_naming_step_and_module(tmp_path):
    folder = tmp_path / "run"
    rc, output = fault_jobs.run(tmp_path / "log", *checkpoint_args(folder, 6, 1), *_inject(3, "norm", 0))
    assert rc != 0
    for rank in (0, 1):
        assert re.search(rf"\[rank{rank}\]: titan_mok\.faults\.NonfiniteError: step 3: the loss or the gradients are "
                         r"not finite; first non-finite forward output: 'norm' on rank 0 \(microbatch 0\)", output)
    assert "no checkpoint holds non-finite weights" in output
    states = {s: checkpoint_files.state(p) for s, p in checkpoint_files.step_folders(folder / "checkpoint").items()}
    assert states == {1: "complete", 2: "complete"}  # the interval is 1: step 3 was never saved
    weights = _tensors(_load(folder / "checkpoint" / "step-2"))
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())


def test_nonfinite_step_skipped_leaves_weights_and_optimizer_unchanged(tmp_path):
    folder = tmp_path / "run"
    rc, output = fault_jobs.run(tmp_path / "log", *checkpoint_args(folder, 4, 1), *_inject(3, "norm", 0),
                                "--training.nonfinite", "skip")
    assert rc == 0, output[-4000:]
    assert "step 3: the loss or the gradients are not finite; first non-finite forward output: 'norm' on rank 0" in output
    assert "[training] nonfinite = 'skip': the step's update is skipped" in output
    losses = fault_jobs.losses(folder)
    assert losses[3] != losses[3] and all(losses[s] == losses[s] for s in (1, 2, 4))  # NaN only at step 3
    before, after, next_ = (_tensors(_load(folder / "checkpoint" / f"step-{s}")) for s in (2, 3, 4))
    trained = [k for k in before if not k.startswith(("train_state", "lr_scheduler", "dataloader"))]
    assert len(trained) > 100 and any(k.startswith("optimizer.") for k in trained)
    changed = [k for k in trained if not torch.equal(before[k], after[k])]
    assert changed == [], f"a skipped step changed {changed[:5]}"
    assert any(not torch.equal(after[k], next_[k]) for k in trained)  # step 4 trains again
    assert all(torch.isfinite(next_[k]).all() for k in trained if next_[k].is_floating_point())


def test_router_nan_on_one_ep_rank_stops_every_rank(tmp_path):
    rc, output = fault_jobs.run(tmp_path / "log", "--training.steps", "3", "--job.dump_folder", str(tmp_path / "run"),
                                *_inject(2, "layers.1.ffn_norm", 1))
    assert rc != 0
    for rank in (0, 1):
        assert re.search(rf"\[rank{rank}\]: titan_mok\.faults\.NonfiniteError: step 2: MoE router logits contain NaN or "
                         r"Inf \(on some EP rank\): check the layer input; first non-finite forward output: "
                         r"'layers\.1\.ffn_norm' on rank 1 \(microbatch 0\)", output)


def test_nonfinite_weights_are_never_saved(tmp_path):
    """With the guard off (``ignore``), the NaN reaches the weights; the save checks them first."""
    folder = tmp_path / "run"
    rc, output = fault_jobs.run(tmp_path / "log", *checkpoint_args(folder, 6, 1), *_inject(3, "norm", 0),
                                "--training.nonfinite", "ignore")
    assert rc != 0
    for rank in (0, 1):
        assert (f"[rank{rank}]: titan_mok.checkpoint.CheckpointError: cannot save checkpoint step-3 "
                f"({folder / 'checkpoint' / 'step-3'}): the model weights are not finite (rank 0: first in ") in output
    states = {s: checkpoint_files.state(p) for s, p in checkpoint_files.step_folders(folder / "checkpoint").items()}
    assert states == {1: "complete", 2: "complete"}
