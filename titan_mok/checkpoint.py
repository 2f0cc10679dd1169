"""titan-mok's checkpointer: TorchTitan's DCP ``CheckpointManager`` (``[checkpoint]``), with
the guarantees of docs/faults.md.

Resume: with ``[checkpoint] enable``, a start with the same config loads the newest complete
``step-N`` folder (TorchTitan's behaviour; ``titan_mok.checkpoint_files`` says what complete
means). Before that, folders a killed save left incomplete are moved to ``incomplete/`` with
a warning, and the chosen folder is checked: its files against the manifest its save wrote
(sizes, CRC-32) and against DCP's own metadata (every file it reads exists and is long
enough), and its contents against what continuing needs (a model-only last checkpoint cannot
be continued). Any problem stops the start on every rank with an error naming the file: never
a silent start from an older checkpoint or from scratch.

Save: before any file is written, every rank checks that the model weights are finite, that
the folder is writable and that it has room for the checkpoint (estimated from the model and
optimizer tensors of every rank); a failure stops the run on every rank, naming the folder
and the step, and leaves the last complete checkpoint the newest one. After a synchronous save
the ranks checksum the files (each its share) and rank 0 writes the manifest. Asynchronous
saves (``async_mode``) get no manifest; their loads are checked against DCP's metadata only.

Hugging Face loads (``initial_load_in_hf``): the safetensors keys and shapes are compared with
the model's first; a missing, extra or wrongly shaped key stops the load, naming the key and
both shapes (DCP alone ignores extra keys).
"""

import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpoint import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    TRAIN_STATE,
    AsyncMode,
    CheckpointManager,
)
from torchtitan.tools.logging import logger

from titan_mok import checkpoint_files as files
from titan_mok.kernels import weight_cache

SPACE_MARGIN = 1.05
"""Room a save needs, as a multiple of its estimated bytes."""
ITEM_BYTES = 4096
"""Estimated bytes a save adds per tensor beyond its data: DCP writes a pickled header of ~1.5 KiB
with each tensor and ~0.3 KiB of ``.metadata`` (measured on the debug flavors)."""
_LISTED = 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked; raised alike on every rank."""


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (a list in rank order); just ``[obj]`` without a process group."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _listed(lines: list[str]) -> str:
    more = f"\n  ... and {len(lines) - _LISTED} more" if len(lines) > _LISTED else ""
    return "".join(f"\n  {line}" for line in lines[:_LISTED]) + more


def first_nonfinite_parameter(model_parts) -> str | None:
    """Name of the first parameter (model order) with a NaN/Inf in this rank's shard, or None."""
    named = [(name, _local(p)) for part in model_parts for name, p in part.named_parameters()]
    if not named:
        return None
    bad = torch.stack([~torch.isfinite(t.detach()).all() for _, t in named]).cpu()  # NOTE: host sync
    return named[int(bad.nonzero()[0])][0] if bad.any() else None


