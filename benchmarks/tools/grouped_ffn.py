"""Benchmark: routed-expert grouped GEMMs (kernels/grouped_ffn.py) against torch's grouped GEMMs, with roofline floors.

    python3 -m benchmarks.tools.grouped_ffn [--out DIR] [--quick] [--tune] [--regime all|moe|compute] [--rounds N]
        [--shapes kimi,glm,qwen,deepseek] [--impls ...] [--compute-case 8x4096]

Regimes (issue 6): the MoE regime — each shape's expert GEMMs at 2048 tokens/GPU × top-k rows over
the local experts at EP=1 and EP=2, balanced and skewed routing — and the compute regime — 8
experts × 4096 rows at each shape's H and I (``--compute-case EXPERTSxROWS`` another count of experts and rows
per expert: 33 x 4096, for one, makes the weight gradient's 128 x 256 tiles whole waves on 132 SMs).
Phases, each timed as one callable:
- fwd:   gate/up (+ SwiGLU) and down;
- dgrad: down's input gradient (+ SwiGLU backward) and gate/up's input gradient (summed);
- wgrad: the three weight gradients.
Implementations: ``torch._grouped_mm`` bf16 (TorchTitan's sequence), ``torch._scaled_grouped_mm`` fp8 rowwise
(activations and weights pre-quantized: GEMMs only, plus the rowwise quantization of h and dgate/dup between the
GEMMs), ours bf16 and ours mxfp8 (each kind of GEMM on the kernel and config ``tile_configs.select`` picks; weights
pre-quantized in each GEMM's layout: the cost of quantizing weights is reported separately; activations are
quantized inside the kernels and so included). The torch baselines get groups padded to 16 rows (TorchTitan pads
too); FLOPs count the real rows only.

Floors, measured in the same run: max(FLOPs / tensor-core ceiling, bytes / HBM bandwidth), with the
bf16 ceiling (8192³ bf16 matmul) for bf16 and the fp8 ceiling (8192³ tensorwise ``_scaled_mm``)
for fp8/mxfp8, and HBM bandwidth from a large device copy (bytes read + written). Bytes: weights
once (1 + 1/32 bytes per element for MXFP8, 1 for fp8, 2 for bf16), activations in and out once.

Legend: R rows, H hidden, I expert FFN size, E local experts.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
import triton

from titan_mok.kernels import grouped_ffn as ffn_kernels
from titan_mok.kernels import grouped_gemm as gg
from titan_mok.kernels import tile_configs as tc

# the working tree's grouped_gemm, grouped_ffn and tile_configs (kernel_ab adds a baseline's)
OUR_KERNELS = (gg, ffn_kernels, tc)

# name: (H, I, E, top-k)
SHAPES = {
    "kimi": (7168, 2048, 384, 8),
    "glm": (6144, 2048, 256, 8),
    "qwen": (4096, 1024, 512, 10),
    "deepseek": (7168, 3072, 384, 6),
}
TOKENS_PER_GPU = 2048
ALIGN = 16  # group padding for torch's grouped GEMMs


def bench(fn, rep_ms=100):
    return triton.testing.do_bench(fn, warmup=20, rep=rep_ms, return_mode="median")


def measure_ceilings():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    flops = 2 * 8192**3
    bf16 = flops / bench(lambda: a @ b) / 1e9
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device="cuda")
    fp8 = flops / bench(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)) / 1e9
    src = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / bench(lambda: dst.copy_(src)) / 1e9  # bytes read + written per ms / 1e9 = TB/s
    del a, b, a8, b8, src, dst
    torch.cuda.empty_cache()
    return {"bf16_tflops": bf16, "fp8_tflops": fp8, "hbm_tbps": bw}


def route_counts(num_rows, num_experts, skewed, seed=0):
    """Rows per expert: balanced (even split) or skewed (lognormal weights, sigma 1)."""
    if not skewed:
        counts = torch.full((num_experts,), num_rows // num_experts, dtype=torch.int64)
        counts[: num_rows % num_experts] += 1
        return counts
    g = torch.Generator().manual_seed(seed)
    p = torch.exp(torch.randn(num_experts, generator=g))
    counts = torch.floor(p / p.sum() * num_rows).to(torch.int64)
    counts[torch.argsort(-p)[: num_rows - int(counts.sum())]] += 1
    return counts


def rowwise_fp8(x):
    """(E4M3 x, fp32 scale per row): the torch baseline's quantization (weights: 16 experts at a time)."""
    if x.dim() == 3:
        parts = [_rowwise_fp8_rows(x[i : i + 16]) for i in range(0, x.shape[0], 16)]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
    return _rowwise_fp8_rows(x)


