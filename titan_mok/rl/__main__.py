"""`torchrun --nproc_per_node N -m titan_mok.rl --config PATH [--section.key value ...]`:
the TOML of a training run plus an `[rl]` section; TorchTitan's Trainer runs GRPO steps."""

from titan_mok.train import launch


def _rl_trainer():
    from titan_mok.rl.trainer import RlTrainer, check_rl_job

    return RlTrainer, check_rl_job


def main(argv: list[str] | None = None) -> None:
    launch("titan_mok.rl", _rl_trainer, argv)


if __name__ == "__main__":
    main()
