"""Routed-expert SwiGLU FFN on rows grouped by expert: the MoE layer's routed-expert compute.

Legend: R routed rows (grouped by expert), H hidden, I expert FFN size, E experts held here.

    y_RH[r] = w_down[e] · h,  h = silu(min(g, L)) · clamp(u, -L, L),
    g = w_gate[e] · x[r],  u = w_up[e] · x[r]       (e: the expert owning row r, L: swiglu_limit)

Dataflow (both paths, both precisions): GEMMs accumulate in fp32; g and u are stored in the
activation dtype and h is computed in fp32 from those stored values, then rounded to it; the
backward uses the stored g, u, h. ``precision="mxfp8"`` quantizes every GEMM operand (``mxfp8``)
along that GEMM's reduction dim: forward x, w_gate, w_up along H, h and w_down
along I; dgrad dy and w_down along H, dgate/dup and w_gate/w_up along I; wgrad both operands
along the token axis, per group (``kernels/grouped_gemm.py``). Master weights stay as given;
the shared expert is not here (it stays bf16 in the MoE layer).

Two paths compute the same function:
- ``use_triton=False``: the reference, plain PyTorch on the exact operand values
  (``ref_grouped_mm``/``ref_grouped_wgrad``: MXFP8 quantize → dequantize → fp32 GEMM).
  NOTE: it loops over experts on the host (one device→host sync per call).
- ``use_triton=True``: Triton grouped GEMMs (CUDA), no host sync, row-batch-invariant and
  run-to-run deterministic. They equal the reference up to fp32 summation order (and the
  rounding of results to bf16): tests/kernels/test_grouped_ffn.py states the tolerances. Given a
  ``weights_owner`` and the ``weight_sources`` the weights were cast from, each MXFP8 weight layout
  is quantized once per version of its source (``weight_cache``: once per optimizer step).

Weights may also arrive already quantized (``MXFP8GatheredWeight``, ``kernels/mxfp8_gathered.py``: FSDP's
MXFP8 all-gather): both paths then read their MXFP8 operands as they are (the reference dequantizes them,
the values its quantize → dequantize would make).
"""

import os

import torch
import torch.nn.functional as F

from titan_mok.kernels import tile_configs, weight_cache
from titan_mok.kernels.grouped_gemm import (
    grouped_down_dgrad_swiglu,
    grouped_gate_up_swiglu,
    grouped_mm,
    grouped_mm_sum,
    grouped_wgrads,
    ref_grouped_mm,
    ref_grouped_wgrad,
)
from titan_mok.kernels.mxfp8 import to_mxfp8
from titan_mok.kernels.mxfp8_gathered import MXFP8GatheredWeight
from titan_mok.kernels.mxfp8_quant import mxfp8_quantize, mxfp8_quantize_transposed
from titan_mok.kernels.row_tiles import map_row_tiles
from titan_mok.kernels.tile_configs import PRECISIONS


def _clamped(gate_RI: torch.Tensor, up_RI: torch.Tensor, limit: float | None):
    """fp32 gate, up with DeepSeek-V4's clamp: gate <= limit, |up| <= limit."""
    gate_RI, up_RI = gate_RI.float(), up_RI.float()
    if limit is not None:
        gate_RI, up_RI = gate_RI.clamp(max=limit), up_RI.clamp(-limit, limit)
    return gate_RI, up_RI


def _swiglu_rows(gate_RI, up_RI, limit):
    gate32_RI, up32_RI = _clamped(gate_RI, up_RI, limit)
    return (F.silu(gate32_RI) * up32_RI).to(gate_RI.dtype)


