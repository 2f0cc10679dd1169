"""benchmarks.tools.config_ab's variant tables and cases (its timing needs a GPU; this is the CPU part)."""

import dataclasses

import pytest
import torch

from benchmarks.tools.config_ab import case_counts, committed_table, compare, variant_table
from benchmarks.tools.grouped_ffn import SHAPES, TOKENS_PER_GPU
from titan_mok.kernels import tile_configs as tc


def test_variant_merges_sets_and_unsets():
    committed = tc.H200
    v = variant_table(committed, ['bf16/plain@mid_rows={"HALF_TILES": false, "num_stages": 4}',
                                  'mxfp8/plain@few_rows={"STAGES": 2}',
                                  'bf16/dual@few_rows={"kernel": "warp_specialized", "BM": 64, "PERSISTENT": true, '
                                  '"STAGES": 2, "CONSUMER_REGS": 232}'],
                      ["mxfp8/dual@few_rows", "mxfp8/plain@many_rows"])
    plain = dataclasses.replace(committed.mm["bf16/plain@mid_rows"].cuda, HALF_TILES=False, num_stages=4)
    assert v.mm["bf16/plain@mid_rows"] == tc.MMEntry(plain, plain), "one config where the Triton kernel runs on CUDA"
    assert v.mm["mxfp8/plain@few_rows"] == tc.MMEntry(committed.mm["mxfp8/plain@few_rows"].triton, dataclasses.replace(
        committed.mm["mxfp8/plain@few_rows"].cuda, STAGES=2))
    assert v.mm["bf16/dual@few_rows"] == tc.MMEntry(committed.mm["bf16/dual@few_rows"].triton, tc.GluonMM(
        BM=64, PERSISTENT=True, STAGES=2, CONSUMER_REGS=232))
    for key in ("mxfp8/dual@few_rows", "mxfp8/plain@many_rows"):
        assert v.mm[key].cuda == v.mm[key].triton == committed.mm[key].triton
    assert committed is tc.H200 and committed.mm["mxfp8/plain@few_rows"].cuda.STAGES == 4, "the committed table stays"


def test_variant_reaches_the_weight_gradient():
    committed = committed_table()
    v = variant_table(committed, ['wgrad/flat={"BN": 64, "num_warps": 4}'], [])
    assert v.wgrad["flat"] == dataclasses.replace(committed.wgrad["flat"], BN=64, num_warps=4)
    assert v.wgrad["rows"] == committed.wgrad["rows"] and v.mm == committed.mm
    assert variant_table(committed, ['wgrad/flat_ws={"STAGES": 3}'], []).wgrad["flat_ws"] == dataclasses.replace(
        committed.wgrad["flat_ws"], STAGES=3)
    # --unset: the loop's Triton config
    assert variant_table(committed, [], ["wgrad/flat_ws"]).wgrad["flat_ws"] == committed.wgrad["flat"]
    assert variant_table(committed, [], ["wgrad/rows_ws"]).wgrad["rows_ws"] == committed.wgrad["rows"]
    rows = variant_table(committed, ['wgrad/rows_ws={"kernel": "triton", "BR": 64, "BN": 128, "BK": 128, '
                                     '"num_warps": 8, "num_stages": 3}'], []).wgrad["rows_ws"]
    assert rows == tc.TritonWgrad(loop="rows", BR=64, BN=128, BK=128, num_warps=8, num_stages=3)


