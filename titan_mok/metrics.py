"""titan-mok's metrics processor: TorchTitan's, plus W&B run settings from TOML,
a JSONL twin of the logged series, MoE statistics and a loss checksum.

Every registered titan-mok TrainSpec builds it (``titan_mok.registry``). On the
logging rank it writes, in ``<dump_folder>/<save_tb_folder>/<YYYYmmdd-HHMMSS>/``
(``-1``, ``-2``, ... appended when a run of the same second took it):

- ``metrics.jsonl`` (``[metrics] enable_jsonl``): a first line
  ``{"config": ..., "run": ...}`` (the run config and W&B run settings), then one
  line ``{"step": N, "metrics": {...}}`` per logged step; Python's float repr, so
  every value reads back bit for bit (non-finite values as NaN/Infinity);
- ``wandb/`` (``[metrics] enable_wandb``): a W&B run, offline unless WANDB_MODE
  says otherwise or WANDB_API_KEY is set, with the same series and, as its
  config, TorchTitan's resolved config with ``[mok]`` plus ``mok_run`` (git SHA,
  device, world size, the MFU peak and where it comes from).

Series added to TorchTitan's (loss, grad norm, ``throughput(tps)`` = tokens/s per
GPU, ``tflops`` = TFLOP/s per GPU, ``mfu(%)``, memory, timings):
``determinism/loss_checksum`` (CRC-32 chained over the float64 bytes of every
logged loss so far: for runs with the same log_freq, different values at step N
mean the loss curves differ by then, equal ones mean bitwise-equal curves up to
CRC-32 collisions), the MoE statistics of ``titan_mok.moe_stats``, the
time shares of ``titan_mok.time_share`` (``moe/time_share``,
``attention/time_share``), and ``attached_loss/<name>`` for every loss attached
beside the cross-entropy (``titan_mok.attached_loss``: ``moe_aux``, ``mtp``,
``indexer_kl``).
"""

import dataclasses
import json
import math
import os
import struct
import subprocess
import time
import zlib
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.metrics import (
    BaseLogger,
    LoggerContainer,
    MetricsProcessor,
    WandBLogger,
    _get_metrics_rank,
)
from torchtitan.tools import utils
from torchtitan.tools.logging import logger

from titan_mok.attached_loss import take_tally
from titan_mok.baseline import BASELINE_MODEL
from titan_mok.moe_stats import MoEStats
from titan_mok.time_share import TimeShare

MEASURED_BF16_PEAKS = {
    "H200": (800e12, "H200 bf16 dense matmul 8192^3, measured 800 TFLOP/s (2026-11-30, docs/performance.md)"),
    "H100 80GB HBM3": (775e12, "H100 SXM bf16 dense matmul 8192^3, measured 775 TFLOP/s (2026-12-05, "
                               "docs/performance.md)"),
}
"""Per-GPU MFU denominators on the project's machines, by a fragment of the device name: the BF16 dense-matmul
ceiling measured there, so that MFU means the same on both (TorchTitan's table gives the 989 TFLOP/s datasheet
figure for both). Other GPUs take TorchTitan's table."""

_WANDB_ENV = {
    "project": ("WANDB_PROJECT",),
    "entity": ("WANDB_ENTITY", "WANDB_TEAM"),
    "name": ("WANDB_NAME", "WANDB_RUN_NAME"),
    "group": ("WANDB_RUN_GROUP",),
    "tags": ("WANDB_TAGS", "WANDB_RUN_TAGS"),
    "notes": ("WANDB_NOTES", "WANDB_RUN_NOTES"),
}
"""W&B run settings → environment variables that override the TOML, first set wins
(W&B's own names, then TorchTitan's)."""


def mfu_peak(job_config, device_type: str, device_name: str) -> tuple[float, str]:
    """(peak FLOP/s per GPU, where it comes from). NaN on CPU: MFU is not meaningful there."""
    configured = job_config.metrics.mfu_peak_tflops
    if configured < 0:
        raise ValueError(f"[metrics] mfu_peak_tflops = {configured}: must be > 0, or 0 to take it from the device")
    if configured > 0:
        return configured * 1e12, "[metrics] mfu_peak_tflops"
    if device_type == "cpu":
        return float("nan"), "CPU run: MFU is not meaningful (logged as NaN)"
    for fragment, (peak, source) in MEASURED_BF16_PEAKS.items():
        if fragment in device_name:
            return peak, source
    return utils.get_peak_flops(device_name), f"torchtitan.tools.utils.get_peak_flops({device_name!r})"


