"""FSDP2 state around the RL steps that leave ``model.forward``'s usual path:
decoding through submodules (which FSDP's forward hooks do not see) and
swapping the reference policy's weights into the shards (which a gathered copy
kept after a forward would not see)."""

from contextlib import contextmanager

import torch
from torch.distributed.fsdp import FSDPModule


def _fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshard(model: torch.nn.Module) -> None:
    """Free every gathered parameter copy: the next forward gathers the shards afresh."""
    for module in _fsdp_modules(model):
        module.reshard()


@contextmanager
def unsharded(model: torch.nn.Module):
    """All FSDP-sharded parameters gathered for the duration (an inference engine's full weights)."""
    if isinstance(model, FSDPModule):
        # NOTE: private FSDP2 API (torch 2.11-2.13). The root's forward normally does this; without
        # it, the first FSDP-wrapped submodule called directly (e.g. the final norm) claims the root.
        model._get_fsdp_state()._lazy_init()
    for module in _fsdp_modules(model):
        module.unshard()
    try:
        yield
    finally:
        reshard(model)
