"""benchmarks.tools.quantize_weights at tiny sizes, the timer stubbed (CPU: Triton's interpreter): the bits check
and the floors' bookkeeping."""

import pytest
import torch
from triton.runtime.errors import OutOfResources

from benchmarks.tools import quantize_weights
from tests.kernels.test_mxfp8_quant import DEVICE


def _weights():
    g = torch.Generator().manual_seed(0)
    dims = {"w_gate": (96, 64), "w_up": (96, 64), "w_down": (64, 96)}
    return {n: torch.randn(1, *d, generator=g).to(torch.bfloat16).to(DEVICE) for n, d in dims.items()}


def test_run_checks_bits_times_each_method_and_reports_floor_fractions():
    weights = _weights()
    times = iter([4.0, 2.0, 3.0])  # two passes, then the tiles in order
    timed = []
    result = quantize_weights.run(weights, [(64, 128, 4), (64, 64, 2)], hbm_tbps=1.0, rep_ms=1,
                                  timer=lambda fn, rep_ms: timed.append(fn()) or next(times))
    numel = 3 * 96 * 64
    assert len(timed) == 3 and result["weight_elements"] == numel
    floors = result["floors_ms"]
    assert floors["two_passes"] == pytest.approx((4 * numel + 2 * 33 / 32 * numel) / 1e9)
    assert floors["one_pass"] == pytest.approx((2 * numel + 2 * 33 / 32 * numel) / 1e9)
    assert result["ms"] == {"two_passes": 4.0, "one_pass 64x128x4": 2.0, "one_pass 64x64x2": 3.0}
    assert result["of_floor"]["one_pass 64x64x2"] == pytest.approx(floors["one_pass"] / 3.0)
    assert result["of_floor"]["two_passes"] == pytest.approx(floors["two_passes"] / 4.0)


def test_a_tile_with_other_bits_stops_the_run(monkeypatch):
    quantize = quantize_weights.mxfp8_quantize_both
    monkeypatch.setattr(quantize_weights, "mxfp8_quantize_both", lambda *a, **kw: quantize(*a, **kw)[::-1])
    with pytest.raises(AssertionError, match=r"tile \(64, 128, 4\): w_gate along 2 data differs"):
        quantize_weights.run(_weights(), [(64, 128, 4)], hbm_tbps=1.0, rep_ms=1, timer=lambda fn, rep_ms: 1.0)


def test_a_tile_the_gpu_cannot_run_is_reported_not_timed(monkeypatch):
    quantize = quantize_weights.mxfp8_quantize_both

    def quantize_or_fail(w, name, mma_order, tile):
        if tile == (128, 128, 8):
            raise OutOfResources(300000, 232448, "shared memory")
        return quantize(w, name, mma_order=mma_order, tile=tile)

    monkeypatch.setattr(quantize_weights, "mxfp8_quantize_both", quantize_or_fail)
    result = quantize_weights.run(_weights(), [(128, 128, 8), (64, 128, 4)], hbm_tbps=1.0, rep_ms=1,
                                  timer=lambda fn, rep_ms: 1.0)
    assert list(result["ms"]) == ["two_passes", "one_pass 64x128x4"]
    assert "out of resource: shared memory" in result["failed"]["one_pass 128x128x8"]