def _rowwise_fp8_rows(x):
    if x.shape[-1] == 0:  # an expert without rows (scales along the token axis): a scale that multiplies nothing
        return x.to(torch.float8_e4m3fn), torch.ones(x.shape[:-1], dtype=torch.float32, device=x.device)
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / 448.0
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


class Case:
    def __init__(self, H, I, counts, dev="cuda"):
        self.H, self.I, self.E = H, I, counts.numel()
        self.R = int(counts.sum())
        self.group_end = counts.cumsum(0).to(torch.int32).to(dev)
        self.x = torch.randn(self.R, H, device=dev, dtype=torch.bfloat16)
        self.dy = torch.randn(self.R, H, device=dev, dtype=torch.bfloat16)
        self.w_gate = torch.randn(self.E, I, H, device=dev, dtype=torch.bfloat16) * H**-0.5
        self.w_up = torch.randn(self.E, I, H, device=dev, dtype=torch.bfloat16) * H**-0.5
        self.w_down = torch.randn(self.E, H, I, device=dev, dtype=torch.bfloat16) * I**-0.5
        # torch baselines: every group padded to ALIGN rows (pad rows zero)
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        self.offs = padded.cumsum(0).to(torch.int32).to(dev)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), padded.cumsum(0)[:-1]])
        self.rows_in_padded = torch.cat([torch.arange(int(c)) + int(s) for c, s in zip(counts, starts)]).to(dev)
        idx = self.rows_in_padded
        self.Rp = int(padded.sum())
        self.xp = torch.zeros(self.Rp, H, device=dev, dtype=torch.bfloat16).index_copy_(0, idx, self.x)
        self.dyp = torch.zeros(self.Rp, H, device=dev, dtype=torch.bfloat16).index_copy_(0, idx, self.dy)

    def weight_elems(self):
        return 3 * self.E * self.H * self.I


def weight_as_read(c, name, along, precision, kernels=OUR_KERNELS):
    """Case c's weight ``name`` as our GEMMs read it, K = its dim ``along`` (2: the forward's [E, N, K]; 1: the
    dgrad's transposed view), MXFP8 quantized in that layout. kernels: the grouped_gemm and grouped_ffn modules that
    make it (a baseline revision's in kernel_ab)."""
    return kernels[1].weight_operand(getattr(c, name), precision, along, name)


def _activations(c, wg, wu, wd_t, mm):
    """g, u, h and dgate, dup as the FFN's forward and backward save them, by mm's GEMMs on these weights."""
    g, u, h = mm.grouped_gate_up_swiglu(c.x, c.group_end, wg, wu, None)
    dg, du = mm.grouped_down_dgrad_swiglu(c.dy, c.group_end, wd_t, g, u, None)
    return g, u, h, dg, du


def saved_activations(c, precision, kernels=OUR_KERNELS):
    """_activations by kernels' GEMMs, on weights made for them and dropped on return."""
    wg, wu, wd_t = (weight_as_read(c, name, along, precision, kernels)
                    for name, along in (("w_gate", 2), ("w_up", 2), ("w_down", 1)))
    return _activations(c, wg, wu, wd_t, kernels[0])


def ffn_operands(c, precision):
    """Our GEMMs' operands for case c: the six weights as the GEMMs read them (weight_as_read: w_gate, w_up,
    w_down forward, then transposed) and the saved activations, computed from those same weights."""
    weights = tuple(weight_as_read(c, name, along, precision) for along in (2, 1)
                    for name in ("w_gate", "w_up", "w_down"))
    wg, wu, _, _, _, wd_t = weights
    return weights, _activations(c, wg, wu, wd_t, gg)