def ref_swiglu(gate_RI: torch.Tensor, up_RI: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(clamped gate) · clamped up in fp32, rounded once to the inputs' dtype (row tiles: batch-invariant)."""
    return map_row_tiles(lambda g, u: _swiglu_rows(g, u, limit), gate_RI, up_RI)


def _swiglu_backward_rows(dh32_RI, gate_RI, up_RI, limit):
    gate32_RI, up32_RI = _clamped(gate_RI, up_RI, limit)
    sig_RI = torch.sigmoid(gate32_RI)
    dgate_RI = dh32_RI * up32_RI * sig_RI * (1 + gate32_RI * (1 - sig_RI))
    dup_RI = dh32_RI * gate32_RI * sig_RI
    if limit is not None:
        dgate_RI = torch.where(gate_RI.float() <= limit, dgate_RI, 0.0)
        dup_RI = torch.where(up_RI.float().abs() <= limit, dup_RI, 0.0)
    return dgate_RI.to(gate_RI.dtype), dup_RI.to(gate_RI.dtype)


def ref_swiglu_backward(dh32_RI, gate_RI, up_RI, limit: float | None):
    """(dgate, dup) in the inputs' dtype from fp32 dh; the clamp passes gradient only where it did not clip."""
    return map_row_tiles(lambda d, g, u: _swiglu_backward_rows(d, g, u, limit), dh32_RI, gate_RI, up_RI)


def _ref_weight(w_EXY, along: int, name: str):
    """The reference GEMMs' B [E, N, K] with K = ``along`` of the stored weight: a gathered weight's MXFP8
    operand, else the weight (along 2) or its transposed view (along 1), quantized inside the GEMM."""
    if isinstance(w_EXY, MXFP8GatheredWeight):
        return w_EXY.operand(along, name)
    return w_EXY if along == 2 else w_EXY.transpose(1, 2)


class _ReferenceOps:
    """The definition: explicit fp32 GEMMs on (fake-)quantized operands, a loop over experts."""

    @staticmethod
    def forward(x_RH, group_end_E, w_gate_EIH, w_up_EIH, w_down_EHI, precision, limit):
        gate_RI = ref_grouped_mm(x_RH, group_end_E, _ref_weight(w_gate_EIH, 2, "w_gate_EIH"), precision).to(x_RH.dtype)
        up_RI = ref_grouped_mm(x_RH, group_end_E, _ref_weight(w_up_EIH, 2, "w_up_EIH"), precision).to(x_RH.dtype)
        h_RI = ref_swiglu(gate_RI, up_RI, limit)
        y_RH = ref_grouped_mm(h_RI, group_end_E, _ref_weight(w_down_EHI, 2, "w_down_EHI"), precision).to(x_RH.dtype)
        return y_RH, gate_RI, up_RI, h_RI

    @staticmethod
    def backward(dy_RH, x_RH, group_end_E, w_gate_EIH, w_up_EIH, w_down_EHI, gate_RI, up_RI, h_RI, precision, limit):
        dh32_RI = ref_grouped_mm(dy_RH, group_end_E, _ref_weight(w_down_EHI, 1, "w_down_EHI"), precision)
        dgate_RI, dup_RI = ref_swiglu_backward(dh32_RI, gate_RI, up_RI, limit)
        dx_RH = (
            ref_grouped_mm(dgate_RI, group_end_E, _ref_weight(w_gate_EIH, 1, "w_gate_EIH"), precision)
            + ref_grouped_mm(dup_RI, group_end_E, _ref_weight(w_up_EIH, 1, "w_up_EIH"), precision)
        ).to(x_RH.dtype)
        dw_gate_EIH = ref_grouped_wgrad(dgate_RI, x_RH, group_end_E, precision).to(w_gate_EIH.dtype)
        dw_up_EIH = ref_grouped_wgrad(dup_RI, x_RH, group_end_E, precision).to(w_up_EIH.dtype)
        dw_down_EHI = ref_grouped_wgrad(dy_RH, h_RI, group_end_E, precision).to(w_down_EHI.dtype)
        return dx_RH, dw_gate_EIH, dw_up_EIH, dw_down_EHI


def weight_operand(w_EXY: torch.Tensor, precision: str, along: int, name: str, reference: bool = False):
    """B operand [E, N, K] for grouped_mm: K = ``along`` (1 or 2) of the stored weight, MXFP8 blocked there,
    its elements in MMA order (MXTensor.mma_order: the warp-specialized kernel's shared-memory loads take a
    thread's bytes of a block at once). ``reference``: quantized by ``to_mxfp8`` instead of the Triton
    quantizers (the same bits, without Triton)."""
    if precision == "mxfp8":
        # along X (dim 1): the GEMM reads [E, Y, X], written contiguous so its tiles stream as the forward's
        if reference:
            return to_mxfp8(w_EXY.transpose(1, 2) if along == 1 else w_EXY, 2, name, mma_order=True)
        if along == 1:
            return mxfp8_quantize_transposed(w_EXY, name, mma_order=True)
        return mxfp8_quantize(w_EXY, along, name, mma_order=True)
    return w_EXY.transpose(1, 2) if along == 1 else w_EXY


class _TritonOps:
    """Triton grouped GEMMs (kernels/grouped_gemm.py); weights quantized in the layout each GEMM reads.
    Given ``weights_owner``, each MXFP8 layout is kept under it for the version of its source weight
    (``stamps``: by weight name, from the forward; a bf16 operand is a view: nothing to keep)."""

    def __init__(self, weights_owner, stamps, sources=None):
        self.weights_owner, self.stamps = weights_owner, stamps
        self.sources = dict(zip(("w_gate_EIH", "w_up_EIH", "w_down_EHI"), sources or ()))

    def _operand(self, w_EXY, precision, along, name):
        if isinstance(w_EXY, MXFP8GatheredWeight):
            return w_EXY.operand(along, name)
        owner = self.weights_owner if precision == "mxfp8" else None
        return weight_cache.operand(owner, name, along, self.stamps.get(name),
                                    lambda: weight_operand(w_EXY, precision, along, name),
                                    self._remake(name, w_EXY.dtype, precision, along))

    def _remake(self, name, dtype, precision, along):
        """The optimizer step's remake of a kept layout: from the source weight cast as the caller cast it (the
        weights given are ``source.to(dtype)``, the stamps' premise), never from the stale cast itself."""
        source = self.sources.get(name)
        if source is None:
            return None
        return lambda: ((weight_cache.stamp(source), dtype), weight_operand(source.to(dtype), precision, along, name))

    def forward(self, x_RH, group_end_E, w_gate_EIH, w_up_EIH, w_down_EHI, precision, limit):
        gate_RI, up_RI, h_RI = grouped_gate_up_swiglu(
            x_RH,
            group_end_E,
            self._operand(w_gate_EIH, precision, 2, "w_gate_EIH"),
            self._operand(w_up_EIH, precision, 2, "w_up_EIH"),
            limit,
        )
        y_RH = grouped_mm(h_RI, group_end_E, self._operand(w_down_EHI, precision, 2, "w_down_EHI"))
        return y_RH, gate_RI, up_RI, h_RI

    def backward(self, dy_RH, x_RH, group_end_E, w_gate_EIH, w_up_EIH, w_down_EHI, gate_RI, up_RI, h_RI, precision,
                 limit):
        dgate_RI, dup_RI = grouped_down_dgrad_swiglu(
            dy_RH, group_end_E, self._operand(w_down_EHI, precision, 1, "w_down_EHI"), gate_RI, up_RI, limit
        )
        dx_RH = grouped_mm_sum(
            dgate_RI,
            dup_RI,
            group_end_E,
            self._operand(w_gate_EIH, precision, 1, "w_gate_EIH"),
            self._operand(w_up_EIH, precision, 1, "w_up_EIH"),
        )
        dw_gate_EIH, dw_up_EIH, dw_down_EHI = grouped_wgrads(
            wgrad_operands(x_RH, h_RI, dy_RH, dgate_RI, dup_RI).values(), group_end_E, precision
        )
        return dx_RH, dw_gate_EIH, dw_up_EIH, dw_down_EHI


def selections(precision: str, rows_per_expert: float, chip: str | None, dim_h: int, dim_i: int,
               table: tile_configs.ChipTable | None = None) -> dict[str, tile_configs.Selection]:
    """The kernel and tile config of each grouped GEMM the Triton path launches in one forward and backward at these
    sizes, by GEMM: tile_configs.select's answers (chip: a GPU's name, None for Triton's interpreter; table: None,
    the chip's), e.g. to log what a run uses."""
    def pick(kind, n, k, contiguous=True):
        return tile_configs.select(kind, precision, rows_per_expert, chip, n=n, k=k, contiguous=contiguous,
                                   table=table)

    dgrad_contiguous = precision == "mxfp8"  # weight_operand: bf16 dgrad weights are transposed views
    return {
        "fwd gate/up + SwiGLU": pick("swiglu", dim_i, dim_h),
        "fwd down": pick("plain", dim_h, dim_i),
        "dgrad down + SwiGLU bwd": pick("swiglu_bwd", dim_i, dim_h, dgrad_contiguous),
        "dgrad gate/up": pick("dual", dim_h, dim_i, dgrad_contiguous),
        **{f"wgrad {name}": pick("wgrad", dim_i, dim_h) for name in ("w_gate", "w_up")},
        "wgrad w_down": pick("wgrad", dim_h, dim_i),
    }


def wgrad_operands(x_RH, h_RI, dy_RH, dgate_RI, dup_RI) -> dict:
    """grouped_wgrad's (a, b) per expert weight, in the order of the weights: dw[e] = a[rows of e].T @ b[rows of e]."""
    return {"w_gate": (dgate_RI, x_RH), "w_up": (dup_RI, x_RH), "w_down": (dy_RH, h_RI)}


class _GroupedSwiGLUFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RH, group_end_E, w_gate_EIH, w_up_EIH, w_down_EHI, precision, limit, use_triton, owner, stamps,
                sources):
        ops = _TritonOps(owner, stamps, sources) if use_triton else _ReferenceOps
        y_RH, gate_RI, up_RI, h_RI = ops.forward(x_RH, group_end_E, w_gate_EIH, w_up_EIH, w_down_EHI, precision, limit)
        ctx.save_for_backward(x_RH, group_end_E, w_gate_EIH, w_up_EIH, w_down_EHI, gate_RI, up_RI, h_RI)
        ctx.ops, ctx.precision, ctx.limit = ops, precision, limit
        return y_RH

    @staticmethod
    def backward(ctx, dy_RH):
        x_RH, group_end_E, w_gate_EIH, w_up_EIH, w_down_EHI, gate_RI, up_RI, h_RI = ctx.saved_tensors
        grads = ctx.ops.backward(
            dy_RH.contiguous(), x_RH, group_end_E, w_gate_EIH, w_up_EIH, w_down_EHI, gate_RI, up_RI, h_RI,
            ctx.precision, ctx.limit,
        )
        dx_RH, dw_gate_EIH, dw_up_EIH, dw_down_EHI = grads
        return dx_RH, None, dw_gate_EIH, dw_up_EIH, dw_down_EHI, None, None, None, None, None, None


