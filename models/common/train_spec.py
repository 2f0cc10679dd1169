"""The TrainSpec every titan-mok MoE model uses: its own model, flavors and HF
adapter; titan-mok's parallelize, data and tokenizer; TorchTitan's optimizer with
the aux-loss-free load-balancing hook, LR schedule and cross-entropy."""

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
from torchtitan.protocols.train_spec import TrainSpec

from titan_mok.data import build_char_tokenizer, build_task_dataloader
from titan_mok.parallelize import parallelize_moe_model


def moe_train_spec(model_cls, model_args: dict, state_dict_adapter) -> TrainSpec:
    return TrainSpec(
        model_cls=model_cls,
        model_args=model_args,
        parallelize_fn=parallelize_moe_model,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers_with_moe_load_balancing,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_task_dataloader,
        build_tokenizer_fn=build_char_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        state_dict_adapter=state_dict_adapter,
    )
