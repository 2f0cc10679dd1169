"""Reference routed-expert FFN on rows grouped by expert (SwiGLU, optional clamp).

Legend: R routed rows (grouped by expert), H hidden, I expert FFN size,
L experts held here (local experts under EP).

Same signature as seam #2 (``titan_mok.kernels.grouped_ffn.grouped_swiglu_ffn``),
so the layer can route through either. Every GEMM that produces a row runs on
fixed TILE_M-row tiles (``tiled_mm``): a row's output and input gradient do not
depend on the other rows (row-batch-invariant). Weight gradients are one GEMM
per expert over its rows in their grouped order (rank, token, slot): fixed
order, no atomics.
"""

import torch
import torch.nn.functional as F

from titan_mok.moe.tiles import map_row_tiles, tiled_mm


def _clamped(gate_RI: torch.Tensor, up_RI: torch.Tensor, limit: float | None):
    """fp32 copies of gate/up with DeepSeek-V4's clamp: gate ≤ limit, |up| ≤ limit."""
    gate_RI, up_RI = gate_RI.float(), up_RI.float()
    if limit is not None:
        gate_RI = gate_RI.clamp(max=limit)
        up_RI = up_RI.clamp(min=-limit, max=limit)
    return gate_RI, up_RI


def swiglu(gate_RI: torch.Tensor, up_RI: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(gate) · up in fp32 (clamped if limit), rounded once to the input dtype."""
    gate32_RI, up32_RI = _clamped(gate_RI, up_RI, limit)
    return (F.silu(gate32_RI) * up32_RI).to(gate_RI.dtype)


def _tiled_swiglu(gate_RI: torch.Tensor, up_RI: torch.Tensor, limit: float | None) -> torch.Tensor:
    return map_row_tiles(lambda gate, up: swiglu(gate, up, limit), gate_RI, up_RI)


def _swiglu_backward(gate_RI, up_RI, dhidden_RI, limit: float | None):
    """(dgate, dup) in the input dtype, computed in fp32; zero where the clamp clipped."""
    gate32_RI, up32_RI = _clamped(gate_RI, up_RI, limit)
    dh32_RI = dhidden_RI.float()
    sig_RI = torch.sigmoid(gate32_RI)
    dgate_RI = dh32_RI * up32_RI * sig_RI * (1 + gate32_RI * (1 - sig_RI))
    dup_RI = dh32_RI * gate32_RI * sig_RI
    if limit is not None:  # clamp passes the gradient only where it did not clip
        dgate_RI = dgate_RI * (gate_RI.float() <= limit)
        dup_RI = dup_RI * (up_RI.float().abs() <= limit)
    return dgate_RI.to(gate_RI.dtype), dup_RI.to(up_RI.dtype)


def _group_bounds_sync(group_end_L: torch.Tensor, num_rows: int) -> list[tuple[int, int]]:
    # NOTE: host sync: the reference loops over experts on the host.
    ends = group_end_L.tolist()
    if ends and ends[-1] != num_rows:
        raise ValueError(f"group_end_E[-1] = {ends[-1]} but x_RH has {num_rows} rows; they must be equal")
    starts = [0] + ends[:-1]
    if any(end < start for start, end in zip(starts, ends)):
        raise ValueError(f"group_end_E must be non-decreasing, got {ends}")
    return list(zip(starts, ends))


class _GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RH, group_end_L, w_gate_LIH, w_up_LIH, w_down_LHI, limit):
        bounds = _group_bounds_sync(group_end_L, x_RH.shape[0])
        num_rows, dim_i = x_RH.shape[0], w_gate_LIH.shape[1]
        gate_RI = x_RH.new_empty(num_rows, dim_i)
        up_RI = x_RH.new_empty(num_rows, dim_i)
        y_RH = x_RH.new_empty(num_rows, x_RH.shape[1])
        for e, (start, end) in enumerate(bounds):
            if start == end:
                continue
            x_rH = x_RH[start:end]
            gate_RI[start:end] = tiled_mm(x_rH, w_gate_LIH[e].t())
            up_RI[start:end] = tiled_mm(x_rH, w_up_LIH[e].t())
            hidden_rI = _tiled_swiglu(gate_RI[start:end], up_RI[start:end], limit)
            y_RH[start:end] = tiled_mm(hidden_rI, w_down_LHI[e].t())
        ctx.save_for_backward(x_RH, gate_RI, up_RI, w_gate_LIH, w_up_LIH, w_down_LHI)
        ctx.bounds, ctx.limit = bounds, limit
        return y_RH

    @staticmethod
    def backward(ctx, dy_RH):
        x_RH, gate_RI, up_RI, w_gate_LIH, w_up_LIH, w_down_LHI = ctx.saved_tensors
        dy_RH = dy_RH.contiguous()
        dx_RH = torch.zeros_like(x_RH)
        dw_gate_LIH, dw_up_LIH, dw_down_LHI = (torch.zeros_like(w) for w in (w_gate_LIH, w_up_LIH, w_down_LHI))
        for e, (start, end) in enumerate(ctx.bounds):
            if start == end:
                continue
            x_rH, dy_rH = x_RH[start:end], dy_RH[start:end]
            gate_rI, up_rI = gate_RI[start:end], up_RI[start:end]
            dhidden_rI = tiled_mm(dy_rH, w_down_LHI[e])
            dgate_rI, dup_rI = map_row_tiles(
                lambda g, u, dh: _swiglu_backward(g, u, dh, ctx.limit), gate_rI, up_rI, dhidden_rI
            )
            dx_RH[start:end] = (tiled_mm(dgate_rI, w_gate_LIH[e]).float() + tiled_mm(dup_rI, w_up_LIH[e]).float()).to(
                x_RH.dtype
            )
            dw_down_LHI[e] = torch.mm(dy_rH.t(), _tiled_swiglu(gate_rI, up_rI, ctx.limit))
            dw_gate_LIH[e] = torch.mm(dgate_rI.t(), x_rH)
            dw_up_LIH[e] = torch.mm(dup_rI.t(), x_rH)
        return dx_RH, None, dw_gate_LIH, dw_up_LIH, dw_down_LHI, None


def ref_grouped_swiglu_ffn(
    x_RH: torch.Tensor,
    group_end_L: torch.Tensor,
    w_gate_LIH: torch.Tensor,
    w_up_LIH: torch.Tensor,
    w_down_LHI: torch.Tensor,
    *,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """y_RH[r] = w_down[e] · swiglu(w_gate[e] · x[r], w_up[e] · x[r]) for the expert e owning row r.

    group_end_L: cumulative row counts per expert ([L], int), rows of expert e are
    ``group_end[e-1]:group_end[e]``. GEMMs run in x's dtype (the activations'),
    the SwiGLU in fp32. Autograd-capable.
    """
    num_local = w_gate_LIH.shape[0]
    dim_h = x_RH.shape[-1]
    dim_i = w_gate_LIH.shape[1]
    if x_RH.dim() != 2:
        raise ValueError(f"x_RH must be [rows, hidden], got shape {tuple(x_RH.shape)}")
    if w_up_LIH.shape != (num_local, dim_i, dim_h) or w_gate_LIH.shape[2] != dim_h:
        raise ValueError(
            f"w_gate {tuple(w_gate_LIH.shape)} / w_up {tuple(w_up_LIH.shape)} must both be [L, I, H] with H = {dim_h}"
        )
    if w_down_LHI.shape != (num_local, dim_h, dim_i):
        raise ValueError(f"w_down must be [L, H, I] = {(num_local, dim_h, dim_i)}, got {tuple(w_down_LHI.shape)}")
    if group_end_L.shape != (num_local,):
        raise ValueError(f"group_end must be [L] = [{num_local}], got {tuple(group_end_L.shape)}")
    if not (x_RH.dtype == w_gate_LIH.dtype == w_up_LIH.dtype == w_down_LHI.dtype):
        raise TypeError(
            f"x_RH ({x_RH.dtype}) and expert weights ({w_gate_LIH.dtype}, {w_up_LIH.dtype}, {w_down_LHI.dtype}) "
            "must share one dtype"
        )
    return _GroupedSwiGLU.apply(x_RH.contiguous(), group_end_L, w_gate_LIH, w_up_LIH, w_down_LHI, swiglu_limit)