@pytest.mark.parametrize("sets, unsets, match", [
    (["bf16/plain@mid_rows"], [], r"--set 'bf16/plain@mid_rows': expected KEY=JSON"),
    (["bf16/plian@mid_rows={}"], [], r"--set bf16/plian@mid_rows: not a config key"),
    (["bf16/plain={}"], [], r"--set bf16/plain: not a config key"),
    (["wgrad/flat@few_rows={}"], [], r"--set wgrad/flat@few_rows: not a config key"),
    (["wgrad/flat=null"], [], r"--set wgrad/flat: the value must be a JSON object, got 'null'"),
    (["bf16/plain@mid_rows={BM: 64}"], [], r"--set bf16/plain@mid_rows: '\{BM: 64\}' is not JSON"),
    (["bf16/plain@mid_rows=64"], [], r"--set bf16/plain@mid_rows: the value must be a JSON object"),
    (['bf16/plain@mid_rows={"BMM": 64}'], [], r"--set bf16/plain@mid_rows: .*'BMM'.*the fields of TritonMM: \['BM'"),
    (['bf16/plain@mid_rows={"kernel": "tma"}'], [], r"kernel must be one of \['triton', 'warp_specialized', "
                                                     r"'cooperative'\], got 'tma'"),
    (['wgrad/flat_ws={"kernel": "cooperative"}'], [], r"kernel must be one of \['triton', 'warp_specialized'\]"),
    (['bf16/dual@mid_rows={"kernel": "cooperative", "BN": 128, "BK": 64, "STAGES": 3, "CONSUMER_REGS": 232}'], [],
     r"the variant table: bf16/dual@mid_rows: the cooperative kernel runs the plain and SwiGLU gate/up kinds only"),
    ([], ["wgrad/rows"], r"--unset wgrad/rows: it runs the Triton kernel already"),
    ([], ["bf16/plain@slow_rows"], r"--unset bf16/plain@slow_rows: not a config key"),
])
def test_bad_variants_are_refused_by_name(sets, unsets, match):
    with pytest.raises(ValueError, match=match):
        variant_table(committed_table(), sets, unsets)


