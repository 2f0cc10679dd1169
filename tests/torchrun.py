"""Runs titan_mok entries under a real multi-process `torchrun` (gloo on CPU)."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_STEP_LOSS = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naninf]+)")


def run(module: str, config: str, *overrides: str, nproc: int = 2, timeout: int = 300, check: bool = True):
    """`torchrun --nproc_per_node nproc -m module --config config overrides...` from the repo root."""
    return run_module(module, "--config", config, "--metrics.disable_color_printing", *overrides,
                      nproc=nproc, timeout=timeout, check=check)


def run_module(module: str, *args: str, nproc: int = 2, timeout: int = 300, check: bool = True):
    """`torchrun --nproc_per_node nproc -m module args...` from the repo root: (exit status, output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
           "-m", module, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-6000:]}")
    return proc.returncode, output


def losses(output: str) -> dict[int, float]:
    """Step → loss as logged by TorchTitan. Every rank logs the (all-reduced) loss: they must agree."""
    by_step: dict[int, set[str]] = {}
    for step, loss in _STEP_LOSS.findall(output):
        by_step.setdefault(int(step), set()).add(loss)
    disagreeing = {step: values for step, values in by_step.items() if len(values) > 1}
    if disagreeing:
        raise AssertionError(f"ranks logged different losses: {disagreeing}")
    return {step: float(values.pop()) for step, values in by_step.items()}