def phases_ours(c, precision, table=None):
    phases = {}
    if precision == "mxfp8":
        def wquant():  # both layouts of all three weights, as the FFN quantizes them each pass
            for w in (c.w_gate, c.w_up, c.w_down):
                ffn_kernels.weight_operand(w, "mxfp8", 2, "w")
                ffn_kernels.weight_operand(w, "mxfp8", 1, "w")

        phases["wquant"] = wquant
    (wg, wu, wd, wg_t, wu_t, wd_t), (g, u, h, dg, du) = ffn_operands(c, precision)
    ge = c.group_end

    def fwd():
        _, _, h_ = gg.grouped_gate_up_swiglu(c.x, ge, wg, wu, None, table=table)
        return gg.grouped_mm(h_, ge, wd, table=table)

    def dgrad():
        dg_, du_ = gg.grouped_down_dgrad_swiglu(c.dy, ge, wd_t, g, u, None, table=table)
        return gg.grouped_mm_sum(dg_, du_, ge, wg_t, wu_t, table=table)

    def wgrad():  # as the FFN's backward, but one gradient alive at a time (memory)
        operands = ffn_kernels.wgrad_operands(c.x, h, c.dy, dg, du).values()
        for dw in gg.grouped_wgrads(operands, ge, precision, table=table):
            del dw  # before the next is made (a loop variable would hold it meanwhile: two alive)

    return {"fwd": fwd, "dgrad": dgrad, "wgrad": wgrad, **phases}


def _swiglu_bwd_torch(dh, g, u):
    gf, uf = g.float(), u.float()
    sig = torch.sigmoid(gf)
    return (dh * uf * sig * (1 + gf * (1 - sig))).to(g.dtype), (dh * gf * sig).to(g.dtype)


def phases_grouped_mm(c):
    offs, x, dy = c.offs, c.xp, c.dyp
    gmm = torch._grouped_mm
    g = gmm(x, c.w_gate.transpose(-2, -1), offs=offs)
    u = gmm(x, c.w_up.transpose(-2, -1), offs=offs)
    h = F.silu(g) * u
    dg, du = _swiglu_bwd_torch(gmm(dy, c.w_down, offs=offs).float(), g, u)

    def fwd():
        h_ = F.silu(gmm(x, c.w_gate.transpose(-2, -1), offs=offs)) * gmm(x, c.w_up.transpose(-2, -1), offs=offs)
        return gmm(h_, c.w_down.transpose(-2, -1), offs=offs)

    def dgrad():
        dg_, du_ = _swiglu_bwd_torch(gmm(dy, c.w_down, offs=offs).float(), g, u)
        return gmm(dg_, c.w_gate, offs=offs) + gmm(du_, c.w_up, offs=offs)

    def wgrad():
        for a, b in ((dg, x), (du, x), (dy, h)):
            gmm(a.t(), b, offs=offs)

    return {"fwd": fwd, "dgrad": dgrad, "wgrad": wgrad}


def phases_scaled_grouped_mm(c):
    """fp8 rowwise: weights quantized per output row along K (pre-quantized, both layouts)."""
    offs = c.offs
    sgmm = torch._scaled_grouped_mm

    def wq(w_ENK):  # -> mat_b [E, K, N] column-major, scale [E, N]
        q, s = rowwise_fp8(w_ENK.contiguous())
        return q.transpose(-2, -1), s

    wg, wu, wd = wq(c.w_gate), wq(c.w_up), wq(c.w_down)
    wg_t, wu_t, wd_t = wq(c.w_gate.transpose(1, 2)), wq(c.w_up.transpose(1, 2)), wq(c.w_down.transpose(1, 2))
    xq, xs = rowwise_fp8(c.xp)
    dyq, dys = rowwise_fp8(c.dyp)
    bf = torch.bfloat16

    def mm(aq, as_, w):
        return sgmm(aq, w[0], as_, w[1], offs=offs, out_dtype=bf)

    g, u = mm(xq, xs, wg), mm(xq, xs, wu)
    h = F.silu(g) * u

    def fwd():
        hq, hs = rowwise_fp8(F.silu(mm(xq, xs, wg)) * mm(xq, xs, wu))
        return mm(hq, hs, wd)

    def dgrad():
        dg_, du_ = _swiglu_bwd_torch(mm(dyq, dys, wd_t).float(), g, u)
        (dgq, dgs), (duq, dus) = rowwise_fp8(dg_), rowwise_fp8(du_)
        return mm(dgq, dgs, wg_t) + mm(duq, dus, wu_t)

    dg, du = _swiglu_bwd_torch(mm(dyq, dys, wd_t).float(), g, u)

    def colwise(t_RN):  # per-group scales along the token axis: [N, R] row-major fp8, scale [E * N]
        t_NR = t_RN.t().contiguous()
        parts, scales = [], []
        start = 0
        for end in offs.tolist():  # NOTE: host sync; setup only, outside the timed region
            q, s = rowwise_fp8(t_NR[:, start:end])
            parts.append(q)
            scales.append(s)
            start = end
        return torch.cat(parts, dim=1), torch.cat(scales)

    dgq_t, dgs_t = colwise(dg)
    duq_t, dus_t = colwise(du)
    dyq_t, dys_t = colwise(c.dyp)
    xq_c, xs_c = colwise(c.xp)
    hq_c, hs_c = colwise(h)

    def wgrad():  # mat_b [R, K] column-major = transposed [K, R] row-major
        for a, sa, b, sb in ((dgq_t, dgs_t, xq_c, xs_c), (duq_t, dus_t, xq_c, xs_c), (dyq_t, dys_t, hq_c, hs_c)):
            sgmm(a, b.t(), sa, sb, offs=offs, out_dtype=bf)

    return {"fwd": fwd, "dgrad": dgrad, "wgrad": wgrad}


