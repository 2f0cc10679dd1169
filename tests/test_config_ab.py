"""bench.config_ab's config variants and cases (its timing needs a GPU; this is the CPU part)."""

import pytest
import torch

from titan_mok.bench.config_ab import case_counts, variant_configs
from titan_mok.bench.grouped_ffn import SHAPES, TOKENS_PER_GPU
from titan_mok.kernels import grouped_gemm as gg


def test_variant_merges_sets_and_unsets():
    committed = dict(gg._MM_CONFIGS)
    v = variant_configs(committed, ['bf16/plain={"HALF_TILES": false, "num_stages": 4}', "mxfp8_ws/plain=null",
                                    'bf16/dual@few_rows={"BM": 64}'], ["mxfp8_ws/dual@few_rows"])
    assert v["bf16/plain"] == {**committed["bf16/plain"], "HALF_TILES": False, "num_stages": 4}
    assert v["mxfp8_ws/plain"] is None and v["bf16/dual@few_rows"] == {"BM": 64}
    assert "mxfp8_ws/dual@few_rows" not in v
    assert committed == gg._MM_CONFIGS, "the committed configs are left as they were"


@pytest.mark.parametrize("sets, unsets, match", [
    (["bf16/plain"], [], r"--set 'bf16/plain': expected KEY=JSON"),
    (["bf16/plian={}"], [], r"--set bf16/plian: not an _MM_CONFIGS key"),
    (["bf16/plain@slow={}"], [], r"--set bf16/plain@slow: not an _MM_CONFIGS key"),
    (["bf16/plain={BM: 64}"], [], r"--set bf16/plain: '\{BM: 64\}' is not JSON"),
    (["bf16/plain=64"], [], r"--set bf16/plain: the value must be a JSON object or null"),
    ([], ["bf16/plain@few_rows"], r"--unset bf16/plain@few_rows: no such entry"),
])
def test_bad_variants_are_refused_by_name(sets, unsets, match):
    with pytest.raises(ValueError, match=match):
        variant_configs(dict(gg._MM_CONFIGS), sets, unsets)


def test_cases_are_the_benchmarks():
    _, _, experts, top_k = SHAPES["kimi"]
    for case, num_experts in (("EP=1 balanced", experts), ("EP=2 skewed", experts // 2)):
        counts = case_counts("kimi", case)
        assert counts.numel() == num_experts and int(counts.sum()) == TOKENS_PER_GPU * top_k
    assert torch.equal(case_counts("glm", "8x4096"), torch.full((8,), 4096, dtype=torch.int64))
