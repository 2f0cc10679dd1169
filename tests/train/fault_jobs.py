"""A `titan_mok.train` job under a real `torchrun` that a test can watch, signal and kill
(tests/train/test_faults_*.py): its output in a log file, its workers found by their RANK in /proc
(torchrun starts each worker in a session of its own: signalling torchrun's process group
alone leaves them running)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.torchrun import REPO

CONFIG = "train_configs/kimi_k2_7_code/debug.toml"
_STEP = re.compile(r"step:\s*(\d+)\s+loss:")


class Job:
    def __init__(self, log: Path, *overrides: str, config: str = CONFIG, nproc: int = 2, prefix: tuple = ()):
        self.log_path, self.nproc, self._workers = log, nproc, {}
        cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
               "-m", "titan_mok.train", "--config", config, "--metrics.disable_color_printing", *overrides]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self._log = open(log, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def steps_logged(self) -> int:
        """The highest step any rank logged so far (0: none)."""
        return max((int(s) for s in _STEP.findall(self.output())), default=0)

    def wait_until(self, condition, timeout: float, what: str, poll: float = 0.05) -> None:
        end = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(f"the job exited ({self.proc.returncode}) before {what}:\n{self.output()[-4000:]}")
            if time.monotonic() > end:
                self.kill()
                raise AssertionError(f"no {what} within {timeout} s:\n{self.output()[-4000:]}")
            time.sleep(poll)

    def workers(self) -> dict[int, int]:
        """Global rank → pid of torchrun's worker processes (kept once all are found)."""
        if len(self._workers) == self.nproc:
            return self._workers
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) != self.proc.pid:
                    continue
                env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for var in env:
                if var.startswith(b"RANK="):
                    found[int(var[5:])] = int(entry)
        self._workers = found
        return found

    def signal_job(self, sig: int) -> None:
        """Signal every worker (torchrun starts each in its own session) and then torchrun."""
        for pid in self.workers().values():
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.signal_job(signal.SIGKILL)
            self.proc.wait()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()
            self._log.close()


def exited(pid: int) -> bool:
    """Whether a process is gone or a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def run(log: Path, *overrides: str, timeout: float = 300, **kwargs) -> tuple[int, str]:
    """Run a job to its end: (exit status, output). Prints its wall time (pytest -s)."""
    job = Job(log, *overrides, **kwargs)
    rc = job.wait(timeout)
    print(f"\n{log.parent.name}/{log.name}: exit status {rc} after {time.monotonic() - job.started:.1f} s")
    return rc, job.output()


def losses(dump_folder: Path) -> dict[int, float]:
    """Step → full-precision loss from the newest run's metrics.jsonl in ``dump_folder``."""
    (jsonl,) = sorted(dump_folder.glob("tb/*/metrics.jsonl"))[-1:]
    records = [json.loads(line) for line in jsonl.read_text().splitlines()[1:]]
    return {r["step"]: r["metrics"]["loss_metrics/global_avg_loss"] for r in records}


def checkpoint_args(folder: Path, steps: int, interval: int, *extra: str) -> tuple[str, ...]:
    return ("--training.steps", str(steps), "--metrics.log_freq", "1", "--job.dump_folder", str(folder),
            "--checkpoint.enable", "--checkpoint.interval", str(interval), *extra)
