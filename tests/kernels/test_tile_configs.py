"""tile_configs: the frozen per-chip tables and select, the one place that picks a grouped GEMM's kernel and config
(the kernels' bits under each choice: tests/kernels/test_grouped_ffn.py)."""

import dataclasses
import logging

import pytest
import torch

from titan_mok.kernels import tile_configs as tc
from titan_mok.kernels.grouped_ffn import grouped_swiglu_ffn, selections

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
KIMI = dict(n=2048, k=7168)  # gate/up's [E, I, H] at Kimi K2.7's size (w_down's: n and k swapped)


def test_rows_tiers():
    """The experts' average rows pick the grouped_mm tier: few_rows up to 64, many_rows from 2048."""
    assert [tc.tier_of(r, tc.H200) for r in (0, 64, 64.25, 2047.75, 2048, 10**5)] == \
        ["few_rows", "few_rows", "mid_rows", "mid_rows", "many_rows", "many_rows"]


def test_each_tier_reads_its_own_entry():
    """A tier's entry, on CUDA its kernel and config, on Triton's interpreter (chip None) its Triton config."""
    for key, entry in tc.H200.mm.items():
        precision, kind_tier = key.split("/")
        kind, tier = kind_tier.split("@")
        rows = {"few_rows": 40, "mid_rows": 85, "many_rows": 4096}[tier]
        on_gpu = tc.select(kind, precision, rows, H200, **KIMI)
        assert on_gpu == (entry.cuda.KERNEL, entry.cuda, key), key
        assert tc.select(kind, precision, rows, None, **KIMI) == ("triton", entry.triton, key), key


def test_the_committed_kernels():
    """MXFP8 runs the warp-specialized kernel in every kind and tier; bf16 the Triton kernel but for the SwiGLU
    backward past few rows (and, on the H100, the forward at many rows on the cooperative kernel)."""
    for chip in (H200, H100):
        table = tc.table_for(chip)
        for key, entry in table.mm.items():
            if key.startswith("mxfp8/"):
                want = "warp_specialized"
            elif key in ("bf16/swiglu_bwd@mid_rows", "bf16/swiglu_bwd@many_rows"):
                want = "warp_specialized"
            elif chip == H100 and key in ("bf16/plain@many_rows", "bf16/swiglu@many_rows"):
                want = "cooperative"
            else:
                want = "triton"
            assert entry.cuda.KERNEL == want, (chip, key)


def test_a_chip_reads_its_own_table():
    """The H100 reads its table, any other chip and the interpreter the H200's; the H100's differs in the MXFP8 ring
    slots, the bf16 forward at many rows (cooperative; plain's Triton config persistent) and the weight gradient's
    64-row steps from 80 rows per expert (Kimi K2.7 and Qwen3.5 at EP=2), the others' from 128."""
    assert tc.table_for(H100) is tc.H100
    assert tc.table_for(H200) is tc.table_for("NVIDIA B200") is tc.table_for(None) is tc.H200 is tc.DEFAULT
    changed = sorted(key for key in tc.H100.mm if tc.H100.mm[key] != tc.H200.mm[key])
    assert changed == ["bf16/plain@many_rows", "bf16/swiglu@many_rows", "mxfp8/dual@few_rows", "mxfp8/plain@few_rows",
                       "mxfp8/swiglu@few_rows", "mxfp8/swiglu@many_rows", "mxfp8/swiglu@mid_rows"]
    assert tc.H100.mm["bf16/plain@many_rows"].triton.PERSISTENT
    assert all(tc.H100.mm[key].cuda.STAGES == 3 for key in changed if key.startswith("mxfp8/"))
    assert dict(tc.H100.wgrad) == dict(tc.H200.wgrad)
    assert {k: v for k, v in tc.H100.thresholds().items() if tc.H200.thresholds()[k] != v} == {"wgrad_long_steps": 80}
    loops = {(chip, rows): tc.select("wgrad", "bf16", rows, chip, **KIMI).key for chip in (H100, H200)
             for rows in (64, 80, 85, 128)}
    assert [loops[H100, r] for r in (64, 80, 85, 128)] == ["wgrad/flat_ws"] + ["wgrad/flat_ws_long"] * 3
    assert [loops[H200, r] for r in (64, 80, 85, 128)] == ["wgrad/flat_ws"] * 3 + ["wgrad/flat_ws_long"]
    assert tc.chip_of(torch.zeros(1)) is None


