"""titan_mok.compare's report on hand-made runs (the real runs are in test_compare.py)."""

import math

import pytest

from titan_mok.compare import CompareError, Run, compare, config_diff, curve_diff, render

LOSS = "loss_metrics/global_avg_loss"


def _run(name: str, loss: dict[int, float], tps: dict[int, float] | None = None, **config) -> Run:
    series = {LOSS: loss, "throughput(tps)": tps or {s: 100.0 for s in loss}, "mfu(%)": {s: math.nan for s in loss}}
    return Run(source=f"{name}.jsonl", name=name, series=series, config=config)


def test_first_divergence_after_equal_steps():
    a = _run("a", {1: 3.0, 2: 2.5, 3: 2.0, 4: 1.5})
    b = _run("b", {1: 3.0, 2: 2.5, 3: 2.0 + 2**-50, 4: 1.25})
    (diff,) = curve_diff(LOSS, [a, b], [1, 2, 3, 4])
    assert diff == {
        "run": 1, "identical": False, "steps_compared": 4, "first_divergent_step": 3, "values": [2.0, 2.0 + 2**-50],
        "abs_diff": 2**-50, "rel_diff": 2**-51, "max_abs_diff": 0.25,
    }


def test_bitwise_means_bits():
    nan_a, nan_b = _run("a", {1: math.nan, 2: 0.0}), _run("b", {1: math.nan, 2: -0.0})
    (diff,) = curve_diff(LOSS, [nan_a, nan_b], [1, 2])
    assert diff["first_divergent_step"] == 2  # NaN == NaN bit for bit; 0.0 and -0.0 differ
    (same,) = curve_diff(LOSS, [nan_a, _run("c", {1: math.nan, 2: 0.0})], [1, 2])
    assert same["identical"]


def test_stats_over_common_steps_only():
    a = _run("a", {1: 4.0, 2: 3.0, 3: 2.0}, tps={1: 10.0, 2: 30.0, 3: 20.0})
    b = _run("b", {2: 6.0, 3: 1.0, 4: 0.5}, tps={2: 60.0, 3: 40.0, 4: 0.0})
    report = compare([a, b], [])
    loss = report["metrics"][LOSS]
    assert loss["common_steps"] == 2
    assert loss["per_run"][1] == {"final": 1.0, "mean": 3.5, "best": 1.0,
                                  "final_ratio": 0.5, "mean_ratio": 3.5 / 2.5, "best_ratio": 0.5}
    assert report["metrics"]["throughput(tps)"]["per_run"][1]["best"] == 60.0  # higher is better
    mfu = report["metrics"]["mfu(%)"]["per_run"][0]
    assert math.isnan(mfu["mean"]) and mfu["mean_ratio"] is None
    assert list(report["curves"]) == [LOSS]
    assert "diverges at step 2: 3.0 vs 6.0" in render(report)


def test_unknown_metric_and_no_common_steps():
    a, b = _run("a", {1: 1.0}), _run("b", {2: 1.0})
    with pytest.raises(CompareError, match="unknown metric 'nope': run #0"):
        compare([a, b], ["nope"])
    with pytest.raises(CompareError, match="no common steps"):
        compare([a, b], ["loss"])


def test_config_diff_compares_numbers_by_value():
    a = {"training": {"lr": 1.0, "steps": 4}, "mok": {"precision": "bf16"}, "tags": [1, 2]}
    b = {"training": {"lr": 1, "steps": 5}, "mok": {"precision": "bf16"}, "tags": [1.0, 2.0], "extra": True}
    diff = config_diff([Run("a", "a", {}, a), Run("b", "b", {}, b)])
    assert diff == {"training.steps": [4, 5], "extra": ["<missing>", True]}
