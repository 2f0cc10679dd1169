"""benchmarks.tools.grouped_ffn's timing rounds (CPU: the phases and the timer stubbed, the bookkeeping real)."""

import weakref

import pytest
import torch

from benchmarks.tools import grouped_ffn
from benchmarks.tools.grouped_ffn import Case

CEIL = {"bf16_tflops": 1.0, "fp8_tflops": 2.0, "hbm_tbps": 1.0}


def _stub(monkeypatch, times):
    """Phases "fwd" and "wgrad" per implementation; bench pops each (impl, phase)'s next time (raising it
    if it is an exception) and logs the order."""
    order = []
    monkeypatch.setattr(grouped_ffn, "_phases",
                        lambda impl, c, table=None: ({ph: (impl, ph) for ph in ("fwd", "wgrad")}, "bf16"))

    def bench(fn, rep_ms):
        order.append(fn)
        t = times[fn].pop(0)
        if isinstance(t, Exception):
            raise t
        return t

    monkeypatch.setattr(grouped_ffn, "bench", bench)
    return order


def test_rounds_alternate_the_implementations_and_report_median_and_range(monkeypatch):
    times = {("a", "fwd"): [3.0, 1.0, 2.0], ("a", "wgrad"): [1.0, 1.0, 1.0],
             ("b", "fwd"): [5.0, 6.0, 4.0], ("b", "wgrad"): [2.0, 9.0, 2.0]}
    order = _stub(monkeypatch, times)
    c = Case(64, 32, torch.tensor([3, 5]), dev="cpu")
    out = grouped_ffn._time_phases(c, ["a", "b"], CEIL, rep_ms=1, rounds=3)
    # round 0 a then b, round 1 b then a, round 2 a then b
    assert [impl for impl, ph in order if ph == "fwd"] == ["a", "b", "b", "a", "a", "b"]
    assert out["a"]["fwd"]["ms"] == 2.0 and out["a"]["fwd"]["range_ms"] == [1.0, 3.0]
    assert out["b"]["fwd"]["ms"] == 5.0 and out["b"]["fwd"]["range_ms"] == [4.0, 6.0]
    assert out["b"]["wgrad"]["ms"] == 2.0 and out["b"]["wgrad"]["range_ms"] == [2.0, 9.0]
    fl, flops = grouped_ffn.floors(c, CEIL, "bf16")
    assert out["a"]["fwd"]["of_floor"] == pytest.approx(fl["fwd"] / 2.0)


def test_one_round_times_each_phase_once_without_a_range(monkeypatch):
    order = _stub(monkeypatch, {("a", "fwd"): [3.0], ("a", "wgrad"): [4.0]})
    out = grouped_ffn._time_phases(Case(64, 32, torch.tensor([3, 5]), dev="cpu"), ["a"], CEIL, rep_ms=1, rounds=1)
    assert len(order) == 2 and out["a"]["fwd"]["ms"] == 3.0 and "range_ms" not in out["a"]["fwd"]


def test_a_failing_implementation_is_recorded_not_raised(monkeypatch):
    _stub(monkeypatch, {})

    def phases(impl, c, table=None):
        raise RuntimeError("torch rejects this case")

    monkeypatch.setattr(grouped_ffn, "_phases", phases)
    out = grouped_ffn._time_phases(Case(64, 32, torch.tensor([3, 5]), dev="cpu"), ["a"], CEIL, rep_ms=1, rounds=2)
    assert "torch rejects this case" in out["a"]["error"]


def test_a_failing_phase_is_recorded_and_not_timed_again(monkeypatch):
    """A phase that fails (say, out of memory) keeps its error text, is skipped in later rounds, and the
    other phases and implementations are timed as usual."""
    times = {("a", "fwd"): [RuntimeError("CUDA out of memory")], ("a", "wgrad"): [1.0, 2.0, 3.0],
             ("b", "fwd"): [4.0, 5.0, 6.0], ("b", "wgrad"): [7.0, 8.0, 9.0]}
    order = _stub(monkeypatch, times)
    out = grouped_ffn._time_phases(Case(64, 32, torch.tensor([3, 5]), dev="cpu"), ["a", "b"], CEIL, rep_ms=1,
                                   rounds=3)
    assert order.count(("a", "fwd")) == 1
    assert "CUDA out of memory" in out["a"]["fwd"]["error"] and isinstance(out["a"]["fwd"]["error"], str)
    assert out["a"]["wgrad"]["ms"] == 2.0 and out["b"]["fwd"]["ms"] == 5.0


