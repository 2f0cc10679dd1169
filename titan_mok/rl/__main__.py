"""`torchrun --nproc_per_node N -m titan_mok.rl --config PATH [--section.key value ...]`:
the TOML of a training run plus an `[rl]` section; TorchTitan's Trainer runs GRPO steps."""

import sys

import torch


def main(argv: list[str] | None = None) -> None:
    if not torch.cuda.is_available():
        from titan_mok import cpu_compat

        cpu_compat.apply()

    from torchtitan.tools.logging import init_logger

    from titan_mok import registry
    from titan_mok.config_check import ConfigError, MokConfigManager
    from titan_mok.rl.trainer import RlTrainer, check_rl_job
    from titan_mok.train import _normalise_args

    init_logger()
    registry.register_all()
    try:
        config = MokConfigManager().parse_args(_normalise_args(sys.argv[1:] if argv is None else argv))
        check_rl_job(config)
    except (ConfigError, ValueError) as e:
        sys.exit(f"titan_mok.rl: config error: {e}")

    trainer = RlTrainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
