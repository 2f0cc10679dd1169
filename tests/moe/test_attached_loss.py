"""titan_mok.attached_loss: the weight reaches the gradient exactly, the tally counts
each training forward once (not the activation-checkpoint recompute, not no-grad)."""

import torch
from torch.utils.checkpoint import checkpoint

from titan_mok.attached_loss import attach_loss, attaching, loss_weight, take_tally, without_losses


def _step(p: torch.Tensor, x: torch.Tensor, coef: float) -> torch.Tensor:
    return attach_loss(x * 2, (p * p).sum(), coef, "square")


def test_weight_and_coefficient_scale_the_attached_gradient_only():
    take_tally()
    p = torch.tensor([1.5, -3.0], requires_grad=True)
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    with loss_weight(torch.tensor(0.25)):
        y = _step(p, x, coef=0.5)
    y.sum().backward()
    assert torch.equal(p.grad, 0.5 * 0.25 * 2 * p.detach())  # exact in binary
    assert torch.equal(x.grad, torch.full((3,), 2.0))  # y itself is untouched
    p.grad = None
    _step(p, x, coef=0.5).sum().backward()  # outside loss_weight: weight 1
    assert torch.equal(p.grad, 0.5 * 2 * p.detach())
    total, count = take_tally()["square"]
    assert count == 2 and total.item() == 2 * (1.5**2 + 3.0**2)


def test_a_switched_off_loss_is_not_attached():
    """Inside without_losses (the RL trainer's MTP), the named loss adds no gradient and no tally."""
    take_tally()
    p = torch.tensor([1.5, -3.0], requires_grad=True)
    with without_losses("square"):
        assert not attaching("square") and attaching("other")
        y = _step(p, torch.ones(3, requires_grad=True), coef=0.5)
    assert attaching("square")
    y.sum().backward()
    assert p.grad is None and "square" not in take_tally()


def test_tally_skips_recompute_and_no_grad():
    take_tally()
    p = torch.tensor([2.0], requires_grad=True)
    x = torch.ones(4, requires_grad=True)
    y = checkpoint(_step, p, x, 1.0, use_reentrant=False)
    y.sum().backward()  # recomputes _step inside backward
    with torch.no_grad():
        _step(p, x, 1.0)
    assert p.grad.item() == 4.0
    assert {name: (t.item(), n) for name, (t, n) in take_tally().items()} == {"square": (4.0, 1)}
    assert take_tally() == {}


def test_trainer_weights_a_microbatch_by_its_share_of_the_step_tokens(monkeypatch):
    """MokTrainer around TorchTitan's step (replaced here by a recorder: the full trainer runs
    in tests/train/test_train_smoke.py): 3 of the step's 12 valid tokens → weight 1/4."""
    from torchtitan.train import Trainer

    import titan_mok.attached_loss as attached
    from titan_mok.faults import NonfiniteGuard
    from titan_mok.trainer import MokTrainer

    seen = []
    monkeypatch.setattr(Trainer, "forward_backward_step",
                        lambda self, **kw: seen.append(attached._weight) or torch.zeros(()))  # a loss
    labels = torch.tensor([[5, -100, 7], [-100, 9, -100]])
    trainer = object.__new__(MokTrainer)
    trainer.nonfinite_guard = NonfiniteGuard(trainer, "ignore", None)  # [training] nonfinite off: no optimizer hook
    MokTrainer.forward_backward_step(trainer, input_dict={}, labels=labels, global_valid_tokens=torch.tensor(12.0))
    assert [w.item() for w in seen] == [0.25] and attached._weight == 1.0