def floors(c, ceil, fmt):
    """Roofline floor (ms) per phase for a weight/activation format ('bf16', 'fp8', 'mxfp8')."""
    wbytes = {"bf16": 2.0, "fp8": 1.0, "mxfp8": 1 + 1 / 32}[fmt]
    tflops = ceil["bf16_tflops"] if fmt == "bf16" else ceil["fp8_tflops"]
    flops = 6 * c.R * c.H * c.I
    act = 2 * c.R  # bf16 activations: bytes per row element
    bytes_ = {
        "fwd": c.weight_elems() * wbytes + act * (2 * c.H),  # x in, y out
        "dgrad": c.weight_elems() * wbytes + act * (2 * c.H + 2 * c.I),  # dy, g, u in; dx out
        "wgrad": c.weight_elems() * 2 + act * (2 * c.H + 3 * c.I),  # bf16 grads out; x, dy, dg, du, h in
        "wquant": c.weight_elems() * 2 * (2 + 1 + 1 / 32),  # bf16 read, MXFP8 written, two layouts
    }
    floor = {p: max(flops / tflops / 1e9, b / ceil["hbm_tbps"] / 1e9) for p, b in bytes_.items()}
    floor["wquant"] = bytes_["wquant"] / ceil["hbm_tbps"] / 1e9
    return floor, flops


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# implementation: (its phases on a case with our GEMMs' tile table, the format its floors use)
_IMPL_PHASES = {
    "grouped_mm_bf16": (lambda c, table: phases_grouped_mm(c), "bf16"),
    "scaled_grouped_mm_fp8": (lambda c, table: phases_scaled_grouped_mm(c), "fp8"),
    "ours_bf16": (lambda c, table: phases_ours(c, "bf16", table), "bf16"),
    "ours_mxfp8": (lambda c, table: phases_ours(c, "mxfp8", table), "mxfp8"),
}
IMPLS = tuple(_IMPL_PHASES)


def _phases(impl, c, table=None):
    """(phase callables, floor format) of one implementation on case c (table: our GEMMs' tile configs, None: the
    committed)."""
    make, fmt = _IMPL_PHASES[impl]
    return make(c, table), fmt


def _time_phases(c, impls, ceil, rep_ms, rounds, table=None) -> dict:
    """Each implementation's phases timed in rounds (rounds > 1: all of impls held at once, their order
    alternating between rounds, so that clock and thermal drift meet every implementation alike), the
    median round as "ms" and [fastest, slowest] as "range_ms". A failure is kept as its text, never as the
    exception (its traceback would hold the failed call's tensors), and its phase is not timed again."""
    built, times, errors = {}, {}, {}
    for impl in impls:
        try:
            built[impl] = _phases(impl, c, table)
        except Exception as e:
            errors[impl] = repr(e)[:300]
    for r in range(rounds):
        for impl in (impls if r % 2 == 0 else impls[::-1]):
            for phase, fn in (built[impl][0].items() if impl in built else ()):
                if (impl, phase) in errors:
                    continue
                try:
                    times.setdefault(impl, {}).setdefault(phase, []).append(bench(fn, rep_ms))
                except Exception as e:  # a baseline that torch rejects: record why
                    errors[impl, phase] = repr(e)[:300]
    out = {}
    for impl in impls:
        if impl not in built:
            out[impl] = {"error": errors[impl]}
            continue
        fl, flops = floors(c, ceil, built[impl][1])
        out[impl] = {}
        for phase in built[impl][0]:
            if (impl, phase) in errors:
                out[impl][phase] = {"error": errors[impl, phase]}
                continue
            t = times[impl][phase]
            ms = statistics.median(t)
            out[impl][phase] = {"ms": ms, "tflops": flops / ms / 1e9 if phase != "wquant" else None,
                                "floor_ms": fl[phase], "of_floor": fl[phase] / ms,
                                **({"range_ms": [min(t), max(t)]} if rounds > 1 else {})}
    return out


