"""precision = "mxfp8": each MXFP8 expert weight layout quantized once per version of its source weight
(titan_mok.kernels.weight_cache), same bits as quantizing it on every call. CPU: Triton's interpreter."""

import copy

import pytest
import torch

from titan_mok.kernels import grouped_ffn, weight_cache
from titan_mok.moe.args import MoEArgs
from titan_mok.moe.experts import RoutedExperts
from tests.kernels.test_grouped_ffn import CPU_CASE, make_case, run

LAYOUTS = sorted((n, a) for n in ("w_gate_EIH", "w_up_EIH", "w_down_EHI") for a in (1, 2))


phase = ["pass"]  # where a quantization runs: "pass" (a forward or backward) or "step" (the optimizer's)


def _counted_weight_operand(monkeypatch, phases: list | None = None) -> list:
    calls = []
    quantize = grouped_ffn.weight_operand

    def counted(w, precision, along, name, **kw):
        calls.append((name, along))
        if phases is not None:
            phases.append(phase[0])
        return quantize(w, precision, along, name, **kw)

    monkeypatch.setattr(grouped_ffn, "weight_operand", counted)
    return calls


def _microbatches(tensors, group_end, owner, precision="mxfp8"):
    """Two microbatches (other rows, the same weights) forward and backward, as a step would run them;
    the weights given to the FFN are fresh copies each call (as a cast of fp32 parameters is)."""
    x, w_gate, w_up, w_down, dy = tensors
    second = [x.flip(0), w_gate, w_up, w_down, dy.flip(0)]
    kw = dict(precision=precision, swiglu_limit=0.5, use_triton=True, weights_owner=owner,
              weight_sources=(w_gate, w_up, w_down) if owner is not None else None)
    return run(tensors, group_end, **kw) + run(second, group_end, **kw)


def _assert_same_bits(expected, got):
    assert len(expected) == len(got), (len(expected), len(got))
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"output {i} (y, dx, dw_gate, dw_up, dw_down per microbatch): other bits"


def test_each_layout_is_quantized_once_per_weight_version(monkeypatch):
    """Six layouts (3 weights x forward/dgrad) quantized once for both microbatches, forward, dX and weight
    gradients bitwise equal to quantizing on every call; an in-place write to a source (an optimizer
    update, a checkpoint load) quantizes that weight's layouts again, and nothing else."""
    tensors, group_end = make_case(**CPU_CASE)
    owner = torch.nn.Module()
    calls = _counted_weight_operand(monkeypatch)
    each_call = _microbatches(tensors, group_end, None)
    assert len(calls) == 12
    calls.clear()
    _assert_same_bits(each_call, _microbatches(tensors, group_end, owner))
    assert sorted(calls) == LAYOUTS
    calls.clear()
    _assert_same_bits(each_call, _microbatches(tensors, group_end, owner))  # the next step, same weights
    assert calls == []

    w_up = tensors[2]
    with torch.no_grad():
        w_up.mul_(1.5)  # an optimizer update's in-place write
    _assert_same_bits(_microbatches(tensors, group_end, None), _microbatches(tensors, group_end, owner))
    assert sorted(calls[12:]) == [("w_up_EIH", 1), ("w_up_EIH", 2)]
    calls.clear()
    with torch.no_grad():
        w_up.copy_(tensors[1])  # a checkpoint load's copy into the parameter
    _assert_same_bits(_microbatches(tensors, group_end, None), _microbatches(tensors, group_end, owner))
    assert sorted(calls[12:]) == [("w_up_EIH", 1), ("w_up_EIH", 2)]


def test_nothing_is_kept_without_an_owner_or_in_bf16(monkeypatch):
    tensors, group_end = make_case(**CPU_CASE)
    calls = _counted_weight_operand(monkeypatch)
    _microbatches(tensors, group_end, owner=None)
    assert len(calls) == 12
    calls.clear()
    _microbatches(tensors, group_end, owner=torch.nn.Module(), precision="bf16")
    assert len(calls) == 12


def test_an_owner_needs_the_weight_sources():
    tensors, group_end = make_case(**CPU_CASE)
    x, w_gate, w_up, w_down, _ = tensors
    with pytest.raises(ValueError, match=r"weights_owner needs weight_sources = \(w_gate, w_up, w_down\)"):
        grouped_ffn.grouped_swiglu_ffn(x, group_end, w_gate, w_up, w_down, precision="mxfp8", use_triton=True,
                                       weights_owner=object())