def test_cases_are_the_benchmarks():
    _, _, experts, top_k = SHAPES["kimi"]
    for case, num_experts in (("EP=1 balanced", experts), ("EP=2 skewed", experts // 2)):
        counts = case_counts("kimi", case)
        assert counts.numel() == num_experts and int(counts.sum()) == TOKENS_PER_GPU * top_k
    assert torch.equal(case_counts("glm", "8x4096"), torch.full((8,), 4096, dtype=torch.int64))


def test_compare_runs_each_side_on_its_table():
    """compare() runs fn on each table, the bits first, then the timed rounds alternating (each side's rounds on
    its own table), and tells outputs that follow the table apart."""
    committed = committed_table()
    variant = variant_table(committed, ['bf16/plain@mid_rows={"BK": 32}'], [])
    seen = []

    def fn(table):
        seen.append(table.mm["bf16/plain@mid_rows"].cuda.BK)
        return torch.tensor([seen[-1]])

    rec = compare(fn, {"committed": committed, "variant": variant}, rounds=2, rep_ms=1,
                  bench=lambda f, rep_ms: (f(), 1.0)[1])
    assert not rec["bits_equal"] and seen == [64, 32, 64, 32, 32, 64]
    same = compare(fn, {"committed": committed, "variant": committed}, rounds=1, rep_ms=1,
                   bench=lambda f, rep_ms: (f(), 1.0)[1])
    assert same["bits_equal"]


def test_compare_reports_median_and_range_per_table():
    """Each table's median round and its fastest and slowest, from the rounds that table ran."""
    committed = committed_table()
    tables = {"committed": committed, "variant": variant_table(committed, ['bf16/plain@mid_rows={"BK": 32}'], [])}
    times = {64: iter([3.0, 1.0, 2.0]), 32: iter([5.0, 6.0, 4.0])}  # per table's BK, in its rounds' order
    rec = compare(lambda table: torch.tensor([table.mm["bf16/plain@mid_rows"].cuda.BK]), tables, rounds=3, rep_ms=1,
                  bench=lambda f, rep_ms: next(times[int(f())]))
    assert rec["committed_ms"] == 2.0 and rec["committed_range_ms"] == [1.0, 3.0]
    assert rec["variant_ms"] == 5.0 and rec["variant_range_ms"] == [4.0, 6.0]


def tracked_cpu_cases(made: list):
    """A Case factory on the CPU that keeps a weak reference to each case in made and fails if an earlier case is
    still alive when the next one is built."""
    import weakref

    from benchmarks.tools.grouped_ffn import Case

    def make(h, i, counts):
        assert all(ref() is None for ref in made), "an earlier case's tensors are still held"
        case = Case(h, i, counts, dev="cpu")
        made.append(weakref.ref(case))
        return case

    return make


def _run_tiny(monkeypatch, tmp_path, *flags, cases="EP=2 skewed", make_case=None):
    """The whole tool at a tiny shape on the interpreter, timing stubbed; its JSON lines."""
    import json
    import sys

    from benchmarks.tools import config_ab
    from benchmarks.tools.grouped_ffn import Case

    monkeypatch.setattr(config_ab, "SHAPES", {"tiny": (128, 64, 8, 2)})
    monkeypatch.setattr(config_ab, "TOKENS_PER_GPU", 48)
    monkeypatch.setattr(config_ab, "Case", make_case or (lambda h, i, counts: Case(h, i, counts, dev="cpu")))
    monkeypatch.setattr(config_ab, "bench", lambda fn, rep_ms: (fn(), 1.0)[1])
    monkeypatch.setattr(config_ab.torch.cuda, "empty_cache", lambda: None)
    argv = ["config_ab", "--shapes", "tiny", "--cases", cases, "--rounds", "1", "--out", str(tmp_path), *flags]
    monkeypatch.setattr(sys, "argv", argv)
    config_ab.main()
    return [json.loads(line) for line in (tmp_path / "config_ab.jsonl").read_text().splitlines()[1:]]


def test_config_ab_runs_every_kind(monkeypatch, tmp_path):
    """Every kind of grouped_mm reported by the table entry it reads (the tiny case: 24 rows per expert), and no
    weight gradient (the variant leaves its configs), the bits kept by variants that only move tile shapes (the
    kernels' contract)."""
    rows = _run_tiny(monkeypatch, tmp_path, "--precision", "bf16", "--set",
                     'bf16/plain@few_rows={"HALF_TILES": false}', "--set", 'bf16/dual@few_rows={"BN": 128}')
    assert [r["kind"] for r in rows] == [f"bf16/{k}@few_rows" for k in ("swiglu", "plain", "swiglu_bwd", "dual")]
    assert all(r["bits_equal"] and r["committed_ms"] == r["variant_ms"] == 1.0 for r in rows)
    assert tc.DEFAULT.mm["bf16/dual@few_rows"].triton.BN == 256, "the committed table stays"


def test_config_ab_runs_the_weight_gradients(monkeypatch, tmp_path):
    """A weight-gradient variant compares each weight's gradient under the loop the case runs (the
    tiny case's experts hold few rows: the flat loop), and only those."""
    rows = _run_tiny(monkeypatch, tmp_path, "--precision", "mxfp8", "--set", 'wgrad/flat={"num_stages": 2}')
    assert [r["kind"] for r in rows] == [f"wgrad/flat:{w}" for w in ("w_gate", "w_up", "w_down")]
    assert all(r["bits_equal"] for r in rows)
    assert tc.DEFAULT.wgrad["flat"].num_stages == 3, "the committed table stays"


def test_each_case_is_released_before_the_next(monkeypatch, tmp_path):
    """Nothing holds a case's tensors once its GEMMs are done: on an 80 GB H100 a case kept alive by a loop
    variable bound to its last GEMM made the next case run out of memory."""
    made = []
    rows = _run_tiny(monkeypatch, tmp_path, "--precision", "bf16", "--set", 'wgrad/flat={"num_stages": 2}',
                     cases="EP=2 skewed,EP=2 balanced", make_case=tracked_cpu_cases(made))
    assert len(made) == 2 and len(rows) == 6


@pytest.mark.parametrize("counts, tier", [([5, 0, 9], "few_rows"), ([100, 0, 200], "mid_rows"),
                                          ([3000, 2000, 1700], "many_rows")])
def test_gemms_are_keyed_by_the_entries_they_read(counts, tier):
    """The benchmark's GEMMs are keyed by the table entries they read at the case's rows per expert, so that
    config_ab and --tune vary the configs those GEMMs run; each runs with the table it is given."""
    from benchmarks.tools.grouped_ffn import TUNE_VARIANTS, Case, gemms_by_kind

    c = Case(128, 64, torch.tensor(counts), dev="cpu")
    gemms = gemms_by_kind(c, "mxfp8")
    assert list(gemms) == [f"mxfp8/{k}@{tier}" for k in ("swiglu", "plain", "swiglu_bwd", "dual")]
    assert all(k in tc.DEFAULT.mm and k in TUNE_VARIANTS for k in gemms)
    if tier == "few_rows":
        key = "mxfp8/plain@few_rows"
        bn64 = dataclasses.replace(tc.DEFAULT.mm[key].triton, BN=64)
        table = tc.DEFAULT.replace(mm={key: tc.MMEntry(bn64, bn64)})
        assert torch.equal(gemms[key](), gemms[key](table))
