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

    kernels: Literal["auto", "reference", "triton", "megakernel"] = "auto"
    """Implementation of the mok backend. "reference": pure PyTorch, runs
    anywhere. "triton": the symmetric-memory dispatch/combine kernels plus the
    Triton expert FFN (Hopper, needs a CUDA GPU; no host sync). "megakernel": the
    routed experts' forward as one persistent launch per rank (the MoK megakernel; under
    EP its peers through the same symmetric memory as "triton"); its backward (bf16
    and mxfp8) through the megakernel's dgrad launch per rank (gradients bitwise
    "triton"'s); Hopper, any expert_parallel_degree.
    "auto": the fastest measured path for the device: "triton" on SM90+ GPUs; the
    reference dispatch/combine with the Triton expert FFN there when the model sets
    a receive-buffer capacity (MoEArgs.max_rows_per_rank) and in RL rollouts (token
    counts differ between calls and ranks); pure PyTorch elsewhere. Wherever the
    routed experts run the Triton FFN, a BF16 shared expert runs it too (as one
    expert holding every token)."""


    def __post_init__(self):
        _check_choice("mok.backend", self.backend, ("mok", "torchtitan"))
        _check_choice("mok.precision", self.precision, ("bf16", "mxfp8"))
        _check_choice("mok.kernels", self.kernels, ("auto", "reference", "triton", "megakernel"))


