"""What a checkpoint folder on disk holds: which ``step-N`` folders are complete, and
whether a folder's files are the ones its save wrote. No process group here: every
function reads or writes files only (``titan_mok.checkpoint`` spreads the work over the
ranks and gathers the verdicts).

A ``step-N`` folder (TorchTitan's layout, ``<dump_folder>/<checkpoint.folder>/step-N``) is
- complete: DCP's ``.metadata`` is there (or, for a Hugging Face save,
  ``model.safetensors.index.json``). DCP's coordinator writes ``.metadata`` last, to a
  temporary name then renamed, after every rank has reported its files written: a save
  killed earlier leaves none. TorchTitan picks the latest checkpoint by the same rule.
- damaged: no ``.metadata`` but a manifest (below), which is written only after a save
  finished: something removed or lost a file since. A load stops on it.
- incomplete: neither: a save that was killed, or one that was still running.

The manifest ``step-N/mok_manifest.json``, written after a save, records each file's size
and CRC-32 (JSON: ``{"step", "model_only", "files": {relative path: {"bytes", "crc32"}}}``).
"""

import json
import os
import re
import zlib
from pathlib import Path

MANIFEST = "mok_manifest.json"
INCOMPLETE = "incomplete"
"""Subfolder of the checkpoint folder that incomplete ``step-N`` folders are moved to."""
DCP_METADATA = ".metadata"
HF_INDEX = "model.safetensors.index.json"
_STEP = re.compile(r"step-(\d+)")
_CHUNK = 16 << 20


def step_folders(folder: str | Path) -> dict[int, Path]:
    """step → ``folder/step-N`` for every such subfolder (none if ``folder`` is missing)."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    found = {}
    for entry in folder.iterdir():
        match = _STEP.fullmatch(entry.name)
        if match and entry.is_dir():
            found[int(match.group(1))] = entry
    return found


def step_of(step_folder: Path) -> int | None:
    """N of a ``step-N`` folder, None for another name."""
    match = _STEP.fullmatch(step_folder.name)
    return int(match.group(1)) if match else None


def state(step_folder: Path) -> str:
    """"complete", "damaged" or "incomplete" (module docstring)."""
    if (step_folder / DCP_METADATA).is_file() or (step_folder / HF_INDEX).is_file():
        return "complete"
    return "damaged" if (step_folder / MANIFEST).is_file() else "incomplete"


def move_aside(step_folder: Path) -> Path:
    """Move an incomplete ``step-N`` folder to ``<checkpoint folder>/incomplete/step-N[.k]``."""
    target_dir = step_folder.parent / INCOMPLETE
    target_dir.mkdir(exist_ok=True)
    target, k = target_dir / step_folder.name, 0
    while target.exists():
        k += 1
        target = target_dir / f"{step_folder.name}.{k}"
    step_folder.rename(target)
    return target


def files(step_folder: Path) -> list[str]:
    """Every file under ``step_folder`` but the manifest, as sorted relative paths."""
    names = []
    for root, _, filenames in os.walk(step_folder):
        for name in filenames:
            rel = os.path.relpath(os.path.join(root, name), step_folder)
            if rel != MANIFEST:
                names.append(rel)
    return sorted(names)


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def describe(step_folder: Path, names: list[str], checksums: bool) -> dict[str, dict]:
    """{relative path: {"bytes", "crc32" (None without checksums)}} of ``names``."""
    return {
        name: {"bytes": (step_folder / name).stat().st_size,
               "crc32": crc32(step_folder / name) if checksums else None}
        for name in names
    }


def write_manifest(step_folder: Path, step: int, model_only: bool, described: dict[str, dict]) -> None:
    """Write the manifest atomically (temporary file, fsync, rename)."""
    body = json.dumps({"step": step, "model_only": model_only, "files": dict(sorted(described.items()))}, indent=1)
    tmp = step_folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(step_folder / MANIFEST)


def read_manifest(step_folder: Path) -> dict | None:
    """The manifest, None when there is none; a clear ValueError when it cannot be read."""
    path = step_folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        entries = manifest["files"]
        if not all(isinstance(e, dict) and isinstance(e.get("bytes"), int) for e in entries.values()):
            raise ValueError("an entry lacks its byte count")
        return manifest
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: the manifest cannot be read ({e}): the checkpoint cannot be checked") from e


def check_against_manifest(step_folder: Path, entries: dict[str, dict], checksums: bool) -> list[str]:
    """Problems with ``entries`` (a share of a manifest's files): missing, wrong size, wrong CRC-32."""
    problems = []
    for name, expected in entries.items():
        path = step_folder / name
        if not path.is_file():
            problems.append(f"{path}: missing (the save wrote {expected['bytes']} bytes)")
            continue
        size = path.stat().st_size
        if size != expected["bytes"]:
            problems.append(f"{path}: {size} bytes, the save wrote {expected['bytes']} (truncated or overwritten)")
        elif checksums and expected.get("crc32") is not None and crc32(path) != expected["crc32"]:
            problems.append(f"{path}: CRC-32 {crc32(path):08x}, the save wrote {expected['crc32']:08x} (corrupted)")
    return problems


def read_dcp_metadata(step_folder: Path):
    """DCP's Metadata of a step folder; a clear ValueError naming the file when it cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(step_folder)).read_metadata()
    except Exception as e:  # noqa: BLE001 - unpickling a damaged file raises many types
        raise ValueError(f"{step_folder / DCP_METADATA}: DCP's metadata cannot be read ({type(e).__name__}: {e})") from e


def check_against_dcp_metadata(step_folder: Path, metadata) -> list[str]:
    """Every file DCP's metadata points into exists and is long enough for its last item."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(needed.items()):
        path = step_folder / name
        if not path.is_file():
            problems.append(f"{path}: missing (DCP's metadata reads up to byte {end})")
        elif path.stat().st_size < end:
            problems.append(f"{path}: {path.stat().st_size} bytes, DCP's metadata reads up to byte {end} (truncated)")
    return problems


def saved_states(metadata) -> set[str]:
    """Top-level state names in a DCP checkpoint (``train_state``, ``optimizer``, model FQN roots...)."""
    return {fqn.split(".", 1)[0] for fqn in metadata.state_dict_metadata}
