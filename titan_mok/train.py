"""Training entry: `torchrun --nproc_per_node N -m titan_mok.train --config PATH [--section.key value ...]`.

Loads TorchTitan's TOML sections plus `[mok]`, checks them before any process
group exists, registers titan-mok's models and runs TorchTitan's Trainer
(gloo on CPU, NCCL on GPU).
"""

import sys

import torch


def _normalise_args(argv: list[str]) -> list[str]:
    # `--config PATH` is ours; TorchTitan spells it `--job.config_file`.
    return ["--job.config_file" if a == "--config" else a.replace("--config=", "--job.config_file=", 1) for a in argv]


def main(argv: list[str] | None = None) -> None:
    if not torch.cuda.is_available():
        from titan_mok import cpu_compat

        cpu_compat.apply()

    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    from titan_mok import registry
    from titan_mok.config_check import ConfigError, MokConfigManager

    init_logger()
    registry.register_all()
    try:
        config = MokConfigManager().parse_args(_normalise_args(sys.argv[1:] if argv is None else argv))
    except ConfigError as e:
        sys.exit(f"titan_mok.train: config error: {e}")

    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
