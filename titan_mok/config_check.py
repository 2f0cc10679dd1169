"""Checks a job's configuration before any process-group work.

TorchTitan would fail late (or silently accept) on several mistakes; these
checks name the key and what is allowed. Used by `titan_mok.train` through
`MokConfigManager`.
"""

import dataclasses
import os
import types
import typing
from typing import Any, Literal

import torch

from torchtitan.config import ConfigManager

from titan_mok import registry


class ConfigError(ValueError):
    pass


def _type_name(annotation) -> str:
    return getattr(annotation, "__name__", str(annotation))


def _value_matches(value, annotation) -> bool:
    origin = typing.get_origin(annotation)
    if annotation is typing.Any:
        return True
    if origin is Literal:
        return value in typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_value_matches(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin in (list, tuple):
        (item,) = typing.get_args(annotation)[:1] or (typing.Any,)
        return isinstance(value, (list, tuple)) and all(_value_matches(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True  # an annotation we do not model: leave it to TorchTitan


def _allowed_text(annotation) -> str:
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    return f"a value of type {_type_name(annotation)}"


# (section, key) -> what replaced it
RETIRED_KEYS = {
    ("mok", "mxfp8_weight_cache"): "precision = 'mxfp8' always quantizes each routed-expert weight once per "
                                   "optimizer step (kernels/weight_cache.py)",
}


def check_toml(config_cls, toml: dict[str, Any]) -> None:
    """Unknown sections, unknown keys and wrongly typed values in a TOML dict."""
    sections = {f.name: f for f in dataclasses.fields(config_cls)}
    for section, table in toml.items():
        if section not in sections:
            raise ConfigError(f"unknown section [{section}]; known sections: {', '.join(sorted(sections))}")
        section_cls = sections[section].type
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table, got {table!r}")
        hints = typing.get_type_hints(section_cls)
        for key, value in table.items():
            if (section, key) in RETIRED_KEYS:
                raise ConfigError(f"[{section}] {key} is retired: {RETIRED_KEYS[section, key]}; remove the key")
            if key not in hints:
                raise ConfigError(f"[{section}] unknown key {key!r}; known keys: {', '.join(sorted(hints))}")
            if not _value_matches(value, hints[key]):
                raise ConfigError(f"[{section}] {key} = {value!r}: expected {_allowed_text(hints[key])}")


def check_job(job_config, world_size: int) -> None:
    """Model, flavor, parallel degrees and [mok] values."""
    name, flavor = job_config.model.name, job_config.model.flavor
    if name not in (*registry.MODELS, registry.BASELINE_MODEL):
        raise ConfigError(f"[model] name = {name!r}: choose one of {[*registry.MODELS, registry.BASELINE_MODEL]}")
    flavors = registry.flavors(name)
    if flavor not in flavors:
        raise ConfigError(f"[model] flavor = {flavor!r} for {name}: choose one of {list(flavors)}")

    par = job_config.parallelism
    unsupported = {
        "tensor_parallel_degree": par.tensor_parallel_degree,
        "context_parallel_degree": par.context_parallel_degree,
        "pipeline_parallel_degree": par.pipeline_parallel_degree,
        "expert_tensor_parallel_degree": par.expert_tensor_parallel_degree,
    }
    for key, degree in unsupported.items():
        if degree > 1:
            raise ConfigError(f"[parallelism] {key} = {degree}: titan-mok's models support FSDP/HSDP and EP only; set it to 1")
    ep = par.expert_parallel_degree
    if ep < 1:
        raise ConfigError(f"[parallelism] expert_parallel_degree = {ep}: must be >= 1")
    if world_size % ep:
        raise ConfigError(f"[parallelism] expert_parallel_degree = {ep} does not divide the world size {world_size}")
    num_experts = flavors[flavor].moe_args.num_experts
    if num_experts % ep:
        raise ConfigError(
            f"[parallelism] expert_parallel_degree = {ep} does not divide {name} {flavor}'s {num_experts} experts"
        )
    ac = job_config.activation_checkpoint
    if ep > 1 and ac.mode == "selective" and ac.selective_ac_option == "op":
        # torch bug: op-level SAC with EP>1 fails (`_record_function_enter_new ... not found in storage`).
        raise ConfigError(
            "[activation_checkpoint] mode = 'selective' with selective_ac_option = 'op' fails with "
            "expert_parallel_degree > 1; use mode = 'full', 'none', or a layer-count selective_ac_option"
        )
    _check_fault_keys(job_config, world_size)
    if name == registry.BASELINE_MODEL:
        return  # TorchTitan's own model: the [mok] section does not apply to it
    kernels = job_config.mok.kernels
    if kernels in ("triton", "megakernel") and not torch.cuda.is_available():
        raise ConfigError(f"[mok] kernels = {kernels!r} needs a CUDA GPU; use 'reference' or 'auto' on CPU")


def _check_fault_keys(job_config, world_size: int) -> None:
    """[checkpoint], [comm] and [debug] keys of docs/faults.md."""
    ckpt = job_config.checkpoint
    if ckpt.last_save_in_hf and not ckpt.last_save_model_only:
        raise ConfigError("[checkpoint] last_save_in_hf = true saves the model only: set last_save_model_only = true "
                          "(titan-mok's default is false, so that the last checkpoint can be continued)")
    for key in ("init_timeout_seconds", "train_timeout_seconds"):
        if getattr(job_config.comm, key) <= 0:
            raise ConfigError(f"[comm] {key} = {getattr(job_config.comm, key)}: must be > 0 (the bound on how long a "
                              "rank waits in a collective for a dead or hung peer)")
    debug = job_config.debug
    if debug.fault_nonfinite_step < 0:
        raise ConfigError(f"[debug] fault_nonfinite_step = {debug.fault_nonfinite_step}: must be >= 0 (0: no injection)")
    if debug.fault_nonfinite_step and not 0 <= debug.fault_nonfinite_rank < world_size:
        raise ConfigError(f"[debug] fault_nonfinite_rank = {debug.fault_nonfinite_rank}: must be in [0, {world_size})")


class MokConfigManager(ConfigManager):
    """TorchTitan's ConfigManager, with titan-mok's checks run first."""

    def _maybe_add_custom_config(self, args, toml_values):
        # The one place TorchTitan holds both the merged config class and the TOML dict.
        config_cls = super()._maybe_add_custom_config(args, toml_values)
        if toml_values is not None:
            check_toml(config_cls, toml_values)
        return config_cls

    def parse_args(self, args: list[str]):
        config = super().parse_args(args)
        check_job(config, int(os.environ.get("WORLD_SIZE", "1")))
        return config