def run_case(name, H, I, counts, ceil, impls, rep_ms, log, rounds=1, table=None):
    c = Case(H, I, counts)
    res = {"case": name, "H": H, "I": I, "E": c.E, "R": c.R, "rows_min": int(counts.min()),
           "rows_max": int(counts.max()), "impls": {}}
    # one round: one implementation at a time, its pre-quantized weights (tens of GB at EP=1) freed
    # before the next is built; more rounds hold them all (four of them do not fit a 141 GB H200 at
    # DeepSeek-V4-Pro's EP=1: fewer --impls there)
    for group in ([[impl] for impl in impls] if rounds == 1 else [impls]):
        res["impls"].update(_time_phases(c, group, ceil, rep_ms, rounds, table))
        torch.cuda.empty_cache()
    # correctness at this size: ours vs torch's bf16 grouped GEMM forward (same bf16 inputs)
    try:
        ref = phases_grouped_mm(c)["fwd"]()[c.rows_in_padded]
        for impl, prec in (("ours_bf16", "bf16"), ("ours_mxfp8", "mxfp8")):
            if impl in impls:
                y = phases_ours(c, prec, table)["fwd"]()
                res.setdefault("fwd_rel_err_vs_grouped_mm", {})[impl] = rel_err(y, ref)
    except Exception as e:
        res["check_error"] = repr(e)[:300]
    del c
    torch.cuda.empty_cache()
    log(json.dumps(res))
    return res


_BF16_VARIANTS = [tc.TritonMM(BM=128, BN=bn, BK=64, num_warps=w, num_stages=st, HALF_TILES=True)
                  for bn, w, st in ((128, 8, 3), (128, 8, 4), (128, 4, 3), (64, 8, 3), (256, 8, 4))]
_BF16_FEW_ROWS_VARIANTS = [tc.TritonMM(BM=64, BN=128, BK=64, num_warps=w, num_stages=st)
                           for w, st in ((8, 4), (4, 3), (4, 4))]
_BF16_PERSISTENT = [tc.TritonMM(BM=128, BN=bn, BK=64, num_warps=8, num_stages=st, PERSISTENT=True)
                    for bn, st in ((256, 4), (256, 3), (128, 4))]
_COOPERATIVE = [tc.CoopMM(BN=bn, BK=64, STAGES=st, CONSUMER_REGS=232) for bn, st in ((256, 3), (128, 4), (128, 3))]


def _ws(stages=4, regs=232, persistent=True, bm=128, **kw):
    return tc.GluonMM(BM=bm, PERSISTENT=persistent, STAGES=stages, CONSUMER_REGS=regs, **kw)


_SPLIT = dict(HALF_TILES=True, SPLIT_TILES=True)  # 65-96-row tiles on 64 + 32-token MMAs, <= 64 rows on 64


def _ws_two_per_sm(stages=2, regs=104, **kw):  # 64-token tiles, registers capped so two programs share an SM
    return _ws(stages=stages, regs=regs, persistent=False, bm=64, maxnreg=80, **kw)


def _triton(key):  # an entry's Triton config (the same on every chip for these keys): the Triton kernel on CUDA
    return tc.H200.mm[key].triton


_MX_SWIGLU = [_triton("mxfp8/swiglu@mid_rows"), _ws(stages=2, persistent=False, **_SPLIT),
              _ws(stages=2, persistent=False), _ws(stages=2, **_SPLIT), _ws(stages=3, regs=248, **_SPLIT),
              _ws(stages=3, persistent=False, **_SPLIT)]
_MX_SWIGLU_BWD = [_triton("mxfp8/swiglu_bwd@mid_rows"), _ws(stages=3, regs=248, **_SPLIT),
                  _ws(stages=3, regs=248, HALF_TILES=True), _ws(regs=248, **_SPLIT), _ws(**_SPLIT)]