class MokCheckpointManager(CheckpointManager):
    """TorchTitan's CheckpointManager with the checks of the module docstring. Build it with
    ``replacing(trainer)`` after TorchTitan's Trainer made its own."""

    def __init__(self, *args, checksums: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.checksums = checksums
        self.last_complete: Path | None = None
        """The newest checkpoint known complete (loaded or saved by this run), for messages."""
        if self.enable and self.async_mode != AsyncMode.DISABLED:
            logger.warning(f"[checkpoint] async_mode = {self.async_mode!r}: saves get no manifest (sizes and "
                           "CRC-32); their loads are checked against DCP's metadata only")

    @classmethod
    def replacing(cls, trainer) -> CheckpointManager:
        """This class in place of ``trainer.checkpointer`` (TorchTitan's Trainer builds its own
        CheckpointManager in ``__init__``); the old one is closed. Unchanged when disabled."""
        old = trainer.checkpointer
        if not old.enable:
            return old
        old.close()
        kept = {k: v for k, v in old.states.items() if k not in (MODEL, OPTIMIZER, DATALOADER, LR_SCHEDULER)}
        job_config = trainer.job_config
        return cls(
            dataloader=trainer.dataloader, model_parts=trainer.model_parts, optimizers=trainer.optimizers,
            lr_schedulers=trainer.lr_schedulers, states=kept, checkpoint_config=job_config.checkpoint,
            sd_adapter=old.sd_adapter, base_folder=job_config.job.dump_folder,
            checksums=job_config.checkpoint.checksums,
        )

    # ---- load ----

    def load(self, step: int = -1) -> bool:
        if not self.enable:
            return super().load(step)
        folder = Path(self.folder)
        if folder.is_dir():
            step = self._choose_step(folder, step)
            if step != -1:
                self._check_before_load(Path(self._create_checkpoint_id(step)), training_state=step != 0)
        elif self.initial_load_path and not self.initial_load_in_hf:
            self._check_before_load(Path(self.initial_load_path), training_state=not self.initial_load_model_only)
        loaded = super().load(step)
        weight_cache.weights_written()  # MXFP8 expert weights kept from before the load are stale
        if loaded and folder.is_dir() and step != -1:
            self.last_complete = Path(self._create_checkpoint_id(step))
        return loaded

    def _choose_step(self, folder: Path, step: int) -> int:
        """Move incomplete step folders aside (rank 0); the step to load: ``step``, or the newest
        complete one (-1: none). A damaged folder newer than that stops the start."""
        rank, _ = _rank_world()
        found = files.step_folders(folder)
        states = {s: files.state(path) for s, path in found.items()}
        complete = sorted(s for s, st in states.items() if st == "complete")
        newest = complete[-1] if complete else -1
        for s in sorted(s for s, st in states.items() if st == "incomplete"):
            if rank == 0:
                target = files.move_aside(found[s])
                logger.warning(
                    f"checkpoint {found[s]} is incomplete (no DCP {files.DCP_METADATA}: its save was killed or "
                    f"never finished): moved to {target}; it can be deleted. "
                    + (f"Resuming from step-{newest}." if newest != -1 else "No complete checkpoint is left."))
        damaged = sorted(s for s, st in states.items() if st == "damaged")
        if step == -1 and damaged and damaged[-1] > newest:
            path = found[damaged[-1]]
            raise CheckpointError(
                f"checkpoint {path} is damaged: its save finished (it has {files.MANIFEST}) but DCP's "
                f"{files.DCP_METADATA} is gone. Restore the file, or move {path} aside to resume from "
                + (f"step-{newest}." if newest != -1 else "scratch."))
        return newest if step == -1 else step

    def _check_before_load(self, path: Path, training_state: bool) -> None:
        """Every rank checks its share of the manifest's files, rank 0 DCP's metadata; each rank
        raises the same CheckpointError on any problem."""
        rank, world = _rank_world()
        problems, saved = [], None
        try:
            manifest = files.read_manifest(path)
        except ValueError as e:
            manifest, problems = None, [str(e)]
        if manifest is not None:
            share = dict(sorted(manifest["files"].items())[rank::world])
            problems += files.check_against_manifest(path, share, self.checksums)
        elif rank == 0 and not problems:
            logger.info(f"checkpoint {path} has no {files.MANIFEST} (an asynchronous save, another writer, or a kill "
                        "right after DCP finished): checked against DCP's metadata only")
        if rank == 0 and (path / files.DCP_METADATA).is_file():
            try:
                metadata = files.read_dcp_metadata(path)
                problems += files.check_against_dcp_metadata(path, metadata)
                saved = sorted(files.saved_states(metadata))
            except ValueError as e:
                problems.append(str(e))
        gathered = gather_objects((problems, saved))
        by_file: dict[str, str] = {}  # one problem per file (a truncated file fails both checks)
        for rank_problems, _ in gathered:
            for problem in rank_problems:
                by_file.setdefault(problem.split(": ", 1)[0], problem)
        problems = sorted(by_file.values())
        if problems:
            raise CheckpointError(
                f"checkpoint {path} is damaged and was not loaded:{_listed(problems)}\n"
                f"Restore these files, or move {path} aside to resume from the previous complete checkpoint.")
        saved = gathered[0][1]
        if training_state and saved is not None:
            self._check_training_state(path, set(saved))

    def _check_training_state(self, path: Path, saved: set[str]) -> None:
        needed = {TRAIN_STATE, OPTIMIZER, LR_SCHEDULER, DATALOADER} & set(self.states) - set(self.exclude_from_loading)
        if self.enable_ft_dataloader_checkpoints:
            needed.discard(DATALOADER)
        missing = sorted(needed - saved)
        if not missing:
            return
        if set(missing) == needed:
            this = files.step_of(path)
            older = sorted(s for s, p in files.step_folders(path.parent).items()
                           if this is not None and s < this and files.state(p) == "complete")
            previous = f" (step-{older[-1]})" if older else ""
            raise CheckpointError(
                f"checkpoint {path} holds the model weights only (a last step saved with [checkpoint] "
                f"last_save_model_only = true), not the optimizer, LR schedule, data position and step that "
                f"continuing needs. To continue from the previous full checkpoint{previous}, move {path} aside; to "
                f"start a new run from these weights, set [checkpoint] initial_load_path = '{path}' (with "
                f"initial_load_model_only = true) and a new [checkpoint] folder. Runs saved with "
                f"last_save_model_only = false (titan-mok's default) continue from their last step.")
        raise CheckpointError(
            f"checkpoint {path} lacks the states {missing} that this run loads (it was saved by a run with "
            f"another config): list them in [checkpoint] exclude_from_loading to load the rest")

    def dcp_load(self, state_dict, checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf and not from_quantized:
            self._check_hf_keys(state_dict, checkpoint_id)
        try:
            super().dcp_load(state_dict, checkpoint_id=checkpoint_id, from_hf=from_hf, from_quantized=from_quantized)
        except Exception as e:
            raise CheckpointError(f"loading checkpoint {checkpoint_id} failed: {type(e).__name__}: {e}") from e

    def _check_hf_keys(self, state_dict, checkpoint_id: str) -> None:
        """The HF checkpoint's keys and shapes against the model's (every rank's experts)."""
        expected: dict[str, tuple] = {}
        for part in gather_objects({k: tuple(v.shape) for k, v in self.sd_adapter.to_hf(state_dict).items()}):
            expected.update(part)
        metadata = self.sd_adapter.get_hf_storage_reader(checkpoint_id, False).read_metadata()
        found = {k: tuple(getattr(v, "size", ())) for k, v in metadata.state_dict_metadata.items()}
        ignored = tuple(getattr(self.sd_adapter, "ignored_hf_keys", ()))
        ours = {_namespace(k) for k in expected}
        problems = [f"missing key {k!r} (the model's shape {list(expected[k])})" for k in sorted(expected) if k not in found]
        problems += [f"key {k!r}: the model's shape {list(expected[k])}, the checkpoint's {list(found[k])}"
                     for k in sorted(expected) if k in found and found[k] != expected[k]]
        extra = [k for k in sorted(found) if k not in expected and not k.endswith(tuple("." + i for i in ignored))]
        problems += [f"extra key {k!r} (shape {list(found[k])}) that the model does not have"
                     for k in extra if _namespace(k) in ours]
        foreign = sorted({_namespace(k) for k in extra if _namespace(k) not in ours})
        if foreign:
            logger.info(f"HF checkpoint {checkpoint_id}: parts the model does not hold, not loaded: {foreign}")
        if problems:
            raise CheckpointError(f"HF checkpoint {checkpoint_id} does not match the model:{_listed(problems)}")

    # ---- save ----

    def save(self, curr_step: int, last_step: bool = False) -> None:
        if not self._should_save(curr_step, last_step):
            return super().save(curr_step, last_step)
        path = Path(self._create_checkpoint_id(curr_step))
        model_only = last_step and self.last_save_model_only
        self._check_before_save(curr_step, path, model_only)
        if _rank_world()[0] == 0:
            # an older save of this step is rewritten in place: not complete until this save ends
            for marker in (files.MANIFEST, files.DCP_METADATA, files.HF_INDEX):
                (path / marker).unlink(missing_ok=True)
        super().save(curr_step, last_step)
        if last_step or self.async_mode == AsyncMode.DISABLED:  # TorchTitan saves the last step synchronously
            self._write_manifest(curr_step, path, model_only)
            self.last_complete = path

    def _check_before_save(self, step: int, path: Path, model_only: bool) -> None:
        """Finite weights, a writable folder, room for the checkpoint: checked on every rank, the
        verdict gathered, the same CheckpointError raised everywhere before anything is written."""
        rank, _ = _rank_world()
        nonfinite = first_nonfinite_parameter(self.states[MODEL].model)
        folder, write_error, free, reclaimed = Path(self.folder), None, 0, 0
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".mok_write_probe.{rank}"
            probe.write_bytes(b"0")
            probe.unlink()
            free = shutil.disk_usage(folder).free
            reclaimed = sum((path / n).stat().st_size for n in files.files(path)) if path.is_dir() else 0
        except OSError as e:
            write_error = f"{type(e).__name__}: {e}"
        verdicts = gather_objects((nonfinite, write_error, self._state_bytes(model_only), free, reclaimed))
        where = f"cannot save checkpoint step-{step} ({path})"
        keep = (f"The run stops before writing it; the newest checkpoint is still "
                f"{self.last_complete or 'none (none was saved)'}.")
        bad = [(r, v[0]) for r, v in enumerate(verdicts) if v[0] is not None]
        if bad:
            raise CheckpointError(f"{where}: the model weights are not finite (rank {bad[0][0]}: first in "
                                  f"{bad[0][1]!r}), a checkpoint of them would shadow the last good one. {keep}")
        bad = [(r, v[1]) for r, v in enumerate(verdicts) if v[1] is not None]
        if bad:
            raise CheckpointError(f"{where}: the folder {folder} is not writable (rank {bad[0][0]}: {bad[0][1]}). {keep}")
        needed = math.ceil(sum(v[2] for v in verdicts) * SPACE_MARGIN) - max(v[4] for v in verdicts)
        free = min(v[3] for v in verdicts)
        if free < needed:
            raise CheckpointError(f"{where}: {folder} has {_mib(free)} free, the checkpoint needs about "
                                  f"{_mib(needed)} (estimated from its tensors on every rank). {keep}")

    def _state_bytes(self, model_only: bool) -> int:
        """Estimated bytes of this rank's share of a save: its tensors (model, and optimizer state
        unless model only; at the last model-only save, in ``export_dtype``), ITEM_BYTES each more."""
        total = 0
        for part in self.states[MODEL].model:
            for value in part.state_dict().values():
                if torch.is_tensor(value):
                    local = _local(value)
                    itemsize = local.element_size()
                    if model_only and self.export_dtype != torch.float32:
                        itemsize = self.export_dtype.itemsize
                    total += local.numel() * itemsize + ITEM_BYTES
        if not model_only:
            for optimizer in self.states[OPTIMIZER].optimizers:
                for per_param in optimizer.state.values():
                    total += sum(_local(v).numel() * v.element_size() + ITEM_BYTES
                                 for v in per_param.values() if torch.is_tensor(v))
        return total

    def _write_manifest(self, step: int, path: Path, model_only: bool) -> None:
        """Each rank sizes and checksums its share of the folder's files; rank 0 writes the manifest."""
        rank, world = _rank_world()
        share = files.files(path)[rank::world]
        described = {}
        for part in gather_objects(files.describe(path, share, self.checksums)):
            described.update(part)
        if rank == 0:
            files.write_manifest(path, step, model_only, described)


def _namespace(key: str) -> str:
    """A key's dotted prefix before its first numeric part (else without its last part):
    ``model.layers.3.mlp...`` → ``model.layers``; ``lm_head.weight`` → ``lm_head``."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i])
    return ".".join(parts[:-1]) or key
