"""Training entry: `torchrun --nproc_per_node N -m titan_mok.train --config PATH [--section.key value ...]`.

Loads TorchTitan's TOML sections plus `[mok]`, checks them before any process
group exists, registers titan-mok's models and runs its Trainer (TorchTitan's, see
`titan_mok.trainer`)
(gloo on CPU, NCCL on GPU). `launch` is shared with `titan_mok.rl`.
"""

import logging
import os
import sys
from typing import Callable

import torch


def _normalise_args(argv: list[str]) -> list[str]:
    # `--config PATH` is ours; TorchTitan spells it `--job.config_file`.
    return ["--job.config_file" if a == "--config" else a.replace("--config=", "--job.config_file=", 1) for a in argv]


def launch(prog: str, load_trainer: Callable[[], tuple[type, Callable | None]], argv: list[str] | None) -> None:
    """Parse and check the config, then train. `load_trainer()` returns the Trainer
    class and an extra config check; it is called after the CPU adaptations, so the
    trainer's modules import TorchTitan already adapted."""
    if not torch.cuda.is_available():
        from titan_mok import cpu_compat

        cpu_compat.apply()

    from torchtitan.tools.logging import init_logger

    from titan_mok import faults, registry
    from titan_mok.config_check import ConfigError, MokConfigManager

    trainer_cls, extra_check = load_trainer()
    init_logger()
    registry.register_all()
    try:
        config = MokConfigManager().parse_args(_normalise_args(sys.argv[1:] if argv is None else argv))
        if extra_check is not None:
            extra_check(config)
    except ConfigError as e:
        sys.exit(f"{prog}: config error: {e}")

    trainer = trainer_cls(config)
    try:
        trainer.train()
    except Exception as error:
        faults.explain_failure(error, trainer)
        raise
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    _exit_before_finalizing()


def _exit_before_finalizing() -> None:
    """Leave without running interpreter finalization. Gloo's worker threads outlive
    `destroy_process_group` and release each finished collective's tensors themselves;
    a tensor a Python wrapper once owned needs the GIL to free, and a thread that takes
    the GIL while the interpreter finalizes is killed mid-destructor: std::terminate,
    SIGABRT after a successful run (seen in ~1 of 40 loaded-CPU runs). Everything the
    run writes (checkpoints, W&B files, logs) is closed by then."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _pretraining():
    from titan_mok.trainer import MokTrainer

    return MokTrainer, None


def main(argv: list[str] | None = None) -> None:
    launch("titan_mok.train", _pretraining, argv)


if __name__ == "__main__":
    main()