# Per table entry ("<precision>/<kind>@<tier>", tile_configs), the CUDA configs --tune times on its tier's case, each
# list holding the entry's committed config in every chip's table (tests/tools/test_bench_grouped_ffn.py).
TUNE_VARIANTS = {
    **{f"bf16/{kind}@{tier}": _BF16_VARIANTS for kind in ("plain", "swiglu", "dual")
       for tier in ("few_rows", "mid_rows")},
    "bf16/plain@many_rows": [_BF16_VARIANTS[2], *_BF16_PERSISTENT, *_COOPERATIVE],
    "bf16/swiglu@many_rows": [_BF16_VARIANTS[1], *_COOPERATIVE],
    "bf16/dual@many_rows": [_BF16_PERSISTENT[0], _BF16_VARIANTS[4]],
    "bf16/swiglu_bwd@few_rows": [*_BF16_FEW_ROWS_VARIANTS, _BF16_VARIANTS[1]],
    "bf16/swiglu_bwd@mid_rows": [_BF16_VARIANTS[1], _ws(stages=3, persistent=False, **_SPLIT), _ws(stages=3, **_SPLIT)],
    "bf16/swiglu_bwd@many_rows": [_triton("bf16/swiglu_bwd@many_rows"), _ws(stages=3, **_SPLIT),
                                  _ws(stages=3, persistent=False, **_SPLIT)],
    "mxfp8/plain@mid_rows": [_triton("mxfp8/plain@mid_rows"), _ws(stages=3, ROW_BLOCKS=2, **_SPLIT), _ws(**_SPLIT),
                             _ws(stages=3, **_SPLIT), _ws()],
    "mxfp8/swiglu@mid_rows": _MX_SWIGLU,
    "mxfp8/swiglu@many_rows": _MX_SWIGLU,
    "mxfp8/swiglu_bwd@mid_rows": _MX_SWIGLU_BWD,
    "mxfp8/swiglu_bwd@many_rows": _MX_SWIGLU_BWD,
    "mxfp8/dual@mid_rows": [_triton("mxfp8/dual@mid_rows"), _ws(stages=3, ROW_BLOCKS=2, **_SPLIT), _ws(**_SPLIT),
                            _ws(HALF_TILES=True), _ws(stages=3, **_SPLIT)],
    "mxfp8/plain@few_rows": [_ws(bm=64, ROW_BLOCKS=2, HALF_TILES=True), _ws(bm=64, ROW_BLOCKS=2),
                             _ws(stages=3, bm=64, ROW_BLOCKS=2, HALF_TILES=True)],
    "mxfp8/swiglu@few_rows": [_ws(stages=2, persistent=False, bm=64, HALF_TILES=True),
                              _ws(stages=2, persistent=False, bm=64), _ws(stages=2, bm=64, HALF_TILES=True),
                              _ws(stages=3, persistent=False, bm=64, HALF_TILES=True)],
    "mxfp8/swiglu_bwd@few_rows": [_ws_two_per_sm(HALF_TILES=True), _ws_two_per_sm(),
                                  _ws(stages=3, regs=248, bm=64, HALF_TILES=True),
                                  _ws_two_per_sm(regs=112, HALF_TILES=True)],
    "mxfp8/dual@few_rows": [_ws(bm=64, ROW_BLOCKS=2, HALF_TILES=True), _ws(bm=64, ROW_BLOCKS=2),
                            _ws_two_per_sm(HALF_TILES=True), _ws(stages=3, bm=64, ROW_BLOCKS=2, HALF_TILES=True)],
    "mxfp8/plain@many_rows": [_ws(stages=2, regs=240, bm=256), _ws(stages=2, regs=232, bm=256), _ws()],
    "mxfp8/dual@many_rows": [_ws(stages=2, regs=240, bm=256, HALF_TILES=True),
                             _ws(stages=2, regs=232, bm=256, HALF_TILES=True), _ws(HALF_TILES=True)],
}


def committed_table() -> tc.ChipTable:
    """The tile table this process's GPU reads (on the CPU, the default)."""
    return tc.table_for(tc.chip_of(torch.empty(0, device="cuda")) if torch.cuda.is_available() else None)


def _entry_key(c, kind, precision, n, k, contiguous=True, kernels=OUR_KERNELS):
    """The tile table entry case c's GEMM of this kind reads (kernels' tile_configs)."""
    tiles = kernels[2]
    return tiles.select(kind, precision, c.R / c.E, tiles.chip_of(c.x), n=n, k=k, contiguous=contiguous).key


def _with_table(fn, *args, **kwargs):
    """fn(*args, **kwargs) as a callable of the tile table to read (None: the committed, and no table= passed)."""
    return lambda table=None: fn(*args, **kwargs, **({} if table is None else {"table": table}))