def git_revision() -> dict[str, Any]:
    """SHA and dirtiness of the checkout titan_mok runs from ("unknown" outside git)."""
    repo = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return {"git_sha": "unknown", "git_dirty": None}
    return {"git_sha": sha.stdout.strip(), "git_dirty": bool(status.stdout.strip())}


def wandb_run_settings(job_config, environ=os.environ) -> dict[str, Any]:
    """project/entity/name/group/tags/notes (environment over TOML) and the mode."""
    metrics = job_config.metrics
    par = job_config.parallelism
    # [mok] configures titan-mok's MoE layers only: the baseline (TorchTitan's own model) ignores it
    mok = "" if job_config.model.name == BASELINE_MODEL else f"-{job_config.mok.backend}-{job_config.mok.precision}"
    default_name = (
        f"{job_config.model.name}-{job_config.model.flavor}{mok}"
        f"-ep{par.expert_parallel_degree}-seed{job_config.debug.seed}"
    )
    settings = {
        "project": metrics.wandb_project,
        "entity": metrics.wandb_entity or None,
        "name": metrics.wandb_run_name or default_name,
        "group": metrics.wandb_group or None,
        "tags": list(metrics.wandb_tags),
        "notes": metrics.wandb_notes or None,
    }
    for key, names in _WANDB_ENV.items():
        value = next((environ[n] for n in names if environ.get(n)), None)
        if value is not None:
            settings[key] = [t.strip() for t in value.split(",") if t.strip()] if key == "tags" else value
    settings["mode"] = environ.get("WANDB_MODE") or ("online" if environ.get("WANDB_API_KEY") else "offline")
    return settings


class JsonlLogger(BaseLogger):
    """The logged series as JSON lines (see the module docstring for the format)."""

    def __init__(self, path: Path, header: dict[str, Any]):
        self.file = open(path, "x", encoding="utf-8")
        self._write(header)
        logger.info(f"Metrics JSONL: {path}")

    def _write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._write({"step": step, "metrics": {k: _plain(v) for k, v in metrics.items()}})

    def close(self) -> None:
        self.file.close()


def _plain(value):
    return value.item() if isinstance(value, torch.Tensor) else value


class MokWandBLogger(WandBLogger):
    """TorchTitan's W&B logger (its ``log``/``close``), initialised from our run
    settings instead of TorchTitan's environment-only ones."""

    def __init__(self, log_dir: Path, settings: dict[str, Any], config: dict[str, Any], tag: str | None = None):
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "[metrics] enable_wandb = true needs the wandb package (pip install wandb); or set it to false "
                "(metrics.jsonl is written either way)"
            ) from e

        self.wandb = wandb
        self.tag = tag
        wandb.init(dir=str(log_dir), config=config, **settings)
        logger.info(f"W&B logging ({settings['mode']}): {wandb.run.dir if wandb.run else log_dir}")


