"""[mok] mxfp8_weight_cache: each MXFP8 expert weight layout quantized once per optimizer step
(titan_mok.kernels.weight_cache), same bits as quantizing it on every call. CPU: Triton's interpreter."""

import pytest
import torch

from titan_mok.config import Mok
from titan_mok.kernels import grouped_ffn, weight_cache
from titan_mok.rl.trainer import RlTrainer
from titan_mok.trainer import MokTrainer
from tests.kernels.test_grouped_ffn import CPU_CASE, make_case, run


def _counted_weight_operand(monkeypatch) -> list:
    calls = []
    quantize = grouped_ffn.weight_operand

    def counted(w, precision, along, name, **kw):
        calls.append((name, along))
        return quantize(w, precision, along, name, **kw)

    monkeypatch.setattr(grouped_ffn, "weight_operand", counted)
    return calls


def _microbatches(tensors, group_end, owner, precision="mxfp8"):
    """Two microbatches (other rows, the same weights) forward and backward, as a step would run them."""
    x, w_gate, w_up, w_down, dy = tensors
    second = [x.flip(0), w_gate, w_up, w_down, dy.flip(0)]
    kw = dict(precision=precision, swiglu_limit=0.5, use_triton=True, weights_owner=owner)
    return run(tensors, group_end, **kw) + run(second, group_end, **kw)


def test_kept_weights_are_quantized_once_per_step(monkeypatch):
    """Inside kept_for_step() the six layouts (3 weights x forward/dgrad) are quantized once for both
    microbatches, and every output and gradient keeps its bits; outside it, once per call."""
    tensors, group_end = make_case(**CPU_CASE)
    owner = object()
    calls = _counted_weight_operand(monkeypatch)
    each_call = _microbatches(tensors, group_end, owner)
    assert len(calls) == 12
    calls.clear()
    with weight_cache.kept_for_step():
        kept = _microbatches(tensors, group_end, owner)
    assert sorted(calls) == sorted((n, a) for n in ("w_gate_EIH", "w_up_EIH", "w_down_EHI") for a in (1, 2))
    for i, (a, b) in enumerate(zip(each_call, kept)):
        assert torch.equal(a, b), f"output {i}: the kept weights give other bits"
    calls.clear()
    with weight_cache.kept_for_step():  # a new step quantizes again: nothing outlives its scope
        _microbatches(tensors, group_end, owner)
    assert len(calls) == 6


def test_nothing_is_kept_without_an_owner_or_in_bf16(monkeypatch):
    tensors, group_end = make_case(**CPU_CASE)
    calls = _counted_weight_operand(monkeypatch)
    with weight_cache.kept_for_step():
        _microbatches(tensors, group_end, owner=None)
        assert len(calls) == 12
        calls.clear()
        _microbatches(tensors, group_end, owner=object(), precision="bf16")
        assert len(calls) == 12


def test_steps_do_not_nest():
    with weight_cache.kept_for_step():
        with pytest.raises(RuntimeError, match="already open"):
            with weight_cache.kept_for_step():
                pass
    with weight_cache.kept_for_step():  # the failed one left the scope usable
        pass


def test_cache_needs_mxfp8_precision():
    with pytest.raises(ValueError, match=r"mxfp8_weight_cache = true needs precision = 'mxfp8'.*'bf16'"):
        Mok(precision="bf16", mxfp8_weight_cache=True)
    assert Mok(precision="mxfp8", mxfp8_weight_cache=True).mxfp8_weight_cache


@pytest.mark.parametrize("enabled", [False, True])
def test_trainer_keeps_weights_for_exactly_one_step(monkeypatch, enabled):
    """MokTrainer.train_step runs TorchTitan's train_step (microbatches, then the optimizer update)
    inside kept_for_step() when [mok] mxfp8_weight_cache is set, and only then. (TorchTitan's
    train_step is replaced by a recorder here: a CPU run takes the reference FFN, which keeps nothing.)"""
    seen = []
    monkeypatch.setattr(MokTrainer.__mro__[1], "train_step", lambda self, it: seen.append(weight_cache._kept is not None))
    trainer = object.__new__(MokTrainer)
    trainer.job_config = type("JobConfig", (), {"mok": Mok(precision="mxfp8", mxfp8_weight_cache=enabled)})()
    trainer.train_step(iter(()))
    trainer.train_step(iter(()))
    assert seen == [enabled, enabled] and weight_cache._kept is None


def test_rl_rollout_keeps_weights_when_configured(monkeypatch):
    """RlTrainer.train_step generates its rollout (every decode step: the same weights) inside
    kept_for_step() when [mok] mxfp8_weight_cache is set, and only then; the scope closes before the
    policy updates. (The rollout is replaced by a recorder that ends the step.)"""
    seen = []

    class RolloutDone(Exception):
        pass

    def recorded_rollout(self):
        seen.append(weight_cache._kept is not None)
        raise RolloutDone

    monkeypatch.setattr(RlTrainer, "_rollout", recorded_rollout)
    trainer = object.__new__(RlTrainer)
    for enabled in (False, True):
        trainer.job_config = type("JobConfig", (), {"rl": None, "mok": Mok(precision="mxfp8", mxfp8_weight_cache=enabled)})()
        with pytest.raises(RolloutDone):
            trainer.train_step(iter(()))
    assert seen == [False, True] and weight_cache._kept is None
