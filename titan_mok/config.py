"""titan-mok's TOML sections, merged into TorchTitan's JobConfig.

TorchTitan imports this module through ``[job] custom_config_module =
"titan_mok.config"`` and merges the ``JobConfig`` below into its own: every
field is a TOML key and a ``--section.key`` command-line override.
"""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Mok:
    backend: Literal["mok", "torchtitan"] = "mok"
    """Expert-parallel strategy of the MoE layers. "mok": titan-mok's
    dispatch → experts → combine (deterministic, dropless). "torchtitan":
    TorchTitan 0.2.2's all-to-all ExpertParallel + grouped GEMM, the baseline."""

    precision: Literal["bf16", "mxfp8"] = "bf16"
    """Routed-expert GEMM precision. The shared expert is always BF16."""

    kernels: Literal["auto", "reference", "triton"] = "auto"
    """Implementation of the mok backend. "reference": pure PyTorch, runs
    anywhere. "triton": Hopper kernels (needs a CUDA GPU). "auto": triton on a
    CUDA GPU with compute capability 9.0, reference otherwise."""

    def __post_init__(self):
        _check_choice("mok.backend", self.backend, ("mok", "torchtitan"))
        _check_choice("mok.precision", self.precision, ("bf16", "mxfp8"))
        _check_choice("mok.kernels", self.kernels, ("auto", "reference", "triton"))


def _check_choice(key: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"[{key.split('.')[0]}] {key.split('.')[1]} = {value!r} is not allowed; choose one of {list(allowed)}")


@dataclass
class JobConfig:
    mok: Mok = field(default_factory=Mok)
