"""bench.config_ab's config variants and cases (its timing needs a GPU; this is the CPU part)."""

import pytest
import torch

from titan_mok.bench.config_ab import case_counts, committed_configs, compare, variant_configs
from titan_mok.bench.grouped_ffn import SHAPES, TOKENS_PER_GPU
from titan_mok.kernels import grouped_gemm as gg


def test_variant_merges_sets_and_unsets():
    committed = dict(gg._MM_CONFIGS)
    v = variant_configs(committed, ['bf16/plain={"HALF_TILES": false, "num_stages": 4}', "mxfp8_ws/plain=null",
                                    'bf16/dual@few_rows={"BM": 64}', 'bf16/swiglu@many_rows={"BM": 256}'],
                         ["mxfp8_ws/dual@few_rows", "mxfp8_ws/plain@many_rows"])
    assert v["bf16/plain"] == {**committed["bf16/plain"], "HALF_TILES": False, "num_stages": 4}
    assert v["mxfp8_ws/plain"] is None and v["bf16/dual@few_rows"] == {"BM": 64}
    assert v["bf16/swiglu@many_rows"] == {"BM": 256}
    assert "mxfp8_ws/dual@few_rows" not in v and "mxfp8_ws/plain@many_rows" not in v
    assert committed == gg._MM_CONFIGS, "the committed configs are left as they were"


def test_variant_reaches_the_weight_gradient():
    committed = committed_configs()
    v = variant_configs(committed, ['wgrad/flat={"BN": 64, "num_warps": 4}'], [])
    assert v["wgrad/flat"] == {**gg._WGRAD_CONFIGS["flat"], "BN": 64, "num_warps": 4}
    assert v["wgrad/rows"] == gg._WGRAD_CONFIGS["rows"] and v["bf16/plain"] == gg._MM_CONFIGS["bf16/plain"]
    # the warp-specialized flat loop: a config over a None entry, or None (the Triton kernel)
    assert variant_configs(committed, ['wgrad/flat_ws={"STAGES": 3}'], [])["wgrad/flat_ws"] == {
        **(gg._WGRAD_CONFIGS["flat_ws"] or {}), "STAGES": 3}
    assert variant_configs(committed, ["wgrad/flat_ws=null"], [])["wgrad/flat_ws"] is None


@pytest.mark.parametrize("sets, unsets, match", [
    (["bf16/plain"], [], r"--set 'bf16/plain': expected KEY=JSON"),
    (["bf16/plian={}"], [], r"--set bf16/plian: not a config key"),
    (["bf16/plain@slow={}"], [], r"--set bf16/plain@slow: not a config key"),
    (["wgrad/flat@few_rows={}"], [], r"--set wgrad/flat@few_rows: not a config key"),
    (["wgrad/flat=null"], [], r"--set wgrad/flat: the value must be a JSON object, got 'null'"),
    ([], ["wgrad/rows"], r"--unset wgrad/rows: the weight gradient's entries stay"),
    ([], ["wgrad/flat_ws"], r"--unset wgrad/flat_ws: the weight gradient's entries stay"),
    (["bf16/plain={BM: 64}"], [], r"--set bf16/plain: '\{BM: 64\}' is not JSON"),
    (["bf16/plain=64"], [], r"--set bf16/plain: the value must be a JSON object or null"),
    ([], ["bf16/plain@few_rows"], r"--unset bf16/plain@few_rows: no such entry"),
])
def test_bad_variants_are_refused_by_name(sets, unsets, match):
    with pytest.raises(ValueError, match=match):
        variant_configs(committed_configs(), sets, unsets)