class _QuantizedEachPass(RoutedExperts):
    """The experts with nothing kept: every forward quantizes its weights (what the kept operands must equal)."""

    def forward(self, x_RH, group_end_L):
        weights = (w.to(x_RH.dtype) for w in self.local_weights())
        return grouped_ffn.grouped_swiglu_ffn(x_RH, group_end_L, *weights, precision=self.precision,
                                              swiglu_limit=self.swiglu_limit, use_triton=True)


def _experts(kept: bool) -> RoutedExperts:
    torch.manual_seed(0)
    args = MoEArgs(num_experts=3, expert_dim=96, precision="mxfp8", kernels="triton")
    # fp32 parameters, cast to bf16 each forward
    experts = (RoutedExperts if kept else _QuantizedEachPass)(64, args, use_triton=True)
    with torch.no_grad():
        experts.init_weights(0.02)
    return experts


def _train(experts, steps: int, microbatches: int, state=None, first_step: int = 0, hook: bool = True,
           state_after: int | None = None) -> tuple[list, dict | None]:
    """Fused AdamW steps (TorchTitan's default; its update leaves ``_version`` as it was) with gradient
    accumulation over microbatches, the trainers' post-hook registered; the bf16 outputs of every microbatch,
    and (state_after: a number of steps) a copy of the module's and optimizer's state after that step."""
    optimizer = torch.optim.AdamW(experts.parameters(), lr=1e-2, fused=True)
    if hook:
        optimizer.register_step_post_hook(weight_cache.step_post_hook(experts))
    if state is not None:
        experts.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    tensors, group_end = make_case(**CPU_CASE, seed=1)
    outputs, saved = [], None
    for step in range(first_step, first_step + steps):
        for micro in range(microbatches):
            x = tensors[0].roll(step + micro, 0)
            y = experts(x, group_end)
            y.float().square().sum().backward()
            outputs.append(y.detach())
        phase[0] = "step"
        optimizer.step()
        phase[0] = "pass"
        optimizer.zero_grad()
        if step + 1 == state_after:  # a checkpoint's copy: the run goes on writing its tensors
            saved = copy.deepcopy({"model": experts.state_dict(), "optim": optimizer.state_dict()})
    return outputs, saved


def test_training_quantizes_once_per_step_and_resumes_bitwise(monkeypatch):
    """RoutedExperts with gradient accumulation: each layout quantized once per optimizer step, inside the step
    (against once per microbatch when quantized every pass), every microbatch's output bitwise the same; a
    load into a fresh module (a resume) makes its operands again from the loaded weights and continues with
    the uninterrupted run's bits."""
    phases = []
    calls = _counted_weight_operand(monkeypatch, phases)
    each_pass, _ = _train(_experts(kept=False), steps=2, microbatches=2)
    assert len(calls) == 2 * 2 * 6
    calls.clear(), phases.clear()
    kept, state = _train(_experts(kept=True), steps=2, microbatches=2, state_after=1)
    # the first step's forward and backward make the six layouts; then each optimizer step makes them anew
    assert phases == ["pass"] * 6 + ["step"] * 2 * 6
    assert all(sorted(calls[i:i + 6]) == LAYOUTS for i in range(0, len(calls), 6))
    _assert_same_bits(each_pass, kept)

    calls.clear(), phases.clear()
    resumed, _ = _train(_experts(kept=True), steps=1, microbatches=2, state=state, first_step=1)
    # after the load: made once from the loaded weights at their first use, then anew in the step
    assert phases == ["pass"] * 6 + ["step"] * 6 and sorted(calls[:6]) == LAYOUTS
    _assert_same_bits(kept[2:], resumed)


def test_without_the_optimizer_hook_a_fused_update_would_be_missed():
    """Why the trainers register ``step_post_hook``: the fused AdamW update writes the parameters without
    bumping ``_version``, so without the hook the second step reads the first step's operands."""
    each_pass, _ = _train(_experts(kept=False), steps=2, microbatches=1)
    unhooked, _ = _train(_experts(kept=True), steps=2, microbatches=1, hook=False)
    assert torch.equal(each_pass[0], unhooked[0]) and not torch.equal(each_pass[1], unhooked[1])