@dataclass
class Rl:
    """``python -m titan_mok.rl``: GRPO on the embedded verifiable tasks (titan_mok/rl/).
    The run seed is ``[debug] seed``; ``[training] seq_len`` is the rollout's KV-cache
    length and the trainer's sequence length (prompt + completion must fit)."""

    prompts_per_rank: int = 4
    """Prompts each data-parallel rank draws per step."""

    group_size: int = 4
    """Samples per prompt; advantages are relative to the prompt's group (>= 2)."""

    max_new_tokens: int = 20
    """Completion budget per sample (a newline or EOS stops it earlier)."""

    temperature: float = 1.0
    """Sampling temperature (> 0); logprobs are of softmax(logits / temperature)."""

    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables the cut."""

    clip_eps: float = 0.2
    """PPO/GRPO ratio clip: the ratio is clipped to [1 - clip_eps, 1 + clip_eps]."""

    updates_per_rollout: int = 1
    """Optimizer steps on each rollout batch (ratios move off 1 after the first)."""

    kl_coef: float = 0.0
    """Weight of the per-token KL penalty (k3 estimator) to the reference policy: the
    weights the run started from (init or [checkpoint] initial load), kept in the
    checkpoint. 0: no penalty and no reference copy."""

    parity: Literal["warn", "fail"] = "fail"
    """When the trainer's recomputed logprobs differ from the rollout's (the
    logged logprob_max_abs_diff is not 0): log a warning, or stop the run."""

    def __post_init__(self):
        for key in ("prompts_per_rank", "max_new_tokens", "updates_per_rollout"):
            if getattr(self, key) < 1:
                raise ValueError(f"[rl] {key} = {getattr(self, key)} must be >= 1")
        if self.group_size < 2:
            raise ValueError(f"[rl] group_size = {self.group_size} must be >= 2 (advantages compare samples of a prompt)")
        if not self.temperature > 0:
            raise ValueError(f"[rl] temperature = {self.temperature} must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"[rl] top_p = {self.top_p} must be in (0, 1]")
        if not self.clip_eps > 0:
            raise ValueError(f"[rl] clip_eps = {self.clip_eps} must be > 0")
        if not self.kl_coef >= 0:
            raise ValueError(f"[rl] kl_coef = {self.kl_coef} must be >= 0")
        _check_choice("rl.parity", self.parity, ("warn", "fail"))


def apply_mok_section(moe_args, job_config) -> None:
    """Copy the ``[mok]`` section (backend, precision, kernels) into a model's MoEArgs
    (called from each model's ``update_from_config``)."""
    mok = getattr(job_config, "mok", None)
    if mok is None:
        raise ValueError('the [mok] section is missing: set [job] custom_config_module = "titan_mok.config"')
    moe_args.backend, moe_args.precision, moe_args.kernels = mok.backend, mok.precision, mok.kernels


def _check_choice(key: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"[{key.split('.')[0]}] {key.split('.')[1]} = {value!r} is not allowed; choose one of {list(allowed)}")


@dataclass
class Metrics:
    """titan-mok's keys in TorchTitan's ``[metrics]`` table (merged into its
    Metrics; read by ``titan_mok.metrics``). The W&B run settings below yield to
    the environment: WANDB_PROJECT, WANDB_ENTITY (or WANDB_TEAM), WANDB_NAME
    (or WANDB_RUN_NAME), WANDB_RUN_GROUP, WANDB_TAGS (or WANDB_RUN_TAGS,
    comma-separated), WANDB_NOTES (or WANDB_RUN_NOTES)."""

    enable_jsonl: bool = True
    """Write every logged step, full float precision, to ``metrics.jsonl`` in the
    run's log folder ``<dump_folder>/<save_tb_folder>/<YYYYmmdd-HHMMSS>/`` (beside
    W&B's ``wandb/`` folder when enable_wandb)."""

    wandb_project: str = "titan-mok"
    """W&B project."""

    wandb_entity: str = ""
    """W&B entity (team or user); empty: the account's default."""

    wandb_run_name: str = ""
    """W&B run name; empty: ``<model>-<flavor>-<backend>-<precision>-ep<N>-seed<S>``."""

    wandb_group: str = ""
    """W&B run group (e.g. one comparison); empty: none."""

    wandb_tags: list[str] = field(default_factory=list)
    """W&B run tags (on the command line: comma-separated)."""

    wandb_notes: str = ""
    """W&B run notes."""

    mfu_peak_tflops: float = 0.0
    """Per-GPU peak TFLOP/s that MFU divides by; 0: from the device (H200: the
    measured BF16 dense-matmul ceiling, 800; other GPUs: TorchTitan's table).
    MFU is not reported on CPU (logged as NaN). The value used is in the run config."""

    moe_stats: bool = True
    """Log per-MoE-layer expert load, router entropy, aux loss, bias norm, tokens
    dropped (forward hooks on titan-mok's MoE modules) and the step's time shares
    of the MoE layers and the attention (``moe/time_share``, ``attention/time_share``:
    hooks on those modules, titan-mok's or TorchTitan's; a share is not logged when
    its modules run inside a compiled module)."""


@dataclass
class Checkpoint:
    """titan-mok's keys in TorchTitan's ``[checkpoint]`` table (merged into its Checkpoint;
    read by ``titan_mok.checkpoint``). With ``enable``, a start with the same config resumes
    from the last complete ``step-N`` folder (docs/faults.md): folders a killed save left
    without DCP's ``.metadata`` are moved to ``<folder>/incomplete/`` with a warning, and
    every save is checked first (weights finite, folder writable, room for it) and
    recorded after (``step-N/mok_manifest.json``: each file's size and CRC-32)."""

    last_save_model_only: bool = False
    """TorchTitan's key, with titan-mok's default: false, so that the last step's checkpoint
    holds the full training state and the same config with a larger ``[training] steps``
    continues from it. true: the last step saves the model only (in ``export_dtype``); a start
    that finds such a checkpoint as its latest stops with a message saying what to do."""

    checksums: bool = True
    """Record each checkpoint file's CRC-32 in its manifest after a save and check them before
    a load (each rank reads its share of the files once at save and once at load). false:
    sizes only (a truncated file is still caught, a corrupted one is not)."""


@dataclass
class Training:
    """titan-mok's key in TorchTitan's ``[training]`` table (``titan_mok.faults``; pretraining,
    ``titan_mok.train``: the RL trainer does not check its steps)."""

    nonfinite: Literal["stop", "skip", "ignore"] = "stop"
    """What a step with a NaN/Inf loss or gradient does, checked before its optimizer update
    (one pass over the local gradients, an all-reduce of one flag and a host sync per step).
    "stop": raise, naming the step and the first module whose forward output was non-finite
    (the step's forward is re-run under hooks to find it); no update, so no checkpoint holds
    non-finite weights. "skip": log the same and drop the step's gradients (weights, optimizer
    state and MoE load-balancing biases unchanged; the data and LR schedule move on). "ignore":
    no check (TorchTitan's behaviour). Non-finite MoE router logits stop the run in every mode where
    the MoE layer checks them on the host: on the reference schedule ([mok] kernels "reference", and
    "auto" off Hopper); the host-sync-free paths ("triton", "megakernel", "auto" on Hopper) leave
    them to this check."""


@dataclass
class Debug:
    """titan-mok's fault-injection keys in TorchTitan's ``[debug]`` table, for the tests of
    docs/faults.md: a real NaN through the real forward and backward, not a mock."""

    fault_nonfinite_step: int = 0
    """At this step, the first microbatch's output of ``fault_nonfinite_module`` on rank
    ``fault_nonfinite_rank`` gets a NaN in its first element. 0: no injection."""

    fault_nonfinite_module: str = "norm"
    """Module name (as in ``model.named_modules()``, e.g. ``layers.1.ffn_norm``) whose output
    is poisoned."""

    fault_nonfinite_rank: int = 0
    """Global rank that poisons it."""


@dataclass
class JobConfig:
    mok: Mok = field(default_factory=Mok)
    rl: Rl = field(default_factory=Rl)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    training: Training = field(default_factory=Training)
    debug: Debug = field(default_factory=Debug)