def test_weight_gradient_follows_rows_per_expert():
    """On CUDA the warp-specialized kernel from wgrad_ws rows per expert on, and below it for a gradient with more
    features than K columns (w_down's); 64-row steps from wgrad_long_steps; the row loop from wgrad_rows_loop. The
    Triton flat loop otherwise and on the interpreter (its row loop from wgrad_rows_loop)."""
    t = tc.H200
    rows = [t.wgrad_ws - 1, t.wgrad_ws, t.wgrad_long_steps - 1, t.wgrad_long_steps, t.wgrad_rows_loop - 1,
            t.wgrad_rows_loop]
    w_gate, w_down = (2048, 7168), (7168, 2048)

    def keys(chip, n_k):
        return [tc.select("wgrad", "mxfp8", r, chip, n=n_k[0], k=n_k[1]).key.removeprefix("wgrad/") for r in rows]

    ws = ["flat_ws", "flat_ws_long", "flat_ws_long", "rows_ws"]
    assert keys(H200, w_gate) == ["flat", "flat_ws", *ws]
    assert keys(H200, w_down) == ["flat_ws", "flat_ws", *ws]
    for n_k in (w_gate, w_down):
        assert keys(None, n_k) == ["flat"] * 5 + ["rows"]
    assert tc.select("wgrad", "bf16", 600, H200, **KIMI).kernel == "warp_specialized"
    assert tc.select("wgrad", "bf16", 600, None, **KIMI).kernel == "triton"


def test_cuda_falls_back_to_triton_where_its_kernel_cannot_read_the_operands():
    """The warp-specialized kernel loads K in blocks of 128: another K runs the entry's Triton config; the
    cooperative one reads contiguous [E, N, K] weights and stores rows of N a multiple of 8 bf16."""
    entry = tc.H200.mm["mxfp8/plain@mid_rows"]
    assert tc.select("plain", "mxfp8", 70, H200, n=64, k=128).config == entry.cuda
    assert tc.select("plain", "mxfp8", 70, H200, n=64, k=96) == ("triton", entry.triton, "mxfp8/plain@mid_rows")
    coop = tc.H100.mm["bf16/plain@many_rows"]
    assert tc.select("plain", "bf16", 4096, H100, n=32, k=100).config == coop.cuda  # any K
    for n, contiguous in ((32, False), (36, True)):
        assert tc.select("plain", "bf16", 4096, H100, n=n, k=128, contiguous=contiguous).config == coop.triton


def test_two_weight_row_blocks_need_contiguous_weights():
    """ROW_BLOCKS = 2 reads the next 128 rows of a contiguous [E, N, K]: a transposed view gets one row block."""
    cfg = tc.H200.mm["mxfp8/dual@mid_rows"].cuda
    assert cfg.ROW_BLOCKS == 2
    assert tc.select("dual", "mxfp8", 85, H200, **KIMI).config == cfg
    assert tc.select("dual", "mxfp8", 85, H200, contiguous=False, **KIMI).config == dataclasses.replace(cfg,
                                                                                                        ROW_BLOCKS=1)