class MokMetricsProcessor(MetricsProcessor):
    """TorchTitan's MetricsProcessor with titan-mok's loggers and series."""

    def __init__(self, job_config, parallel_dims, tag: str | None = None):
        # TorchTitan's own W&B logger is replaced by MokWandBLogger below.
        metrics_without_wandb = dataclasses.replace(job_config.metrics, enable_wandb=False)
        super().__init__(dataclasses.replace(job_config, metrics=metrics_without_wandb), parallel_dims, tag)
        self.job_config = job_config
        self.loss_checksum = 0
        device_type = self.device_memory_monitor.device.type
        self.gpu_peak_flops, peak_source = mfu_peak(job_config, device_type, self.device_memory_monitor.device_name)
        logger.info(f"MFU peak: {self.gpu_peak_flops / 1e12:g} TFLOP/s per GPU ({peak_source})")
        self.run_config = {
            **job_config.to_dict(),
            "mok_run": {
                **git_revision(),
                "device": self.device_memory_monitor.device_name,
                "world_size": parallel_dims.world_size,
                "mfu_peak_tflops": self.gpu_peak_flops / 1e12 if math.isfinite(self.gpu_peak_flops) else None,
                "mfu_peak_source": peak_source,
            },
        }
        self.log_dir = None
        if self._this_rank_logs(parallel_dims) and (job_config.metrics.enable_jsonl or job_config.metrics.enable_wandb):
            self._add_loggers(tag)

    def _this_rank_logs(self, parallel_dims) -> bool:
        metrics = self.job_config.metrics
        return metrics.save_for_all_ranks or torch.distributed.get_rank() == _get_metrics_rank(
            parallel_dims, self.job_config
        )

    def _add_loggers(self, tag: str | None) -> None:
        metrics = self.job_config.metrics
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        rank_dir = f"rank_{torch.distributed.get_rank()}" if metrics.save_for_all_ranks else ""
        folder, suffix = Path(self.job_config.job.dump_folder, metrics.save_tb_folder, stamp, rank_dir), 0
        while folder.exists():  # a run started in the same second with the same dump folder
            suffix += 1
            folder = Path(self.job_config.job.dump_folder, metrics.save_tb_folder, f"{stamp}-{suffix}", rank_dir)
        folder.mkdir(parents=True)
        self.log_dir = folder
        if not isinstance(self.logger, LoggerContainer):
            self.logger = LoggerContainer()
        settings = wandb_run_settings(self.job_config)
        if metrics.enable_jsonl:
            self.logger.add_logger(JsonlLogger(folder / "metrics.jsonl", {"config": self.run_config, "run": settings}))
        if metrics.enable_wandb:
            self.logger.add_logger(MokWandBLogger(folder, settings, self.run_config, tag))

    # The Trainer assigns model_parts once the model is built and initialised
    # (torchtitan/train.py), before the first forward: that is when the MoE hooks go in.
    @property
    def model_parts(self):
        return self._model_parts

    @model_parts.setter
    def model_parts(self, parts) -> None:
        self._model_parts = parts
        for hooks in (getattr(self, "moe_stats", None), getattr(self, "time_share", None)):
            if hooks is not None:
                hooks.remove()
        self.moe_stats = self.time_share = None
        if parts and self.job_config.metrics.moe_stats:
            self.moe_stats = MoEStats(parts, self._loss_group())
            self.time_share = TimeShare(parts)

    def _loss_group(self):
        """The ranks whose losses TorchTitan averages (None: this rank alone)."""
        loss_mesh = self.parallel_dims.get_optional_mesh("loss") if self.parallel_dims.dp_cp_enabled else None
        return loss_mesh.get_group() if loss_mesh is not None else None

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float, extra_metrics=None):
        self.loss_checksum = zlib.crc32(struct.pack("<d", float(global_avg_loss)), self.loss_checksum)
        extra = {"determinism/loss_checksum": self.loss_checksum}
        if self.moe_stats is not None:
            extra.update(self.moe_stats.collect())
            extra.update(self.time_share.collect(time.perf_counter() - self.time_last_log))
        extra.update(attached_loss_metrics(self._loss_group()))
        extra.update(extra_metrics or {})
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra)


def attached_loss_metrics(group) -> dict[str, float]:
    """``attached_loss/<name>``: the mean of each attached loss (MoE aux, MTP, DSA indexer;
    unweighted, before its coefficient) over the training forwards of every rank since
    the last log. NOTE: one all-reduce and one host sync; called on logged steps only.
    Every rank attaches the same losses (one model, one sequence length)."""
    tally = sorted(take_tally().items())
    if not tally:
        return {}
    packed = torch.stack([torch.stack([total, total.new_tensor(float(count))]) for _, (total, count) in tally])
    if group is not None:
        torch.distributed.all_reduce(packed, group=group)
    return {f"attached_loss/{name}": total / count for (name, _), (total, count) in zip(tally, packed.tolist())}


def build_mok_metrics_processor(job_config, parallel_dims, model_args=None, tag: str | None = None):
    """TrainSpec.build_metrics_processor_fn of every titan-mok model."""
    return MokMetricsProcessor(job_config, parallel_dims, tag)
