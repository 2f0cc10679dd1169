"""`titan_mok.train` resumed from a mid-run DCP checkpoint (TorchTitan's
``[checkpoint]``: model, optimizer, LR schedule, data position, step) continues
bit for bit: the same losses and the same final weights as the uninterrupted run."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests import torchrun

CONFIG = "train_configs/kimi_k2_7_code/debug.toml"
STEPS, MID = 6, 3
pytestmark = pytest.mark.slow


def _run(folder: Path, precision: str) -> dict[int, float]:
    torchrun.run(
        "titan_mok.train", CONFIG, "--mok.precision", precision, "--training.steps", str(STEPS), "--metrics.log_freq", "1",
        "--job.dump_folder", str(folder), "--checkpoint.enable", "--checkpoint.interval", str(MID),
        "--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "float32",
    )
    (jsonl,) = folder.glob("tb/*/metrics.jsonl")
    records = [json.loads(line) for line in jsonl.read_text().splitlines()[1:]]
    return {r["step"]: r["metrics"]["loss_metrics/global_avg_loss"] for r in records}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(folder / "checkpoint" / f"step-{STEPS}", folder / "weights.pt")
    return torch.load(folder / "weights.pt", weights_only=True)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_resumed_pretraining_continues_bitwise(tmp_path, precision):
    full = _run(tmp_path / "full", precision)
    assert sorted(full) == list(range(1, STEPS + 1))
    mid = Path("checkpoint") / f"step-{MID}"
    shutil.copytree(tmp_path / "full" / mid, tmp_path / "resumed" / mid)
    resumed = _run(tmp_path / "resumed", precision)
    assert resumed == {step: full[step] for step in range(MID + 1, STEPS + 1)}
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "resumed")
    assert a.keys() == b.keys() and len(a) > 10
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ after resuming: {different[:5]}"
