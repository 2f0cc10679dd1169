"""Losses joined to the backward pass beside the trainer's cross-entropy: the MoE
load-balancing loss, GLM-5.2's MTP loss and its DSA indexer's KL loss.

``attach_loss(y, loss, coef, name)`` returns ``y`` unchanged; its backward adds
``coef · weight · d(loss)/dθ``, so a plain cross-entropy on the model output trains
the attached loss's parameters as if ``coef · weight · loss`` had been added to it.

Weight: an attached loss is a mean over one rank's microbatch. The trainer's
cross-entropy is a sum over the step's tokens (every rank, every microbatch) divided
by their count, and data-parallel gradients are summed (FSDP's own division is off,
TorchTitan's convention). So the trainers run each microbatch inside
``loss_weight(local tokens / step tokens)``: summed over ranks and microbatches an
attached loss counts as its token-weighted mean, and ``coef`` means the same at any
data-parallel degree or accumulation. Outside one (tests, inference) the weight is 1.

Switching off: inside ``without_losses(*names)`` those losses are not attached, and a model
asks ``attaching(name)`` before computing one (the RL trainer switches off the MTP loss).

Tally: the value of every attached loss of a training forward is summed per name on
the device (no host sync) for the metrics, which ``take_tally`` hands over. Not under
``torch.compile`` (its Python side effects would break the graph) and not in an
activation-checkpoint recompute (it would count twice).
"""

from contextlib import contextmanager

import torch

_weight: float | torch.Tensor = 1.0
_tally: dict[str, list] = {}  # name -> [Σ value (fp64 tensor), count]
_switched_off: frozenset[str] = frozenset()


@contextmanager
def loss_weight(weight: float | torch.Tensor):
    """Weight every loss attached inside by ``weight`` (a 0-dim tensor or a float)."""
    global _weight
    previous, _weight = _weight, weight
    try:
        yield
    finally:
        _weight = previous


@contextmanager
def without_losses(*names: str):
    """Inside, the named losses are not attached (``attaching(name)`` is False)."""
    global _switched_off
    previous, _switched_off = _switched_off, _switched_off | frozenset(names)
    try:
        yield
    finally:
        _switched_off = previous


def attaching(name: str) -> bool:
    """Whether a loss named ``name`` would be attached here (not switched off)."""
    return name not in _switched_off


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, loss: torch.Tensor, coef: float) -> torch.Tensor:
        ctx.coef = coef
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        shape, dtype, device = ctx.loss_meta
        return dy, torch.full(shape, ctx.coef, dtype=dtype, device=device), None


def _tallying() -> bool:
    return (
        torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and torch._C._current_graph_task_id() == -1  # -1: not inside a backward (AC recompute)
    )


def attach_loss(y: torch.Tensor, loss: torch.Tensor, coef: float, name: str) -> torch.Tensor:
    """``y``, with ``coef · weight · loss`` joined to the backward pass (module docstring)."""
    if not attaching(name):
        return y
    if _tallying():
        entry = _tally.setdefault(name, [torch.zeros((), dtype=torch.float64, device=loss.device), 0])
        entry[0] += loss.detach().double()
        entry[1] += 1
    # d(loss · weight)/d(loss) = weight: the weight reaches the gradient without a host sync
    return _AttachLoss.apply(y, loss * _weight, coef)


def take_tally() -> dict[str, tuple[torch.Tensor, int]]:
    """{name: (Σ values as a fp64 device tensor, number of values)} since the last call; clears it."""
    global _tally
    taken, _tally = _tally, {}
    return {name: (total, count) for name, (total, count) in taken.items()}
