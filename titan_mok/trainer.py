"""titan-mok's pretraining Trainer: TorchTitan's, with each microbatch's attached
losses (MoE aux, MTP, DSA indexer; ``titan_mok.attached_loss``) weighted by the
microbatch's share of the step's tokens, as its cross-entropy is, and with
``[mok] mxfp8_weight_cache`` each step's MXFP8 expert weights quantized once."""

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.train import Trainer

from titan_mok.attached_loss import loss_weight
from titan_mok.kernels import weight_cache


class MokTrainer(Trainer):
    def train_step(self, data_iterator):
        # the weights change only in the step's optimizer update, after the last backward
        with weight_cache.kept_for_step(self.job_config.mok.mxfp8_weight_cache):
            return super().train_step(data_iterator)

    def forward_backward_step(
        self, *, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: torch.Tensor
    ) -> torch.Tensor:
        local_tokens = (labels != IGNORE_INDEX).sum()
        with loss_weight(local_tokens / global_valid_tokens):
            return super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