def _check_inputs(x_RH, group_end_E, w_gate_EIH, w_up_EIH, w_down_EHI, precision, use_triton):
    if precision not in PRECISIONS:
        raise ValueError(f"grouped_swiglu_ffn: precision must be one of {PRECISIONS}, got {precision!r}")
    if x_RH.dim() != 2:
        raise ValueError(f"grouped_swiglu_ffn: x_RH must be [rows, hidden], got shape {tuple(x_RH.shape)}")
    num_experts, dim_i, dim_h = w_gate_EIH.shape
    if w_gate_EIH.shape != (num_experts, dim_i, x_RH.shape[1]) or w_up_EIH.shape != w_gate_EIH.shape:
        raise ValueError(
            f"grouped_swiglu_ffn: w_gate_EIH {tuple(w_gate_EIH.shape)} and w_up_EIH {tuple(w_up_EIH.shape)} "
            f"must both be [E, I, H] with H = {x_RH.shape[1]} (x_RH's hidden size)"
        )
    if w_down_EHI.shape != (num_experts, dim_h, dim_i):
        raise ValueError(f"grouped_swiglu_ffn: w_down_EHI must be [E, H, I] = {(num_experts, dim_h, dim_i)}, "
                         f"got {tuple(w_down_EHI.shape)}")
    if group_end_E.shape != (num_experts,) or group_end_E.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped_swiglu_ffn: group_end_E must be int32/int64 [{num_experts}], "
                         f"got {group_end_E.dtype} {tuple(group_end_E.shape)}")
    if not (x_RH.dtype == w_gate_EIH.dtype == w_up_EIH.dtype == w_down_EHI.dtype):
        raise TypeError(f"grouped_swiglu_ffn: x_RH ({x_RH.dtype}) and the expert weights ({w_gate_EIH.dtype}, "
                        f"{w_up_EIH.dtype}, {w_down_EHI.dtype}) must share one dtype")
    if precision == "mxfp8" and (dim_h % 32 or dim_i % 32):
        raise ValueError(f"grouped_swiglu_ffn: mxfp8 needs H ({dim_h}) and I ({dim_i}) to be multiples of 32")
    if use_triton:
        if x_RH.device.type != "cuda" and not interpreting():
            raise ValueError("grouped_swiglu_ffn: use_triton=True needs CUDA tensors (or TRITON_INTERPRET=1)")
        if x_RH.dtype != torch.bfloat16:
            raise TypeError(f"grouped_swiglu_ffn: the Triton path runs bfloat16 activations/weights, got {x_RH.dtype}")
        if group_end_E.device != x_RH.device:
            raise ValueError(f"grouped_swiglu_ffn: group_end_E is on {group_end_E.device}, x_RH on {x_RH.device}")


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's interpreter (CPU tensors, programs one after another)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def grouped_swiglu_ffn(
    x_RH: torch.Tensor,
    group_end_E: torch.Tensor,
    w_gate_EIH: torch.Tensor,
    w_up_EIH: torch.Tensor,
    w_down_EHI: torch.Tensor,
    *,
    precision: str = "bf16",
    swiglu_limit: float | None = None,
    use_triton: bool = False,
    weights_owner: object = None,
    weight_sources: tuple | None = None,
) -> torch.Tensor:
    """Routed experts' SwiGLU FFN on rows grouped by expert (module docstring); autograd-capable.

    Args:
        x_RH: [R, H] rows grouped by expert; rows at or past ``group_end_E[-1]`` are padding
            (output and gradient zero).
        group_end_E: [E] int32/int64 cumulative row counts, on x's device.
        w_gate_EIH, w_up_EIH: [E, I, H]; w_down_EHI: [E, H, I]; same dtype as x_RH. Under mxfp8 all three
            may be ``MXFP8GatheredWeight`` (read as gathered; no owner needed).
        precision: "bf16" or "mxfp8" (all six GEMMs of forward and backward in MXFP8).
        swiglu_limit: DeepSeek-V4's clamp (gate <= L, |up| <= L), None for none.
        use_triton: Triton kernels (CUDA, bf16) instead of the PyTorch reference.
        weights_owner: who holds the weights (the experts module): the Triton path keeps each MXFP8
            weight layout under it and quantizes again only when its source changed. None: quantized
            on every call.
        weight_sources: with ``weights_owner``, the tensors (w_gate, w_up, w_down) the weights were
            made from (e.g. the fp32 parameters they are cast from), whose in-place writes
            (``_version``) mark the kept layouts stale.

    Returns:
        y_RH [R, H] in x's dtype.
    """
    _check_inputs(x_RH, group_end_E, w_gate_EIH, w_up_EIH, w_down_EHI, precision, use_triton)
    gathered = _gathered_as_mxfp8((w_gate_EIH, w_up_EIH, w_down_EHI), precision)
    # the reference quantizes inside its GEMMs; bf16: views; gathered MXFP8 weights: nothing to quantize
    keeps = use_triton and precision == "mxfp8" and not gathered
    stamps = _source_stamps(weights_owner, weight_sources, (w_gate_EIH, w_up_EIH, w_down_EHI)) if keeps else {}
    return _GroupedSwiGLUFFN.apply(
        x_RH.contiguous(), group_end_E, w_gate_EIH, w_up_EIH, w_down_EHI, precision, swiglu_limit, use_triton,
        weights_owner if keeps else None, stamps, weight_sources if keeps else None,
    )