def test_tables_are_frozen():
    with pytest.raises(TypeError):
        tc.H200.mm["bf16/plain@mid_rows"] = tc.H200.mm["bf16/dual@mid_rows"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        tc.H200.few_rows = 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        tc.H200.mm["bf16/plain@mid_rows"].cuda.BM = 64
    with pytest.raises(TypeError):
        tc.TABLES["NVIDIA H200"] = tc.H100


def test_replace_makes_a_new_table_and_keeps_the_committed_one():
    small = tc.GluonMM(BM=64, PERSISTENT=True, STAGES=2, CONSUMER_REGS=232)
    entry = tc.MMEntry(tc.H200.mm["mxfp8/plain@mid_rows"].triton, small)
    variant = tc.H200.replace(mm={"mxfp8/plain@mid_rows": entry}, few_rows=32)
    assert variant.mm["mxfp8/plain@mid_rows"] == entry and variant.few_rows == 32
    assert tc.H200.mm["mxfp8/plain@mid_rows"].cuda.BM == 128 and tc.H200.few_rows == 64
    assert tc.select("plain", "mxfp8", 50, H200, table=variant, **KIMI).config == small  # 50 rows: mid at 32


@pytest.mark.parametrize("make, match", [
    (lambda: tc.H200.replace(mm={"bf16/dual@mid_rows": tc.MMEntry(tc.H200.mm["bf16/dual@mid_rows"].triton,
                                                                  tc.H100.mm["bf16/plain@many_rows"].cuda)}),
     r"bf16/dual@mid_rows: the cooperative kernel runs the plain and SwiGLU gate/up kinds only"),
    (lambda: tc.H200.replace(mm={"mxfp8/swiglu@mid_rows": tc.MMEntry(
        tc.H200.mm["mxfp8/swiglu@mid_rows"].triton, tc.H200.mm["mxfp8/plain@mid_rows"].cuda)}),
     r"mxfp8/swiglu@mid_rows: ROW_BLOCKS = 2 is for the one-weight kinds"),
    (lambda: dataclasses.replace(tc.H200, mm={k: v for k, v in tc.H200.mm.items() if k != "bf16/plain@few_rows"}),
     r"ChipTable.mm: missing \['bf16/plain@few_rows'\]"),
    (lambda: tc.H200.replace(wgrad={"flat": tc.H200.wgrad["flat_ws"]}), r"wgrad/flat: must run the flat loop on "
                                                                        r"the Triton kernel"),
    (lambda: tc.H200.replace(wgrad={"rows_ws": tc.H200.wgrad["flat_ws"]}), r"wgrad/rows_ws: must run the rows loop"),
    (lambda: tc.H200.replace(few_rows=4096), r"rows thresholds out of order"),
    (lambda: tc.TritonMM(BM=64, BN=128, BK=64, num_warps=4, num_stages=3, HALF_TILES=True), r"HALF_TILES needs BM >= 128"),
    (lambda: tc.GluonMM(BM=64, BN=64, PERSISTENT=True, STAGES=2, CONSUMER_REGS=232), r"takes BN = 128"),
    (lambda: tc.CoopMM(BM=64, BN=128, BK=64, STAGES=2, CONSUMER_REGS=232), r"takes BM = 128"),
])
def test_bad_tables_and_configs_are_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_select_arguments_are_named():
    with pytest.raises(ValueError, match=r"precision must be one of \('bf16', 'mxfp8'\), got 'fp8'"):
        tc.select("plain", "fp8", 10, None, **KIMI)
    with pytest.raises(ValueError, match=r"kind must be one of .*'wgrad'\), got 'gate'"):
        tc.select("gate", "bf16", 10, None, **KIMI)


def test_each_choice_is_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger=tc.__name__):
        tc.select("swiglu", "mxfp8", 42.5, H100, **KIMI)
    (record,) = caplog.records
    assert record.getMessage().startswith(f"swiglu mxfp8 at 42.5 rows per expert, N 2048, K 7168 on {H100}: "
                                          f"warp_specialized GluonMM(STAGES=3, CONSUMER_REGS=232, num_warps=4, BM=64,")


def test_selections_are_what_the_ffn_launches(monkeypatch):
    """grouped_ffn.selections lists the choices of exactly the launches of one forward and backward (here on the
    interpreter: every GEMM on the Triton kernel), in their order."""
    made, select = [], tc.select
    monkeypatch.setattr(tc, "select", lambda *args, **kwargs: made.append(select(*args, **kwargs)) or made[-1])
    dim_h, dim_i, counts = 64, 96, [5, 0, 37]
    for precision in ("bf16", "mxfp8"):
        made.clear()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(sum(counts), dim_h, generator=g).to(torch.bfloat16).requires_grad_()
        w_gate, w_up = (torch.randn(3, dim_i, dim_h, generator=g).to(torch.bfloat16).requires_grad_() for _ in "gu")
        w_down = torch.randn(3, dim_h, dim_i, generator=g).to(torch.bfloat16).requires_grad_()
        y = grouped_swiglu_ffn(x, torch.tensor(counts).cumsum(0), w_gate, w_up, w_down, precision=precision,
                               use_triton=True)
        y.backward(torch.ones_like(y))
        launches = list(made)
        listed = selections(precision, sum(counts) / len(counts), None, dim_h, dim_i)
        assert len(launches) == len(listed) == 7
        assert sorted(map(str, launches)) == sorted(map(str, listed.values()))
        assert listed["fwd down"].key == f"{precision}/plain@few_rows" and listed["wgrad w_down"].key == "wgrad/flat"
    text = "\n".join(f"{gemm}: {sel}" for gemm, sel in selections("mxfp8", 85, H200, 7168, 2048).items())
    assert "dgrad gate/up: mxfp8/dual@mid_rows: warp_specialized GluonMM(STAGES=3, CONSUMER_REGS=232" in text
