"""Gated DeltaNet: flash-linear-attention's Triton chunk kernel agrees with our
pure-PyTorch chunked form (forward; gradients where FLA runs its backward).
GPU + fla only."""

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
fla_gdr = pytest.importorskip("fla.ops.gated_delta_rule")

from benchmarks.tools.deltanet import make_inputs, rms_rel  # noqa: E402
from titan_mok.models.qwen3_5_397b_a17b.gated_deltanet import chunk_gated_delta_rule  # noqa: E402


def _fla(*xs):
    return fla_gdr.chunk_gated_delta_rule(*xs, use_qk_l2norm_in_kernel=True)[0]


def test_fla_forward_matches_pytorch_chunked():
    inputs = make_inputs(seq_len=300, hk=2, hv=8)
    with torch.no_grad():
        assert rms_rel(_fla(*inputs), chunk_gated_delta_rule(*inputs, chunk_size=64)) < 2e-2


def test_fla_gradients_match_pytorch_chunked():
    inputs = make_inputs(seq_len=300, hk=2, hv=8)
    grads = {}
    for name, fn in (("ours", lambda *xs: chunk_gated_delta_rule(*xs, chunk_size=64)), ("fla", _fla)):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        o = fn(*xs)
        try:
            o.backward(torch.ones_like(o))
        except RuntimeError as err:  # FLA refuses its backward on Hopper with Triton < 3.7.1 (FLA #640)
            pytest.skip(f"FLA backward unavailable here: {err}")
        grads[name] = [x.grad for x in xs]
    for label, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), grads["fla"], grads["ours"]):
        assert rms_rel(a, b) < 2e-2, label