def forward_weight_operands(weights: tuple, precision: str, *, weights_owner: object = None,
                            weight_sources: tuple | None = None) -> tuple:
    """(w_gate, w_up, w_down) as the Triton path's forward GEMMs read them (``weight_operand(w, precision, 2,
    name)``): bf16 as given; MXFP8 kept under ``weights_owner`` per version of ``weight_sources``, exactly as ``grouped_swiglu_ffn(use_triton=True)`` keeps them (so a
    later call of it finds them); MXFP8-gathered weights as gathered. For other kernels that read the FFN's
    operands (the MoK megakernel)."""
    return _kept_operands(weights, precision, 2, weights_owner, weight_sources)


def dgrad_weight_operands(weights: tuple, precision: str, *, weights_owner: object = None,
                          weight_sources: tuple | None = None) -> tuple:
    """(w_gate, w_up, w_down) as the Triton path's input-gradient GEMMs read them (``weight_operand(w, precision, 1,
    name)``: bf16 the transposed views, MXFP8 blocked along the other axis), kept and gathered as
    ``forward_weight_operands``'s. For the MoK megakernel's dgrad launch."""
    return _kept_operands(weights, precision, 1, weights_owner, weight_sources)


def _kept_operands(weights: tuple, precision: str, along: int, weights_owner, weight_sources) -> tuple:
    gathered = _gathered_as_mxfp8(weights, precision)
    keeps = precision == "mxfp8" and not gathered
    stamps = _source_stamps(weights_owner, weight_sources, weights) if keeps else {}
    ops = _TritonOps(weights_owner if keeps else None, stamps, weight_sources if keeps else None)
    return tuple(ops._operand(w, precision, along, name) for w, name in zip(weights, ("w_gate_EIH", "w_up_EIH",
                                                                                       "w_down_EHI")))


def _gathered_as_mxfp8(weights, precision: str) -> bool:
    """Whether the weights arrive as their MXFP8 operands (all three, under precision mxfp8) or as values."""
    gathered = [isinstance(w, MXFP8GatheredWeight) for w in weights]
    if any(gathered) and not (all(gathered) and precision == "mxfp8"):
        raise TypeError(f"grouped_swiglu_ffn: MXFP8-gathered weights (w_gate, w_up, w_down: {gathered}) need all "
                        f"three gathered and precision = 'mxfp8', got precision = {precision!r}")
    return all(gathered)


def _source_stamps(owner, sources, weights) -> dict:
    """{weight name: what identifies its values}: the source's version and the compute dtype it was cast to."""
    if owner is None:
        return {}
    if sources is None or len(sources) != 3:
        raise ValueError("grouped_swiglu_ffn: weights_owner needs weight_sources = (w_gate, w_up, w_down), "
                         f"the tensors the weights were made from; got {sources!r}")
    names = ("w_gate_EIH", "w_up_EIH", "w_down_EHI")
    return {n: (weight_cache.stamp(s), w.dtype) for n, s, w in zip(names, sources, weights)}
