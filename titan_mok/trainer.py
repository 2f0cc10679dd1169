"""titan-mok's pretraining Trainer: TorchTitan's, with each microbatch's attached
losses (MoE aux, MTP, DSA indexer; ``titan_mok.attached_loss``) weighted by the
microbatch's share of the step's tokens, as its cross-entropy is, with
each step's MXFP8 expert weights marked stale by an optimizer step post-hook
(``titan_mok.kernels.weight_cache``), with titan-mok's checkpointer (``titan_mok.checkpoint``) and with the non-finite step guard
and fault injection of ``titan_mok.faults`` (docs/faults.md)."""

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.train import Trainer

from titan_mok import faults
from titan_mok.attached_loss import loss_weight
from titan_mok.checkpoint import MokCheckpointManager
from titan_mok.kernels import weight_cache


class MokTrainer(Trainer):
    def __init__(self, job_config):
        super().__init__(job_config)
        self.checkpointer = MokCheckpointManager.replacing(self)
        self.optimizers.register_step_post_hook(weight_cache.step_post_hook(self.model_parts))
        injection = faults.NonfiniteInjection.from_config(job_config, self.model_parts[0])
        self.nonfinite_guard = faults.NonfiniteGuard(self, job_config.training.nonfinite, injection)

    def train_step(self, data_iterator):
        self.nonfinite_guard.start_step()
        return super().train_step(data_iterator)

    def forward_backward_step(
        self, *, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: torch.Tensor
    ) -> torch.Tensor:
        local_tokens = (labels != IGNORE_INDEX).sum()
        with loss_weight(local_tokens / global_valid_tokens), self.nonfinite_guard.microbatch(input_dict, labels):
            try:
                loss = super().forward_backward_step(
                    input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
                )
            except FloatingPointError as error:  # the MoE router's check, on every rank
                raise self.nonfinite_guard.forward_failure(error) from error
        self.nonfinite_guard.record_loss(loss)
        return loss