def gemm_makers(c, precision, kernels=OUR_KERNELS) -> dict:
    """Per kind of grouped GEMM in this precision, keyed by the tile table entry case c reads for it
    ("<precision>/<kind>@<tier>"), a function that makes the weights that kind reads and returns the GEMM as a
    callable of the table to read (None: the committed): a caller holding one kind's GEMM at a time holds one kind's
    weights (kernel_ab: two revisions' MXFP8 copies of all six did not fit an 80 GB H100 at Kimi K2.7 EP=1)."""
    mm = kernels[0]

    def w(name, along):
        return weight_as_read(c, name, along, precision, kernels)

    g, u, h, dg, du = saved_activations(c, precision, kernels)
    ge, mx = c.group_end, precision == "mxfp8"

    def key(kind, n, k, contiguous=True):
        return _entry_key(c, kind, precision, n, k, contiguous, kernels)

    return {
        key("swiglu", c.I, c.H): lambda: _with_table(mm.grouped_gate_up_swiglu, c.x, ge, w("w_gate", 2),
                                                     w("w_up", 2), None),
        key("plain", c.H, c.I): lambda: _with_table(mm.grouped_mm, h, ge, w("w_down", 2)),
        key("swiglu_bwd", c.I, c.H, mx): lambda: _with_table(mm.grouped_down_dgrad_swiglu, c.dy, ge, w("w_down", 1),
                                                             g, u, None),
        key("dual", c.H, c.I, mx): lambda: _with_table(mm.grouped_mm_sum, dg, du, ge, w("w_gate", 1), w("w_up", 1)),
    }


def gemms_by_kind(c, precision, kernels=OUR_KERNELS):
    """One grouped GEMM of each kind (gemm_makers' keys and callables), all made at once."""
    return {key: make() for key, make in gemm_makers(c, precision, kernels).items()}


def wgrads_by_weight(c, precision, kernels=OUR_KERNELS):
    """Each weight's gradient as a callable of the tile table (None: the committed), keyed
    "wgrad/<config>:<weight>" by the weight-gradient config it reads (tile_configs.select)."""
    mm, ffn = kernels[:2]
    _, _, h, dg, du = saved_activations(c, precision, kernels=kernels)
    return {f"{_entry_key(c, 'wgrad', precision, a.shape[1], b.shape[1], kernels=kernels)}:{name}":
            _with_table(mm.grouped_wgrad, a, b, c.group_end, precision)
            for name, (a, b) in ffn.wgrad_operands(c.x, h, c.dy, dg, du).items()}


