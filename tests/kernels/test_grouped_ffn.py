"""Seam #2: grouped_swiglu_ffn — Triton path vs the PyTorch reference, determinism, invariance.

CPU: Triton's interpreter at tiny sizes. GPU (``-m gpu``): Kimi-sized experts.
Tolerances (relative Frobenius error vs the reference on the same quantized operand values):
1e-2 for every output and gradient — both paths multiply identical operands with fp32
accumulation, so what remains is the summation order and the rounding of bf16
intermediates (g, u, h, dgate, dup), which can flip an occasional MXFP8 element downstream.
"""

import dataclasses

import pytest
import torch

from titan_mok.kernels import grouped_gemm as gg
from titan_mok.kernels import grouped_mm_ws
from titan_mok.kernels import tile_configs as tc
from titan_mok.kernels.grouped_ffn import grouped_swiglu_ffn, weight_operand
from titan_mok.kernels.grouped_gemm import grouped_mm, mxfp8_fake_quantize_groups
from titan_mok.kernels.mxfp8 import MXTensor, fake_quantize_mxfp8
from titan_mok.kernels.mxfp8_quant import mxfp8_quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("y", "dx", "dw_gate", "dw_up", "dw_down")


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def chip_table() -> tc.ChipTable:
    """The table this process's launches read: its GPU's, or on the CPU the default."""
    return tc.table_for(tc.chip_of(torch.zeros(1, device=DEVICE)))


def triton_only(table: tc.ChipTable) -> tc.ChipTable:
    """table with the Triton kernel everywhere: the definition the Gluon kernels are held to."""
    return table.replace(mm={key: tc.MMEntry(e.triton, e.triton) for key, e in table.mm.items()},
                         wgrad={"flat_ws": table.wgrad["flat"], "flat_ws_long": table.wgrad["flat"],
                                "rows_ws": table.wgrad["rows"]})


def use_table(monkeypatch, table: tc.ChipTable):
    """Launches given no table (the FFN's) read this one, on any chip."""
    monkeypatch.setattr(tc, "TABLES", {})
    monkeypatch.setattr(tc, "DEFAULT", table)


def launched(monkeypatch) -> list:
    """The tile_configs.Selection of each launch that follows, in order."""
    made, select = [], tc.select
    monkeypatch.setattr(tc, "select", lambda *args, **kwargs: made.append(select(*args, **kwargs)) or made[-1])
    return made