def test_cases_are_the_benchmarks():
    _, _, experts, top_k = SHAPES["kimi"]
    for case, num_experts in (("EP=1 balanced", experts), ("EP=2 skewed", experts // 2)):
        counts = case_counts("kimi", case)
        assert counts.numel() == num_experts and int(counts.sum()) == TOKENS_PER_GPU * top_k
    assert torch.equal(case_counts("glm", "8x4096"), torch.full((8,), 4096, dtype=torch.int64))


def test_compare_reports_changed_bits():
    """compare() runs fn under each config: outputs that follow the config are told apart."""
    committed = committed_configs()
    for variant, equal in (({"HALF_TILES": False}, True), ({"BK": 32}, False)):
        configs = {"committed": committed, "variant": {**committed, "bf16/plain": {**committed["bf16/plain"], **variant}}}
        fn = lambda: torch.tensor([gg._MM_CONFIGS["bf16/plain"]["BK"]])  # noqa: E731
        assert compare(fn, configs, rounds=1, rep_ms=1, bench=lambda f, rep_ms: (f(), 1.0)[1])["bits_equal"] is equal
    assert committed_configs() == committed, "the committed configs are restored"


def test_the_ab_runs_on_the_table_its_chip_reads(monkeypatch):
    """On a chip with a table of its own (here the H100, as if this process ran on one), the committed configs are
    that table's and a variant is installed into it, so that the launches meet it; _MM_CONFIGS stays as it was."""
    h100 = "NVIDIA H100 80GB HBM3"
    own = gg._CHIP_MM_CONFIGS[h100]
    monkeypatch.setattr(gg, "current_chip", lambda: h100)
    monkeypatch.setitem(gg._CHIP_MM_CONFIGS, h100, dict(own))  # the variant is installed into this copy
    base = dict(gg._MM_CONFIGS)
    committed = committed_configs()
    assert committed["mxfp8_ws/dual@few_rows"] == own["mxfp8_ws/dual@few_rows"] != base["mxfp8_ws/dual@few_rows"]
    configs = {"committed": committed,
               "variant": variant_configs(committed, ['mxfp8_ws/dual@few_rows={"STAGES": 2}'], [])}
    seen = []
    fn = lambda: torch.tensor([gg._mm_config("mxfp8_ws/dual", "few_rows", h100)["STAGES"]])  # noqa: E731
    compare(fn, configs, rounds=2, rep_ms=1, bench=lambda f, rep_ms: (seen.append(int(f())), 1.0)[1])
    assert sorted(seen) == [2, 2, 3, 3], "each side's rounds ran on its own config"
    assert committed_configs() == committed and gg._MM_CONFIGS == base


def test_compare_reports_median_and_range_per_config():
    """Each config's median round and its fastest and slowest, from the rounds that config ran."""
    committed = committed_configs()
    configs = {"committed": committed, "variant": {**committed, "bf16/plain": {**committed["bf16/plain"], "BK": 32}}}
    times = {64: iter([3.0, 1.0, 2.0]), 32: iter([5.0, 6.0, 4.0])}  # per config's BK, in its rounds' order
    rec = compare(lambda: torch.zeros(1), configs, rounds=3, rep_ms=1,
                  bench=lambda f, rep_ms: next(times[gg._MM_CONFIGS["bf16/plain"]["BK"]]))
    assert rec["committed_ms"] == 2.0 and rec["committed_range_ms"] == [1.0, 3.0]
    assert rec["variant_ms"] == 5.0 and rec["variant_range_ms"] == [4.0, 6.0]


def tracked_cpu_cases(made: list):
    """A Case factory on the CPU that keeps a weak reference to each case in made and fails if an earlier case is
    still alive when the next one is built."""
    import weakref

    from titan_mok.bench.grouped_ffn import Case

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

    from titan_mok.bench import config_ab
    from titan_mok.bench.grouped_ffn import Case

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
    """Every kind of grouped_mm reported (and no weight gradient: the variant leaves its loops), the
    bits kept by variants that only move tile shapes (the kernels' contract)."""
    rows = _run_tiny(monkeypatch, tmp_path, "--precision", "bf16", "--set", 'bf16/plain={"HALF_TILES": false}',
                     "--set", 'bf16/dual={"BN": 128}')
    assert [r["kind"] for r in rows] == [f"bf16/{k}" for k in ("swiglu", "plain", "swiglu_bwd", "dual")]
    assert all(r["bits_equal"] and r["committed_ms"] == r["variant_ms"] == 1.0 for r in rows)
    assert gg._MM_CONFIGS["bf16/dual"]["BN"] == 256, "the committed configs are restored"


def test_config_ab_runs_the_weight_gradients(monkeypatch, tmp_path):
    """A weight-gradient variant compares each weight's gradient under the loop the case runs (the
    tiny case's experts hold few rows: the flat loop), and only those."""
    committed = dict(gg._WGRAD_CONFIGS["flat"])
    rows = _run_tiny(monkeypatch, tmp_path, "--precision", "mxfp8", "--set", 'wgrad/flat={"num_stages": 2}')
    assert [r["kind"] for r in rows] == [f"wgrad/flat:{w}" for w in ("w_gate", "w_up", "w_down")]
    assert all(r["bits_equal"] for r in rows)
    assert gg._WGRAD_CONFIGS["flat"] == committed, "the committed configs are restored"


def test_each_case_is_released_before_the_next(monkeypatch, tmp_path):
    """Nothing holds a case's tensors once its GEMMs are done: on an 80 GB H100 a case kept alive by a loop
    variable bound to its last GEMM made the next case run out of memory."""
    made = []
    rows = _run_tiny(monkeypatch, tmp_path, "--precision", "bf16", "--set", 'wgrad/flat={"num_stages": 2}',
                     cases="EP=2 skewed,EP=2 balanced", make_case=tracked_cpu_cases(made))
    assert len(made) == 2 and len(rows) == 6


def test_mxfp8_kinds_are_keyed_by_their_configs():
    """The benchmark's GEMMs are keyed by the entries that pick their kernel on CUDA, so that config_ab and --tune
    vary the configs those GEMMs run."""
    from titan_mok.bench.grouped_ffn import TUNE_VARIANTS, Case, gemms_by_kind

    c = Case(128, 64, torch.tensor([5, 0, 9]), dev="cpu")
    keys = list(gemms_by_kind(c, "mxfp8"))
    assert keys == [f"mxfp8_ws/{k}" for k in ("swiglu", "plain", "swiglu_bwd", "dual")]
    assert all(k in gg._MM_CONFIGS and k in TUNE_VARIANTS for k in keys)
