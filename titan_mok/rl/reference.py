"""The reference policy of the KL penalty: a frozen copy of the policy's state
(this rank's shards of parameters and persistent buffers, e.g. the MoE expert
bias), swapped into the model for one no-grad forward per step.

It lives in the checkpoint (the RL trainer's state), so a resumed run penalises
against the same reference. Cost: two extra copies of the rank's model shards
(the reference and the policy while the reference is swapped in).
"""

from contextlib import contextmanager

import torch
from torch.distributed.fsdp import FSDPModule

from titan_mok.kernels import weight_cache


def _reshard(model: torch.nn.Module) -> None:
    """Free every FSDP-gathered parameter copy: the next forward gathers the shards afresh."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class ReferencePolicy:
    def __init__(self, model: torch.nn.Module):
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def reset_to(self, model: torch.nn.Module) -> None:
        """The model's current state becomes the reference."""
        for k, v in model.state_dict().items():
            self.state[k].copy_(v)

    @contextmanager
    @torch.no_grad()
    def swapped_in(self, model: torch.nn.Module):
        """The model computes with the reference state for the duration, then gets its own back
        (state_dict tensors alias the parameters and buffers, FSDP2 shards included; gathered
        copies and kept MXFP8 copies are dropped on both sides of the swap, so no forward reads
        stale weights)."""
        _reshard(model)
        live = model.state_dict()
        saved = {k: v.clone() for k, v in live.items()}
        for k, v in live.items():
            v.copy_(self.state[k])
        weight_cache.weights_written()
        try:
            yield
        finally:
            _reshard(model)
            for k, v in live.items():
                v.copy_(saved[k])
            weight_cache.weights_written()