def make_case(counts, dim_h, dim_i, padding=0, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    num_rows = sum(counts) + padding
    x = torch.randn(num_rows, dim_h, generator=g)
    w_gate = torch.randn(len(counts), dim_i, dim_h, generator=g) / dim_h**0.5
    w_up = torch.randn(len(counts), dim_i, dim_h, generator=g) / dim_h**0.5
    w_down = torch.randn(len(counts), dim_h, dim_i, generator=g) / dim_i**0.5
    dy = torch.randn(num_rows, dim_h, generator=g)
    tensors = [t.to(torch.bfloat16).to(device) for t in (x, w_gate, w_up, w_down, dy)]
    group_end = torch.tensor(counts).cumsum(0).to(device)
    return tensors, group_end


def run(tensors, group_end, **kw):
    x, w_gate, w_up, w_down, dy = (t.detach().clone() for t in tensors)
    leaves = [t.requires_grad_() for t in (x, w_gate, w_up, w_down)]
    y = grouped_swiglu_ffn(leaves[0], group_end, *leaves[1:], **kw)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


# Tiny shapes: N < BN and K not a multiple of BK exercise the masks; an empty expert; padding rows.
CPU_CASE = dict(counts=[5, 0, 37], dim_h=64, dim_i=96, padding=3)


@pytest.mark.parametrize("group_end", [[5, 5, 42], [0, 45], [45], []],
                         ids=["padding", "empty_expert_no_padding", "no_padding", "no_experts"])
def test_padding_rows_are_zeroed_in_place(group_end):
    """grouped_mm's outputs start uninitialized: the padding rows (from group_end[-1] on; all rows without
    experts) become zero, past a row block's end and across column blocks; the grouped rows keep what the tiles
    wrote."""
    c = torch.full((45, 300), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    c[:20] = 1.0
    before = c.clone()
    out = gg._zero_padding_rows(c, torch.tensor(group_end, dtype=torch.int32, device=DEVICE))
    first = group_end[-1] if group_end else 0
    assert out is c and torch.equal(c[first:], torch.zeros_like(c[first:]))
    assert torch.equal(c[:first].view(torch.int16), before[:first].view(torch.int16))  # NaNs compared as bits


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_triton_matches_reference(precision, limit):
    tensors, group_end = make_case(**CPU_CASE)
    ref = run(tensors, group_end, precision=precision, swiglu_limit=limit, use_triton=False)
    tri = run(tensors, group_end, precision=precision, swiglu_limit=limit, use_triton=True)
    for name, a, b in zip(NAMES, tri, ref):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < 1e-2, f"{name}: rel err {rel_err(a, b):.2e}"
    assert torch.equal(tri[0][-3:], torch.zeros_like(tri[0][-3:])), "padding rows must be zero"
    assert torch.equal(tri[1][-3:], torch.zeros_like(tri[1][-3:])), "padding rows get no gradient"


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_triton_bitwise_run_to_run_and_row_invariant(precision):
    tensors, group_end = make_case(counts=[5, 0, 37], dim_h=64, dim_i=64)
    first = run(tensors, group_end, precision=precision, use_triton=True)
    again = run(tensors, group_end, precision=precision, use_triton=True)
    for name, a, b in zip(NAMES, first, again):
        assert torch.equal(a, b), f"{name} differs between two identical runs"
    # The same rows inside bigger groups (other rows before and after them): same bits.
    x, w_gate, w_up, w_down, dy = tensors
    g = torch.Generator().manual_seed(9)
    extra = [torch.randn(n, x.shape[1], generator=g).to(x) for n in (70, 3, 1, 29)]
    pieces_x = [extra[0], x[:5], extra[1], extra[2], x[5:], extra[3]]
    pieces_dy = [torch.randn_like(p) for p in pieces_x]
    pieces_dy[1], pieces_dy[4] = dy[:5], dy[5:]
    big = [torch.cat(pieces_x), w_gate, w_up, w_down, torch.cat(pieces_dy)]
    big_end = torch.tensor([70 + 5, 75 + 3 + 1, 79 + 37 + 29]).to(group_end)
    out = run(big, big_end, precision=precision, use_triton=True)
    rows = torch.cat([torch.arange(70, 75), torch.arange(79, 79 + 37)]).to(x.device)
    assert torch.equal(out[0][rows], first[0]), "y rows depend on the batch around them"
    assert torch.equal(out[1][rows], first[1]), "dx rows depend on the batch around them"


def test_token_axis_quantization_per_group_bits():
    """wgrad's operand form: 32-row blocks from each group's first row, the tail zero-padded."""
    (x, *_), group_end = make_case(counts=[5, 0, 70], dim_h=160, dim_i=32, padding=3)
    tri = mxfp8_fake_quantize_groups(x, group_end)
    for start, end in ((0, 5), (5, 75)):
        pad = -(end - start) % 32
        ref = fake_quantize_mxfp8(torch.nn.functional.pad(x[start:end], (0, 0, 0, pad)), 0)[: end - start]
        assert torch.equal(tri[start:end], ref.to(torch.bfloat16)), f"group rows {start}:{end}"


def test_wgrads_quantize_each_operand_once(monkeypatch):
    """MXFP8 weight gradients of pairs sharing an operand (the FFN's x serves two): one quantization
    per distinct operand, and each gradient the bits of grouped_wgrad on its pair alone."""
    (x, _, _, _, dy), group_end = make_case(counts=[5, 0, 37], dim_h=64, dim_i=32)
    g = torch.Generator().manual_seed(3)
    dgate, dup = (torch.randn(x.shape[0], 32, generator=g).to(x) for _ in range(2))
    pairs = [(dgate, x), (dup, x), (dy, x)]
    alone = [gg.grouped_wgrad(a, b, group_end, "mxfp8") for a, b in pairs]
    quantized = []
    quantize = gg.mxfp8_fake_quantize_groups
    monkeypatch.setattr(gg, "mxfp8_fake_quantize_groups", lambda t, ends: quantized.append(t) or quantize(t, ends))
    together = list(gg.grouped_wgrads(pairs, group_end, "mxfp8"))
    assert [id(t) for t in quantized] == [id(dgate), id(x), id(dup), id(dy)]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_weight_layouts(precision):
    """Weights are read by TMA: [E, N, K] contiguous and the transposed view of [E, K, N] give the
    same bits; any other layout is refused by name."""
    (x, w_gate, *_), group_end = make_case(counts=[5, 0, 37], dim_h=64, dim_i=96)
    if precision == "mxfp8":
        mx = mxfp8_quantize(w_gate, -1, "w_gate")  # [E, I, H] blocked along H
        as_kn = MXTensor(mx.data.transpose(1, 2).contiguous().transpose(1, 2), mx.scale, dim=2)
        every_other_row = MXTensor(mx.data[:, ::2], mx.scale[:, ::2], dim=2)
    else:
        mx, as_kn, every_other_row = w_gate, w_gate.transpose(1, 2).contiguous().transpose(1, 2), w_gate[:, ::2]
    assert torch.equal(grouped_mm(x, group_end, mx), grouped_mm(x, group_end, as_kn))
    with pytest.raises(ValueError, match="b1: a weight must be a contiguous"):
        grouped_mm(x, group_end, every_other_row)


def test_reference_backward_matches_autograd():
    """The reference's hand-written backward (bf16) against autograd through a plain fp32 loop."""
    tensors, group_end = make_case(counts=[7, 0, 25], dim_h=64, dim_i=32, device="cpu")
    ref = run(tensors, group_end, precision="bf16", swiglu_limit=0.5, use_triton=False)
    x, w_gate, w_up, w_down, dy = (t.float().requires_grad_() for t in tensors)
    starts = [0, 7, 7]
    ys = []
    for e, (start, end) in enumerate(zip(starts, group_end.tolist())):
        gate, up = x[start:end] @ w_gate[e].t(), x[start:end] @ w_up[e].t()
        h = torch.nn.functional.silu(gate.clamp(max=0.5)) * up.clamp(-0.5, 0.5)
        ys.append(h @ w_down[e].t())
    torch.cat(ys).backward(dy.detach())
    expect = [torch.cat(ys).detach(), x.grad, w_gate.grad, w_up.grad, w_down.grad]
    for name, a, b in zip(NAMES, ref, expect):
        assert rel_err(a, b) < 2e-2, f"{name}: rel err {rel_err(a, b):.2e}"


def test_mxfp8_reference_quantizes():
    tensors, group_end = make_case(counts=[7, 0, 25], dim_h=64, dim_i=32, device="cpu")
    bf16 = run(tensors, group_end, precision="bf16", use_triton=False)
    mx = run(tensors, group_end, precision="mxfp8", use_triton=False)
    for name, a, b in zip(NAMES, mx, bf16):
        assert 1e-3 < rel_err(a, b) < 0.1, f"{name}: mxfp8 vs bf16 rel diff {rel_err(a, b):.2e}"


def test_wgrad_loop_shapes_keep_bits(monkeypatch):
    """The weight gradient's loop shape (flat over K tiles and row blocks, or one K tile per
    program) and the split of K tiles among programs follow the shapes; the bits do not. (Both
    loops with one tile config: the interpreter's fp32 dots round per row block; the GPU's row
    blocks are test_wgrad_row_blocks_keep_bits_on_gpu.) Each also persistent: one program looping over
    the (features, K tiles) pairs."""
    flat = tc.DEFAULT.wgrad["flat"]
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randn(45, n, generator=g).to(torch.bfloat16).to(DEVICE) for n in (32, 3 * 128 + 16))
    group_end = torch.tensor([40, 40, 45]).to(DEVICE)
    outs = []
    for rows_loop, min_programs in ((10**6, 1), (10**6, 4), (10**6, 10**6), (0, 1)):
        # flat with 4, 2, 1 K tiles per program (3 output tiles of 4 K tiles each), then one K tile per program
        monkeypatch.setattr(gg, "_WGRAD_MIN_PROGRAMS", min_programs)
        for persistent in (False, True):  # persistent: interpreted, one program looping over every (n, p) pair
            loops = {loop: dataclasses.replace(flat, loop=loop, PERSISTENT=persistent) for loop in ("flat", "rows")}
            table = triton_only(tc.DEFAULT.replace(wgrad=loops, wgrad_ws=0, wgrad_long_steps=0,
                                                   wgrad_rows_loop=rows_loop))
            outs.append(gg.grouped_wgrad(a, b, group_end, "bf16", table=table))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert rel_err(outs[0], gg.ref_grouped_wgrad(a, b, group_end, "bf16")) < 1e-2
    assert torch.equal(outs[0][1], torch.zeros_like(outs[0][1])), "an expert with no rows gets a zero gradient"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_wgrad_row_blocks_keep_bits_on_gpu(monkeypatch):
    """On the GPU the flat loop (32-row blocks) and the row loop (64-row blocks, wider K tiles) give
    the same bits: each MMA step adds its rows to the accumulator 16 at a time, in order."""
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randn(2100, n, generator=g).to(torch.bfloat16).cuda() for n in (384, 1024 + 64))
    group_end = torch.tensor([300, 300, 1011, 2100]).cuda()  # an empty expert, partial row blocks
    outs = []
    for rows_loop in (10**6, 0):
        table = triton_only(chip_table()).replace(wgrad_ws=0, wgrad_long_steps=0, wgrad_rows_loop=rows_loop)
        outs.append(gg.grouped_wgrad(a, b, group_end, "bf16", table=table))
        assert table.wgrad["flat"].BR != table.wgrad["rows"].BR
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], gg.ref_grouped_wgrad(a, b, group_end, "bf16")) < 1e-2