def tune(log, keys) -> tc.ChipTable:
    """Tile-config sweep (TUNE_VARIANTS) of the table entries keys on this GPU's table, one Kimi K2.7 case per rows
    tier (EP=1 and EP=2 balanced, 8 x 4096 rows); returns the table with each entry's fastest config (for the runs
    that follow). Each kind of GEMM is timed on its own, on the case whose rows per expert read that entry."""
    H, I, E, K = SHAPES["kimi"]
    cases = {"kimi_ep1_balanced": route_counts(TOKENS_PER_GPU * K, E, False),
             "kimi_ep2_balanced": route_counts(TOKENS_PER_GPU * K, E // 2, False),
             "kimi_compute": torch.full((8,), 4096, dtype=torch.int64)}
    committed = committed_table()
    best = {}
    for cname, counts in cases.items():
        c = Case(H, I, counts)
        timed = {}
        for precision in ("bf16", "mxfp8"):
            if any(key.startswith(precision + "/") for key in keys):
                timed.update(gemms_by_kind(c, precision))
        for key in keys:
            if key not in timed:
                continue  # another case's rows read this entry
            times = []
            for v in TUNE_VARIANTS[key]:
                table = committed.replace(mm={key: tc.MMEntry(committed.mm[key].triton, v)})
                try:
                    ms = bench(lambda: timed[key](table), 60)
                    rec = {"case": cname, "entry": key, "cfg": str(v), "ms": ms}
                except Exception as e:
                    ms, rec = float("inf"), {"case": cname, "entry": key, "cfg": str(v), "error": repr(e)[:200]}
                times.append(ms)
                log(json.dumps(rec))
            best[key] = tc.MMEntry(committed.mm[key].triton, TUNE_VARIANTS[key][times.index(min(times))])
            log(json.dumps({"tuned": key, "cfg": str(best[key].cuda), "ms": min(times)}))
        del c, timed
        torch.cuda.empty_cache()
    return committed.replace(mm=best)


def comma_choices(parser: argparse.ArgumentParser, flag: str, text: str, allowed) -> list[str]:
    """The comma-separated values of a flag, each one of ``allowed`` (else the parser's error, naming them)."""
    given = text.split(",")
    if bad := [x for x in given if x not in allowed]:
        parser.error(f"{flag}: {bad} not among {list(allowed)}")
    return given


def compute_case(parser: argparse.ArgumentParser, text: str) -> tuple[int, int]:
    """--compute-case's (experts, rows per expert), both positive (else the parser's error, naming the flag)."""
    experts, sep, rows = text.partition("x")
    if not (sep and experts.isdigit() and rows.isdigit() and int(experts) > 0 and int(rows) > 0):
        parser.error(f"--compute-case: expected EXPERTSxROWS with positive integers, e.g. 8x4096, got {text!r}")
    return int(experts), int(rows)


def use_growing_segments():
    """The CUDA allocator's segments grow instead of being carved once: DeepSeek-V4-Pro at EP=1 holds ~114 GB, and
    its weight gradient's 15.75 GB output then found the free memory only in pieces (out of memory with 15.7 GB
    reserved but unallocated). Call before the first CUDA allocation, which reads it."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def main():
    use_growing_segments()
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--quick", action="store_true", help="the first of --shapes, balanced, EP=2 only")
    p.add_argument("--tune", action="store_true", help="first sweep tile configs (TUNE_VARIANTS) and use the best")
    p.add_argument("--rep-ms", type=float, default=100)
    p.add_argument("--rounds", type=int, default=1,
                   help="timing rounds per phase, the implementations alternating (more than 1 holds them all at once)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--regime", choices=("all", "moe", "compute"), default="all",
                   help="the MoE-regime cases, the compute cases (--compute-case), or both")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help="comma-separated implementations to time")
    p.add_argument("--compute-case", default="8x4096", help="the compute regime's EXPERTSxROWS (rows per expert)")
    args = p.parse_args()
    experts, rows = compute_case(p, args.compute_case)
    impls = comma_choices(p, "--impls", args.impls, IMPLS)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    shapes = comma_choices(p, "--shapes", args.shapes, SHAPES)
    if args.quick:
        shapes = shapes[:1]
    os.makedirs(args.out, exist_ok=True)
    log_f = open(os.path.join(args.out, "grouped_ffn_bench.jsonl"), "a")

    def log(s):
        print(s, flush=True)
        log_f.write(s + "\n")
        log_f.flush()

    torch.manual_seed(0)
    ceil = measure_ceilings()
    log(json.dumps({"ceilings": ceil, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}))
    table = None
    if args.tune:
        entries = {"ours_bf16": [k for k in TUNE_VARIANTS if k.startswith("bf16/")],
                   "ours_mxfp8": [k for k in TUNE_VARIANTS if k.startswith("mxfp8/")]}
        table = tune(log, [key for i in impls for key in entries.get(i, [])])
    results = []
    for shape in shapes if args.regime != "compute" else []:
        H, I, E, K = SHAPES[shape]
        for ep in ([2] if args.quick else [1, 2]):
            for skewed in ([False] if args.quick else [False, True]):
                counts = route_counts(TOKENS_PER_GPU * K, E // ep, skewed)
                name = f"{shape} EP={ep} {'skewed' if skewed else 'balanced'}"
                results.append(run_case(name, H, I, counts, ceil, impls, args.rep_ms, log, args.rounds, table))
    for shape in shapes if args.regime != "moe" else []:
        H, I, _, _ = SHAPES[shape]
        results.append(run_case(f"{shape} compute {experts}x{rows}", H, I,
                                torch.full((experts,), rows, dtype=torch.int64), ceil, impls, args.rep_ms, log,
                                args.rounds, table))
    # summary table (the reply carries the end of the output)
    print("\ncase | impl | fwd ms (floor/time) | dgrad | wgrad | weight quantization")
    for r in results:
        for impl, ph in r["impls"].items():
            cells = (summary_cell(ph, phase) for phase in ("fwd", "dgrad", "wgrad", "wquant"))
            print(f"{r['case']} | {impl} | " + " | ".join(cells))
    print(json.dumps({"ceilings": ceil}))


def summary_cell(impl_result: dict, phase: str) -> str:
    """A phase's cell of the summary table: "ms (fraction of the floor)", "oom" where it did not fit the GPU (the
    largest EP=1 cases on an 80 GB H100), "err" for another failure (its text is in the JSON line), "-" if not run."""
    v = impl_result.get(phase, {})
    if "ms" in v:
        return f"{v['ms']:.2f} ({v['of_floor']:.2f})"
    error = v.get("error") or impl_result.get("error")
    if error:
        return "oom" if error.startswith("OutOfMemoryError") else "err"
    return "-"


if __name__ == "__main__":
    main()
