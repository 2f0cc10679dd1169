"""The checkpoint folder of an EP=2 `titan_mok.train` job turns unwritable or fills up during
the run (docs/faults.md): the next save stops the run on every rank with an error naming the
folder and the step, before it writes anything, so the last complete checkpoint stays the
newest. The faults are real: a private mount namespace (``unshare``) remounts the folder
read-only once step 2 is saved, or holds it on a 16 MiB tmpfs that the first checkpoint
mostly fills. Skipped where unprivileged user and mount namespaces are not allowed."""

import shutil
import subprocess

import pytest

from tests.train import fault_jobs
from tests.train.fault_jobs import checkpoint_args
from titan_mok import checkpoint_files

pytestmark = [pytest.mark.slow, pytest.mark.serial]


def _namespaces_allowed() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


needs_namespaces = pytest.mark.skipif(not _namespaces_allowed(), reason="unshare -rm (user + mount namespaces) not allowed")


def _assert_stopped_before_step_4(output: str, ckpt, reason: str) -> None:
    for rank in (0, 1):
        assert (f"[rank{rank}]: titan_mok.checkpoint.CheckpointError: cannot save checkpoint step-4 "
                f"({ckpt / 'step-4'}): {reason}") in output
    assert "the newest checkpoint is still" in output and str(ckpt / "step-2") in output


def _step_2_only(ckpt) -> None:
    states = {s: checkpoint_files.state(p) for s, p in checkpoint_files.step_folders(ckpt).items()}
    assert states == {2: "complete"}  # no partial step-4 folder either
    manifest = checkpoint_files.read_manifest(ckpt / "step-2")
    assert checkpoint_files.check_against_manifest(ckpt / "step-2", manifest["files"], checksums=True) == []


@needs_namespaces
def test_folder_turned_read_only_stops_before_the_next_save(tmp_path):
    folder = tmp_path / "run"
    ckpt = folder / "checkpoint"
    ckpt.mkdir(parents=True)
    script = (f'mount --bind "{ckpt}" "{ckpt}" && "$@" & pid=$!\n'
              f'while [ ! -f "{ckpt}/step-2/{checkpoint_files.MANIFEST}" ] && kill -0 $pid; do sleep 0.02; done\n'
              f'mount -o remount,ro,bind "{ckpt}"\n'
              'wait $pid')
    rc, output = fault_jobs.run(tmp_path / "log", *checkpoint_args(folder, 8, 2),
                                prefix=("unshare", "-rm", "sh", "-c", script, "sh"))
    assert rc != 0
    _assert_stopped_before_step_4(output, ckpt, f"the folder {ckpt} is not writable (rank 0: OSError: [Errno 30] "
                                                "Read-only file system")
    _step_2_only(ckpt)


@needs_namespaces
def test_full_folder_stops_before_the_next_save(tmp_path):
    folder, small = tmp_path / "run", tmp_path / "small"
    small.mkdir()
    ckpt, kept = small / "checkpoint", tmp_path / "kept"
    # the tmpfs lives as long as the namespace: its checkpoints are copied out at the end
    script = (f'mount -t tmpfs -o size=16m tmpfs "{small}" && "$@"; rc=$?\n'
              f'cp -a "{ckpt}" "{kept}"; exit $rc')
    rc, output = fault_jobs.run(tmp_path / "log", *checkpoint_args(folder, 8, 2, "--checkpoint.folder", str(ckpt)),
                                prefix=("unshare", "-rm", "sh", "-c", script, "sh"))
    assert rc != 0
    _assert_stopped_before_step_4(output, ckpt, f"{ckpt} has ")
    assert "MiB free, the checkpoint needs about" in output
    _step_2_only(kept)
