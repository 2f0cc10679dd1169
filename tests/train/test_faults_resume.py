"""Crashes and restarts of `titan_mok.train` with `[checkpoint] enable` (docs/faults.md):
a job killed with SIGKILL while DCP writes a checkpoint restarts, with the same command, from
the last complete checkpoint (the partial folder moved aside with a warning) and its losses
from there equal the uninterrupted run's bit for bit; a finished run given more steps goes on
from its last step; a model-only last checkpoint and damaged checkpoint files stop the start
at once with an error naming the folder or file, never a silent start from scratch."""

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.train import fault_jobs
from tests.train.fault_jobs import Job, checkpoint_args
from titan_mok import checkpoint_files

STEPS, INTERVAL = 8, 2
pytestmark = [pytest.mark.slow, pytest.mark.serial]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run: 8 steps, a full checkpoint every 2."""
    folder = tmp_path_factory.mktemp("reference")
    rc, output = fault_jobs.run(folder / "log", *checkpoint_args(folder, STEPS, INTERVAL))
    assert rc == 0, output[-4000:]
    return folder


def _tensors(step_folder: Path, out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and optimizer state) by flattened name."""
    dcp_to_torch_save(step_folder, out)
    flat, stack = {}, [("", torch.load(out, weights_only=False))]
    while stack:
        prefix, node = stack.pop()
        for key, value in node.items():
            if isinstance(value, dict):
                stack.append((f"{prefix}{key}.", value))
            elif isinstance(value, torch.Tensor) and not (prefix + key).startswith(("train_state", "dataloader")):
                flat[prefix + key] = value
    return flat


def _partial_save(ckpt: Path) -> int | None:
    """A step folder a save is writing: some DCP data file there, no .metadata yet."""
    for step, path in checkpoint_files.step_folders(ckpt).items():
        names = os.listdir(path) if path.is_dir() else []
        if any(n.endswith(".distcp") for n in names) and checkpoint_files.DCP_METADATA not in names:
            return step
    return None


def _kill_inside_a_save(job: Job, ckpt: Path, first: int, timeout: float = 120) -> int:
    """Freeze the whole job the moment a save of step ``first`` or later is under way; if DCP's
    .metadata is still absent, SIGKILL it (a kill mid-save), else let it go on to the next save.
    The step killed in."""
    job.wait_until(lambda: len(job.workers()) == 2, timeout, "both workers")
    end, missed = time.monotonic() + timeout, set()
    while time.monotonic() < end and job.proc.poll() is None:
        step = _partial_save(ckpt)
        if step is None or step < first or step in missed:
            time.sleep(0.002)
            continue
        job.signal_job(signal.SIGSTOP)
        if not (ckpt / f"step-{step}" / checkpoint_files.DCP_METADATA).exists():
            job.signal_job(signal.SIGKILL)
            job.wait(30)
            return step
        missed.add(step)
        job.signal_job(signal.SIGCONT)
    job.kill()
    raise AssertionError(f"no save could be caught unfinished (missed: {sorted(missed)}):\n{job.output()[-3000:]}")


def test_killed_mid_save_resumes_from_last_complete_checkpoint_bitwise(reference, tmp_path):
    folder = tmp_path / "run"
    args = checkpoint_args(folder, STEPS, INTERVAL)
    ckpt = folder / "checkpoint"
    killed_in = _kill_inside_a_save(Job(tmp_path / "killed.log", *args), ckpt, first=2 * INTERVAL)
    print(f"\nkilled inside the save of step {killed_in}: {sorted(os.listdir(ckpt / f'step-{killed_in}'))}")
    assert (ckpt / f"step-{killed_in}").is_dir() and not (ckpt / f"step-{killed_in}" / ".metadata").exists()
    last_complete = killed_in - INTERVAL

    rc, output = fault_jobs.run(tmp_path / "resumed.log", *args)  # the same command again
    assert rc == 0, output[-4000:]
    assert f"checkpoint {ckpt / f'step-{killed_in}'} is incomplete" in output
    assert (ckpt / "incomplete" / f"step-{killed_in}").is_dir()
    assert f"Training starts at step {last_complete + 1}" in output
    full, resumed = fault_jobs.losses(reference), fault_jobs.losses(folder)
    assert sorted(resumed) == list(range(last_complete + 1, STEPS + 1))
    assert resumed == {step: full[step] for step in resumed}  # float equality: bit for bit
    a, b = (_tensors(f / "checkpoint" / f"step-{STEPS}", tmp_path / f"{f.name}.pt") for f in (reference, folder))
    assert a.keys() == b.keys() and len(a) > 100
    assert [k for k in a if not torch.equal(a[k], b[k])] == []  # the same weights and optimizer state


def test_finished_run_continues_with_more_steps(reference, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(reference / "checkpoint", folder / "checkpoint")
    rc, output = fault_jobs.run(tmp_path / "log", *checkpoint_args(folder, STEPS + 2, INTERVAL))
    assert rc == 0, output[-4000:]
    assert f"Loading the checkpoint from {folder / 'checkpoint' / f'step-{STEPS}'}" in output
    assert f"Training starts at step {STEPS + 1}" in output
    assert sorted(fault_jobs.losses(folder)) == [STEPS + 1, STEPS + 2]
    assert checkpoint_files.state(folder / "checkpoint" / f"step-{STEPS + 2}") == "complete"


def test_model_only_last_checkpoint_stops_the_continuation_at_once(tmp_path):
    folder = tmp_path / "run"
    rc, output = fault_jobs.run(tmp_path / "first.log", *checkpoint_args(folder, 4, 2, "--checkpoint.last_save_model_only"))
    assert rc == 0, output[-4000:]
    rc, output = fault_jobs.run(tmp_path / "more.log", *checkpoint_args(folder, 6, 2))
    assert rc != 0
    last = folder / "checkpoint" / "step-4"
    for rank in (0, 1):
        assert f"[rank{rank}]: titan_mok.checkpoint.CheckpointError: checkpoint {last} holds the model weights only" in output
    assert "previous full checkpoint (step-2)" in output and "last_save_model_only = false" in output
    assert "step:" not in output and "Missing key" not in output


def test_damaged_checkpoint_files_are_named_never_skipped(reference, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(reference / "checkpoint", folder / "checkpoint")
    last = folder / "checkpoint" / f"step-{STEPS}"
    truncated, flipped = last / "__1_0.distcp", last / "__0_0.distcp"
    os.truncate(truncated, truncated.stat().st_size // 2)
    with open(flipped, "r+b") as f:
        f.seek(flipped.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    rc, output = fault_jobs.run(tmp_path / "log", *checkpoint_args(folder, STEPS + 2, INTERVAL))
    assert rc != 0
    for rank in (0, 1):
        assert f"[rank{rank}]: titan_mok.checkpoint.CheckpointError: checkpoint {last} is damaged" in output
    assert f"{truncated}: {truncated.stat().st_size} bytes" in output and "(truncated" in output
    assert f"{flipped}: CRC-32" in output and "(corrupted)" in output
    assert "step:" not in output  # no step trained: neither from an older checkpoint nor from scratch