@pytest.mark.parametrize("flag, value, named", [("--shapes", "kimi,foo", "--shapes: ['foo']"),
                                                ("--impls", "ours_bf16,bar", "--impls: ['bar']"),
                                                ("--rounds", "0", "--rounds must be at least 1"),
                                                ("--compute-case", "8x0", "--compute-case: expected EXPERTSxROWS"),
                                                ("--compute-case", "8*4096", "--compute-case: expected EXPERTSxROWS")])
def test_bad_arguments_are_named_before_any_gpu_work(monkeypatch, capsys, tmp_path, flag, value, named):
    import sys

    monkeypatch.setattr(sys, "argv", ["grouped_ffn", "--out", str(tmp_path), flag, value])
    with pytest.raises(SystemExit):
        grouped_ffn.main()
    assert named in capsys.readouterr().err


def test_rowwise_fp8_of_an_empty_group():
    """The fp8 baseline quantizes the weight gradient's operands per expert along the token axis: an expert
    without rows is an empty [N, 0] block, which gets one scale per row and no data (it failed in amax)."""
    q, s = grouped_ffn.rowwise_fp8(torch.zeros(4, 0, dtype=torch.bfloat16))
    assert q.shape == (4, 0) and q.dtype == torch.float8_e4m3fn and torch.equal(s, torch.ones(4))
    q, s = grouped_ffn.rowwise_fp8(torch.tensor([[1.0, -448.0]], dtype=torch.bfloat16))
    assert torch.equal(s, torch.tensor([1.0])) and q.float().tolist() == [[1.0, -448.0]]


def test_summary_names_what_did_not_fit():
    """The summary table says "oom" for a phase that ran out of GPU memory (DeepSeek-V4-Pro EP=1 on an 80 GB H100),
    "err" for another failure, of the phase or of the whole implementation, "-" for a phase not run."""
    timed = {"fwd": {"ms": 1.5, "of_floor": 0.8}, "wgrad": {"error": "OutOfMemoryError('CUDA out of memory.')"},
             "dgrad": {"error": "RuntimeError('bad shape')"}}
    assert [grouped_ffn.summary_cell(timed, p) for p in ("fwd", "dgrad", "wgrad", "wquant")] == [
        "1.50 (0.80)", "err", "oom", "-"]
    assert grouped_ffn.summary_cell({"error": "OutOfMemoryError('...')"}, "fwd") == "oom"


def test_our_weight_gradients_are_timed_one_alive_at_a_time(monkeypatch):
    """Our wgrad phase drops each gradient before the next is made (as torch._grouped_mm's does): at
    DeepSeek-V4-Pro EP=1 on an 80 GB H100 two 17 GB gradients beside 51 GB of weights did not fit."""
    refs = []

    def made():
        assert all(r() is None for r in refs), "the previous gradient is still alive as the next is made"
        t = torch.zeros(1)
        refs.append(weakref.ref(t))
        return t

    def grouped_wgrads(pairs, group_end, precision, table=None):
        for _ in pairs:
            yield made()

    monkeypatch.setattr(grouped_ffn.gg, "grouped_wgrads", grouped_wgrads)
    c = Case(32, 16, torch.tensor([3, 0, 5]), dev="cpu")
    grouped_ffn.phases_ours(c, "bf16")["wgrad"]()
    assert len(refs) == 3


def test_tune_sweeps_every_entry_and_hold_the_committed_configs():
    """`--tune` puts the fastest of each table entry's list in place, so each list must hold the committed config
    of every chip's table: else a tune could only move away from it. Every grouped_mm entry has a list."""
    from titan_mok.kernels import tile_configs as tc

    assert set(grouped_ffn.TUNE_VARIANTS) == set(tc.H200.mm)
    for table in (tc.H200, tc.H100):
        for key, variants in grouped_ffn.TUNE_VARIANTS.items():
            assert table.mm[key].cuda in variants, f"{key}: the committed config {table.mm[key].cuda} is not swept"