# warp-specialized weight-gradient configs the GPU test holds to the Triton kernel's bits (besides the committed
# ones): 64-row MMA steps on 128-wide K tiles, 32-row steps on a two-slot ring with a one-warp storer
WGRAD_WS_RINGS = {"br64": tc.GluonWgrad(loop="flat", BR=64, BK=128, STAGES=4, CONSUMER_REGS=232, STORER_WARPS=2,
                                        STORER_REGS=64),
                  "br32_2": tc.GluonWgrad(loop="flat", BR=32, BK=128, STAGES=2, CONSUMER_REGS=232, STORER_WARPS=1,
                                          STORER_REGS=80)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("programs", ["per_sm", 3])
@pytest.mark.parametrize("ring", list(WGRAD_WS_RINGS) + ["flat_ws", "flat_ws_long"])
def test_warp_specialized_wgrad_matches_triton_bits(monkeypatch, ring, programs):
    """grouped_wgrad_ws gives the Triton flat loop's bits (each of its wgmmas adds rows 16 at a time, in order,
    whatever the row block): an empty expert, one-row and 129-row experts, partial feature and K tiles, a heavy
    expert whose K tiles the launcher splits among more programs; with a program
    per SM and with 3 programs looping over every job (the ring's phases carried across jobs and experts)."""
    base = chip_table()
    cfg = base.wgrad[ring] if ring in base.wgrad else WGRAD_WS_RINGS[ring]  # committed, or a variant
    assert cfg.KERNEL == "warp_specialized", f"the committed {ring} config does not run the Gluon kernel"
    if programs != "per_sm":
        monkeypatch.setattr(grouped_mm_ws, "sm_count", lambda device_index: programs)
    # every case on the flat loop, on the warp-specialized kernel with this config
    table = base.replace(wgrad={"flat_ws": cfg, "flat_ws_long": cfg}, wgrad_ws=0, wgrad_rows_loop=10**6)
    made = launched(monkeypatch)
    g = torch.Generator().manual_seed(11)
    for n, k, counts in ((192, 200, [1, 129, 0, 64]), (384, 1088, [300, 0, 711, 1089]), (2048, 1024, [85] * 20),
                         (256, 512, [3] * 30 + [700])):
        a, b = (torch.randn(sum(counts), d, generator=g).to(torch.bfloat16).cuda() for d in (n, k))
        group_end = torch.tensor(counts).cumsum(0).cuda()
        ref = gg.grouped_wgrad(a, b, group_end, "bf16", table=triton_only(table))
        assert torch.equal(gg.grouped_wgrad(a, b, group_end, "bf16", table=table), ref), (n, k, counts)
        assert made[-1].config == cfg and made[-2].kernel == "triton"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("programs", ["per_sm", 3])
def test_warp_specialized_wgrad_on_row_loop_programs_matches_triton_bits(monkeypatch, programs):
    """"rows_ws": grouped_wgrad_ws on the row loop's programs (one K tile each) gives the Triton row loop's bits:
    an empty expert, partial feature and K tiles, experts of 1 to 1711 rows."""
    if programs != "per_sm":
        monkeypatch.setattr(grouped_mm_ws, "sm_count", lambda device_index: programs)
    made = launched(monkeypatch)
    g = torch.Generator().manual_seed(12)
    for n, k, counts in ((384, 1088, [300, 0, 1711, 1089]), (2048, 1024, [700] * 3 + [1])):
        a, b = (torch.randn(sum(counts), d, generator=g).to(torch.bfloat16).cuda() for d in (n, k))
        group_end = torch.tensor(counts).cumsum(0).cuda()
        ref = gg.grouped_wgrad(a, b, group_end, "bf16", table=triton_only(chip_table()))
        assert made[-1].key == "wgrad/rows_ws" and made[-1].kernel == "triton"
        assert torch.equal(gg.grouped_wgrad(a, b, group_end, "bf16"), ref), (n, k, counts)
        assert made[-1].key == "wgrad/rows_ws" and made[-1].kernel == "warp_specialized"  # the committed config


def test_wgrad_of_experts_after_the_last_row_and_of_no_rows_is_zero():
    """Experts whose group end is the operands' end (their TMA descriptors start at the operands' first row,
    _wgrad_job) get zero gradients, and so does every expert when there are no rows at all."""
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randn(45, n, generator=g).to(torch.bfloat16).to(DEVICE) for n in (32, 48))
    out = gg.grouped_wgrad(a, b, torch.tensor([40, 45, 45, 45]).to(DEVICE), "bf16")
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert rel_err(out[:2], gg.ref_grouped_wgrad(a, b, torch.tensor([40, 45]).to(DEVICE), "bf16")) < 1e-2
    none = gg.grouped_wgrad(a[:0], b[:0], torch.zeros(3, dtype=torch.int32).to(DEVICE), "bf16")
    assert none.shape == (3, 32, 48) and torch.equal(none, torch.zeros_like(none))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warp_specialized_wgrad_heavy_experts_then_empty_ones():
    """Kimi K2.7's w_gate gradient ([I, H] = dgate^T @ x over 4,096 tokens' 32,768 rows) under the routing that
    stopped both wgrad kernels on an illegal memory access while an empty expert's TMA descriptors started at its
    group end: eight experts holding every row, then forty empty ones whose group end is the operands' end (freshly
    allocated, so nothing need be mapped after them). After a balanced call, each of several calls gives the Triton
    kernel's bits (the same programs)."""
    g = torch.Generator().manual_seed(13)
    rows, experts = 32768, 48
    a, b = (torch.randn(rows, d, generator=g).to(torch.bfloat16).cuda() for d in (2048, 7168))
    gg.grouped_wgrad(a, b, (torch.arange(1, experts + 1) * rows // experts).cuda(), "bf16")
    group_end = torch.tensor([rows // 8 * (e + 1) for e in range(8)] + [rows] * (experts - 8)).cuda()
    ref = gg.grouped_wgrad(a, b, group_end, "bf16", table=triton_only(chip_table()))
    for _ in range(5):
        assert torch.equal(gg.grouped_wgrad(a, b, group_end, "bf16"), ref)


def test_wgrad_needs_aligned_rows():
    """Each expert's rows are read through a TMA descriptor: features must fill 16-byte rows."""
    a, b = torch.zeros(6, 12, dtype=torch.bfloat16), torch.zeros(6, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"a_RN's rows must be 16-byte aligned .*\(6, 12\)"):
        gg.grouped_wgrad(a, b, torch.tensor([2, 6]), "bf16")


def test_bad_inputs():
    (x, w_gate, w_up, w_down, _), group_end = make_case(counts=[3, 5], dim_h=64, dim_i=32, device="cpu")
    with pytest.raises(ValueError, match="precision must be one of"):
        grouped_swiglu_ffn(x, group_end, w_gate, w_up, w_down, precision="fp8")
    with pytest.raises(ValueError, match="w_down_EHI must be"):
        grouped_swiglu_ffn(x, group_end, w_gate, w_up, w_down.transpose(1, 2))
    with pytest.raises(ValueError, match="group_end_E must be int32/int64"):
        grouped_swiglu_ffn(x, group_end.float(), w_gate, w_up, w_down)
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_swiglu_ffn(x, torch.tensor([5, 3]), w_gate, w_up, w_down)
    # TMA reads rows of 16-byte multiples: a hidden size of 60 bf16 elements (120 bytes) is refused by name
    odd = torch.randn(8, 60).to(torch.bfloat16)
    with pytest.raises(ValueError, match="a1: the TMA loads need .*multiple of 8 elements"):
        grouped_mm(odd, group_end, torch.randn(2, 32, 60).to(torch.bfloat16))


GPU_SHAPES = [  # (name, H, I, rows per expert): Kimi-sized experts, MoE-regime row counts
    ("kimi", 7168, 2048, [42, 0, 85, 128, 7, 64, 33, 1]),
    ("qwen", 4096, 1024, [300, 17, 40, 129]),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("name,dim_h,dim_i,counts", GPU_SHAPES)
def test_gpu_real_sizes(name, dim_h, dim_i, counts, precision):
    tensors, group_end = make_case(counts=counts, dim_h=dim_h, dim_i=dim_i, padding=5)
    limit = 10.0 if name == "kimi" else None
    ref = run(tensors, group_end, precision=precision, swiglu_limit=limit, use_triton=False)
    tri = run(tensors, group_end, precision=precision, swiglu_limit=limit, use_triton=True)
    again = run(tensors, group_end, precision=precision, swiglu_limit=limit, use_triton=True)
    for n, a, b, c in zip(NAMES, tri, ref, again):
        assert rel_err(a, b) < 1e-2, f"{name} {n}: rel err {rel_err(a, b):.2e}"
        assert torch.equal(a, c), f"{name} {n}: differs run to run"
    # Row invariance: the first expert's rows alone give the same bits.
    sub = [tensors[0][: counts[0]], *tensors[1:4], tensors[4][: counts[0]]]
    sub_end = torch.full_like(group_end, counts[0])
    alone = run(sub, sub_end, precision=precision, swiglu_limit=limit, use_triton=True)
    assert torch.equal(alone[0], tri[0][: counts[0]]) and torch.equal(alone[1], tri[1][: counts[0]])


# thresholds that put any rows per expert in the tier
_TIERS = {"mid_rows": dict(few_rows=0, many_rows=2**31), "few_rows": dict(few_rows=2**31, many_rows=2**31 + 1),
          "many_rows": dict(few_rows=-1, many_rows=0)}


def _tile_runs(monkeypatch, table, tensors, group_end, tiers, **kw):
    """Forward and backward on each rows tier's configs of table, whatever the rows: "mid_rows" the 128-token
    tiles, "few_rows" 64-token tiles (on the GPU two programs per SM for the MXFP8 dgrad kinds), "many_rows" (on
    the GPU 256-token tiles for the MXFP8 plain and dual kinds)."""
    runs = []
    made = launched(monkeypatch)
    for tier in tiers:
        use_table(monkeypatch, table.replace(**_TIERS[tier]))
        runs.append(run(tensors, group_end, use_triton=True, **kw))
        assert {sel.key.split("@")[-1] for sel in made if not sel.key.startswith("wgrad/")} == {tier}
        made.clear()
    return runs


@pytest.mark.parametrize("table", [tc.H200, tc.H100], ids=["H200", "H100"])
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_token_tile_keeps_bits(monkeypatch, precision, table):
    """The token tile follows the rows per expert; a row's bits must not (every kind of grouped_mm), on each chip's
    table. bf16's "@many_rows" configs are persistent: one program here, looping over every tile (the H100's plain
    kind on 128 x 256 tiles; the MXFP8 ones run the warp-specialized kernel: the GPU test below holds those)."""
    tensors, group_end = make_case(**CPU_CASE)
    base, *others = _tile_runs(monkeypatch, table, tensors, group_end, tuple(_TIERS), precision=precision,
                               swiglu_limit=0.5)
    for tier, other in zip(list(_TIERS)[1:], others):
        for name, a, b in zip(NAMES, base, other):
            assert torch.equal(a, b), f"{name}: the {tier} tiles give other bits than the 128-token ones"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[s[0] for s in GPU_SHAPES])
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_token_tile_keeps_bits_on_gpu(monkeypatch, precision, shape):
    """As above at real sizes in all three tiers: the MXFP8 kinds on the warp-specialized kernel
    (Qwen3.5's 300-row expert fills a 256-token tile and starts another)."""
    name, dim_h, dim_i, counts = shape
    tensors, group_end = make_case(counts=counts, dim_h=dim_h, dim_i=dim_i, padding=5)
    base, *others = _tile_runs(monkeypatch, chip_table(), tensors, group_end, tuple(_TIERS), precision=precision,
                               swiglu_limit=10.0)
    for tier, other in zip(list(_TIERS)[1:], others):
        for n, a, b in zip(NAMES, base, other):
            assert torch.equal(a, b), f"{name} {n}: the {tier} tiles give other bits than the 128-token ones"


def _half_tile_runs(monkeypatch, tensors, group_end, **kw):
    """Forward and backward on 128-token tiles, the Triton kernel's configs without and with
    HALF_TILES (a tile holding at most 64 of its expert's rows runs 64-row MMAs)."""
    def half_tiles(cfg, half):
        return dataclasses.replace(cfg, HALF_TILES=half) if isinstance(cfg, tc.TritonMM) and cfg.BM >= 128 else cfg

    runs = []
    for half in (False, True):
        table = chip_table()
        mm = {key: tc.MMEntry(half_tiles(e.triton, half), half_tiles(e.cuda, half)) for key, e in table.mm.items()}
        use_table(monkeypatch, table.replace(mm=mm, few_rows=0))  # never "few rows": BM stays 128
        runs.append(run(tensors, group_end, use_triton=True, **kw))
    return runs


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_half_tiles_keep_bits(monkeypatch, precision):
    """A row's bits do not follow HALF_TILES: experts of 5 and 37 rows (half tiles only), 150 rows
    (a full tile, then a half one), an empty expert, padding rows."""
    tensors, group_end = make_case(counts=[5, 0, 37, 150], dim_h=64, dim_i=96, padding=3)
    full, half = _half_tile_runs(monkeypatch, tensors, group_end, precision=precision, swiglu_limit=0.5)
    for name, a, b in zip(NAMES, full, half):
        assert torch.equal(a, b), f"{name}: HALF_TILES changes the bits"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_half_tiles_keep_bits_on_gpu(monkeypatch):
    """As above at Kimi's sizes with skewed counts (1 to 300 rows per expert), bf16 (the MXFP8 kinds
    run the warp-specialized kernel on the GPU)."""
    counts = [1, 300, 64, 65, 0, 17, 129, 200]
    tensors, group_end = make_case(counts=counts, dim_h=7168, dim_i=2048, padding=5)
    full, half = _half_tile_runs(monkeypatch, tensors, group_end, precision="bf16", swiglu_limit=10.0)
    for n, a, b in zip(NAMES, full, half):
        assert torch.equal(a, b), f"{n}: HALF_TILES changes the bits"


WEIGHT_LAYOUTS = ("mma", "index", "kn")


def _mx_kinds(counts, dim_h, dim_i, layout, wide=False):
    """Inputs of the four kinds of MXFP8 grouped_mm at these sizes: {kind: (mode, a1, a2, b1, b2, outs, gu)}.
    layout: the weights as weight_operand gives them ("mma": contiguous [E, N, K], MMA order), contiguous
    [E, N, K] in index order ("index"), or the dgrad weights as transposed views of contiguous [E, K, N] in
    index order ("kn"; the forward ones as "index"); bf16 weights as weight_operand gives them ("bf16": the
    dgrad ones transposed views) or all contiguous [E, N, K] ("bf16_index"). wide: expert 0's weights times 2^20 (scales above 2^7)
    and a NaN in each of expert 1's (a NaN-scale block)."""
    (x, w_gate, w_up, w_down, dy), group_end = make_case(counts=counts, dim_h=dim_h, dim_i=dim_i, padding=5)
    if wide:
        for w in (w_gate, w_up, w_down):
            w[0] *= 2.0**20
            w[1, 3, 5] = float("nan")
    g = torch.Generator().manual_seed(1)
    rows = x.shape[0]
    g_, u_, h, dg, du = (torch.randn(rows, dim_i, generator=g).mul(3).to(torch.bfloat16).to(DEVICE) for _ in range(5))

    def fwd(w):  # [E, N, K] blocked along K
        if layout.startswith("bf16"):
            return w
        return weight_operand(w, "mxfp8", 2, "w") if layout == "mma" else mxfp8_quantize(w, 2, "w")

    def dgrad(w):  # [E, X, Y] -> [E, Y, X] blocked along X
        if layout.startswith("bf16"):
            return w.transpose(1, 2).contiguous() if layout == "bf16_index" else weight_operand(w, "bf16", 1, "w")
        if layout == "mma":
            return weight_operand(w, "mxfp8", 1, "w")
        m = mxfp8_quantize(w, 1, "w")
        if layout == "kn":
            return MXTensor(m.data.transpose(1, 2), m.scale.transpose(1, 2), dim=2)
        return MXTensor(m.data.transpose(1, 2).contiguous(), m.scale.transpose(1, 2), dim=2)

    def out(n, k=1):
        return [torch.zeros(rows, n, dtype=torch.bfloat16, device=DEVICE) for _ in range(k)]

    return group_end, {
        "plain": (gg.PLAIN, h, None, fwd(w_down), None, lambda: out(dim_h), (None, None)),
        "swiglu": (gg.SWIGLU, x, None, fwd(w_gate), fwd(w_up), lambda: out(dim_i, 3), (None, None)),
        "swiglu_bwd": (gg.SWIGLU_BWD, dy, None, dgrad(w_down), None, lambda: out(dim_i, 2), (g_, u_)),
        "dual": (gg.DUAL, dg, du, dgrad(w_gate), dgrad(w_up), lambda: out(dim_h), (None, None)),
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("programs", ["per_sm", 3])
@pytest.mark.parametrize("rings", ["committed", "small", "half", "split", "row_blocks"])
@pytest.mark.parametrize("layout", ["mma", "index", "kn", "bf16", "bf16_index"])
def test_warp_specialized_matches_triton_bits(monkeypatch, layout, rings, programs):
    """The Gluon warp-specialized kernel gives the Triton kernel's bits, MXFP8 and bf16, for every kind, every weight
    layout, an empty expert, partial N tiles and padding rows; with the committed configs and with 64-token tiles
    and a two-load ring (every kind persistent); with a program per SM (here one tile each) and with 3 programs
    looping over all tiles (the ring's phases carried across tiles). Kinds whose K is not a multiple of 128 fall
    back to the Triton kernel (but on the cooperative kernel). "half": every config with HALF_TILES and without
    SPLIT_TILES (tiles holding at most BM / 2 of their expert's rows on BM / 2-token MMAs). "split": every config
    with both (tiles of 65-96 rows on 64 + 32-token MMAs at BM 128: 70 and 72-row tiles here). "row_blocks": the committed configs with every case on the 128-token ones (no "@few_rows" tier), so
    that plain's and dual's ROW_BLOCKS = 2 (two 128-row blocks of the weight per tile) meet case 3's N = 704, a
    second block partly and wholly past N (the committed ring meets it on plain's 64-token tiles)."""
    small = tc.GluonMM(BM=64, PERSISTENT=True, STAGES=2, CONSUMER_REGS=232)
    if programs != "per_sm":
        monkeypatch.setattr(grouped_mm_ws, "sm_count", lambda device_index: programs)
    precision = "bf16" if layout.startswith("bf16") else "mxfp8"
    base = chip_table()

    def variant(key, entry):
        """The ring's config for this entry on CUDA (the Triton kernel's where there is none to test)."""
        # a kind that runs the Triton kernel but at many rows (bf16): its "@many_rows" config on these few rows
        committed = next((e.cuda for e in (entry, base.mm[key.split("@")[0] + "@many_rows"])
                          if not isinstance(e.cuda, tc.TritonMM)), None)
        ws = isinstance(committed, tc.GluonMM)  # (grouped_mm_coop: no half tiles)
        cfg = {"committed": committed, "small": small, "row_blocks": committed,
               **({"half": dataclasses.replace(committed, HALF_TILES=True, SPLIT_TILES=False),
                   "split": dataclasses.replace(committed, HALF_TILES=True, SPLIT_TILES=True)} if ws else {})}
        return tc.MMEntry(entry.triton, cfg.get(rings) or entry.triton)

    # "@few_rows" too: case 2 has few rows; "row_blocks": no few rows
    table = base.replace(mm={key: variant(key, e) for key, e in base.mm.items() if key.startswith(precision + "/")},
                         **({"few_rows": 0} if rings == "row_blocks" else {}))
    made = launched(monkeypatch)
    # (H, I, rows per expert, kinds whose K = H or I is a multiple of 128)
    cases = ((512, 256, [70, 0, 200], set(tc.MM_KINDS)),
             (1024, 192, [1, 129, 0, 64], {"swiglu", "swiglu_bwd"}),  # N = I = 192: a partial N tile
             (704, 256, [33, 0, 150], {"plain", "dual"}))  # N = H = 704: a partial N tile
    for dim_h, dim_i, counts, runs in cases:
        group_end, kinds = _mx_kinds(counts, dim_h, dim_i, layout)
        for kind, (mode, a1, a2, b1, b2, outs, gu) in kinds.items():
            ref, ws = outs(), outs()
            kw = dict(gu=gu, swiglu_limit=7.0)
            gg._launch_mm(mode, a1, a2, b1, b2, group_end, ws, table=table, **kw)
            picked = made[-1]
            if table.mm[picked.key].cuda is table.mm[picked.key].triton:
                continue  # this tier runs the Triton kernel: nothing to compare
            if kind not in runs and isinstance(table.mm[picked.key].cuda, tc.GluonMM):
                assert picked.kernel == "triton", f"{kind}: K not a multiple of 128 must fall back to Triton"
                continue
            assert picked.kernel != "triton", picked
            gg._launch_mm(mode, a1, a2, b1, b2, group_end, ref, table=triton_only(table), **kw)
            n = sum(counts)
            for r, w in zip(ref, ws):
                assert torch.equal(r[:n], w[:n]), f"{kind} (H={dim_h}, I={dim_i}): warp-specialized bits differ"


# the H100's cooperative configs, on any chip here
COOPERATIVE_KINDS = {kind: tc.H100.mm[f"bf16/{kind}@many_rows"].cuda for kind in ("plain", "swiglu")}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", list(COOPERATIVE_KINDS))
@pytest.mark.parametrize("programs", ["per_sm", 3])
def test_cooperative_matches_triton_bits(monkeypatch, kind, programs):
    """The cooperative kernel (grouped_mm_coop) gives the Triton kernel's bits for the plain and SwiGLU gate/up kinds,
    twice: 64-row tile halves whole (TMA stores) and cut by their expert's last row (masked stores: 300 and 129
    rows), an empty expert, a partial N tile (N = 704 and 448), K not a multiple of 128 (448 and 704), padding rows;
    one program per SM and 3 looping over all tiles; SwiGLU with and without its limit."""
    if programs != "per_sm":
        monkeypatch.setattr(grouped_mm_ws, "sm_count", lambda device_index: programs)
    base = chip_table()
    table = base.replace(mm={f"bf16/{kind}@{tier}": tc.MMEntry(base.mm[f"bf16/{kind}@{tier}"].triton,
                                                                COOPERATIVE_KINDS[kind]) for tier in tc.TIERS})
    made = launched(monkeypatch)
    counts = [300, 0, 64, 1000, 129]
    group_end, kinds = _mx_kinds(counts, 704, 448, "bf16")
    mode, a1, a2, b1, b2, outs, gu = kinds[kind]
    n = sum(counts)
    for limit in ((None, 7.0) if kind == "swiglu" else (None,)):
        ref, coop, again = outs(), outs(), outs()
        gg._launch_mm(mode, a1, a2, b1, b2, group_end, ref, swiglu_limit=limit, table=triton_only(table))
        for out in (coop, again):
            gg._launch_mm(mode, a1, a2, b1, b2, group_end, out, swiglu_limit=limit, table=table)
            assert made[-1].kernel == "cooperative"
        for r, c, c2 in zip(ref, coop, again):
            assert r[:n].abs().amax() > 0
            assert torch.equal(r[:n], c[:n]), f"{kind}: cooperative kernel's bits differ from the Triton kernel's"
            assert torch.equal(c, c2), f"{kind}: cooperative kernel's bits differ run to run"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", WEIGHT_LAYOUTS)
def test_warp_specialized_wide_scales_keep_bits(layout):
    """Experts whose scales pass 2^7 (a second multiply in the warp-specialized kernel's dequantization) and
    NaN-scale blocks give the Triton kernel's bits, NaNs included (compared as int16), beside a plain expert."""
    group_end, kinds = _mx_kinds([70, 40, 200], 512, 256, layout, wide=True)
    for kind, (mode, a1, a2, b1, b2, outs, gu) in kinds.items():
        ref, ws = outs(), outs()
        for out, table in ((ref, triton_only(chip_table())), (ws, None)):
            gg._launch_mm(mode, a1, a2, b1, b2, group_end, out, gu=gu, swiglu_limit=7.0, table=table)
        assert ref[0][:70].abs().max() > 2.0**15, kind  # expert 0's outputs carry its 2^20
        assert ref[0][70:110].isnan().any(), kind
        for r, w in zip(ref, ws):
            assert torch.equal(r.view(torch.int16), w.view(torch.int16)), f"{kind}: warp-specialized bits differ"


def test_mma_order_keeps_bits():
    """Weights in MMA order (weight_operand's) give the bits of the same weights in index order, every kind (the
    Triton kernel here; on the GPU the warp-specialized one is held to it by the tests above)."""
    group_end, mma = _mx_kinds([5, 0, 37], 128, 64, "mma", wide=True)
    _, index = _mx_kinds([5, 0, 37], 128, 64, "index", wide=True)
    for kind, (mode, a1, a2, b1, b2, outs, gu) in mma.items():
        assert b1.mma_order and not index[kind][3].mma_order
        got, want = outs(), outs()
        triton = triton_only(chip_table())
        gg._launch_mm(mode, a1, a2, b1, b2, group_end, got, gu=gu, swiglu_limit=7.0, table=triton)
        _, _, _, i1, i2, _, _ = index[kind]
        gg._launch_mm(mode, a1, a2, i1, i2, group_end, want, gu=gu, swiglu_limit=7.0, table=triton)
        for g, w in zip(got, want):
            assert torch.equal(g.view(torch.int16), w.view(torch.int16)), f"{kind}: MMA order changes the bits"


def test_mma_order_is_refused_where_it_cannot_be_read():
    """MMA order is defined on contiguous [E, N, K]: a transposed view is refused by name, as is a pair of weights
    in different orders."""
    (x, w_gate, w_up, w_down, _), group_end = make_case(counts=[3, 5], dim_h=128, dim_i=128, device="cpu")
    c = torch.zeros(8, 128, dtype=torch.bfloat16)
    mma = weight_operand(w_down, "mxfp8", 2, "w")
    mma_kn = MXTensor(mma.data.transpose(1, 2).contiguous().transpose(1, 2), mma.scale, dim=2, mma_order=True)
    with pytest.raises(ValueError, match="MMA order .* must be a contiguous"):
        gg._launch_mm(gg.PLAIN, x, None, mma_kn, None, group_end, [c])
    with pytest.raises(ValueError, match="both be in MMA order"):
        gg._launch_mm(gg.SWIGLU, x, None, weight_operand(w_gate, "mxfp8", 2, "w"), mxfp8_quantize(w_up, 2, "w"),
                      group_end, [c, c.clone(), c.clone()])


def test_wide_scale_experts_flags_scales_past_2_pow_7():
    """The per-expert flag of the warp-specialized kernel's second multiply: set where any B operand's E8M0
    bits pass 134 (2^7), the NaN scale 0xFF included, from either of two operands."""
    bits = torch.full((4, 3, 2), 127, dtype=torch.uint8)
    bits[1, 2, 1], bits[2, 0, 0], bits[3, 1, 1] = 134, 135, 255
    assert gg._wide_scale_experts(bits).tolist() == [0, 0, 1, 1]
    other = torch.full((4, 3, 2), 100, dtype=torch.uint8)
    other[0, 0, 0] = 200
    assert gg._wide_scale_experts(bits, other).tolist() == [1, 0, 1, 1]


@pytest.mark.parametrize("counts", [[45, 0, 3], [4000, 0, 1, 1, 1], [0, 0, 0, 0], [70] * 8 + [3000], [1] * 30 + [10**4]])
def test_wgrad_programs_cover_every_k_tile_once(counts):
    """The weight gradient's programs per expert (heavier experts: fewer K tiles per program) stay
    within the launch's bound and give every (expert, K tile) exactly one program."""
    group_end = torch.tensor(counts).cumsum(0)
    rows = sum(counts) + 7  # padding rows
    for flat, k_tiles in ((True, 56), (True, 3), (False, 12)):
        prog_end, per_prog, bound = gg._wgrad_programs(group_end, rows, 32, 16, k_tiles, flat)
        assert prog_end[-1] <= bound
        starts = torch.cat([prog_end.new_zeros(1), prog_end[:-1]])
        for e in range(len(counts)):
            firsts = [(p - starts[e]) * per_prog[e] for p in range(starts[e], prog_end[e])]
            tiles = [t for f in firsts for t in range(f, min(f + per_prog[e], k_tiles))]
            assert tiles == list(range(k_tiles)), f"expert {e}: K tiles {tiles}"


def test_wgrad_skewed_split_keeps_bits(monkeypatch):
    """One heavy expert (its K tiles split among more programs) and light ones: the same bits as one
    program per expert walking all K tiles."""
    g = torch.Generator().manual_seed(4)
    a, b = (torch.randn(300, n, generator=g).to(torch.bfloat16).to(DEVICE) for n in (32, 4 * 128))
    group_end = torch.tensor([3, 3, 290, 300]).to(DEVICE)
    outs = []
    for min_programs in (1, 10**6):  # P = 4 K tiles (the heavy expert: 1 per program); P = 1 for all
        monkeypatch.setattr(gg, "_WGRAD_MIN_PROGRAMS", min_programs)
        outs.append(gg.grouped_wgrad(a, b, group_end, "bf16"))
    monkeypatch.setattr(gg, "_WGRAD_MIN_PROGRAMS", 1)
    assert gg._wgrad_programs(group_end, 300, 32, 1, 4, True)[1].tolist() == [4, 4, 1, 4]
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], gg.ref_grouped_wgrad(a, b, group_end, "bf16")) < 1e-2
