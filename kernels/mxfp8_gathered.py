"""An expert weight that arrives as its MXFP8 operands: what FSDP's MXFP8 all-gather hands the expert FFN.

Under FSDP with ``precision = "mxfp8"`` (``titan_mok.moe.mxfp8_fsdp``) the all-gather moves each expert
weight's MXFP8 data and E8M0 scales, not bf16, and the unsharded parameter the FFN reads is an
``MXFP8GatheredWeight``: a tensor with the weight's shape and dtype (autograd leaf, gradient in that
dtype) that holds no bf16 values, only the MXFP8 operands of the layouts this gather brought, by
``along`` as ``grouped_ffn.weight_operand`` names them (2: the forward's, blocked along the stored
weight's last dim; 1: the dgrad's, blocked along dim 1 and stored transposed). The FFN reads them as
they are (``operand``): nothing is quantized in the forward or backward.

FSDP makes the gathered parameter once and refills it on every later all-gather; autograd and DTensor
hand out views and detached aliases of it. All of them share one ``GatheredOperands``, so a view saved
for the backward reads what the backward's all-gather brought.

Legend: E experts held here, X, Y the stored weight's dims ([E, X, Y]).
"""

import torch
from torch.utils._pytree import tree_map_only

from titan_mok.kernels.mxfp8 import MXTensor

LAYOUT_NAMES = {2: "forward", 1: "dgrad"}
"""``along`` -> which GEMMs read that layout (the names used in messages)."""


class GatheredOperands:
    """The MXFP8 operands of one gathered weight, by ``along``; replaced by each all-gather."""

    def __init__(self, operands: dict[int, MXTensor]):
        self.operands = operands


class MXFP8GatheredWeight(torch.Tensor):
    """Expert weight [E, X, Y] whose values exist only as MXFP8 operands (module docstring)."""

    @staticmethod
    def __new__(cls, gathered: GatheredOperands, shape, dtype: torch.dtype, device, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)

    def __init__(self, gathered: GatheredOperands, shape, dtype, device, requires_grad: bool = False):
        self.gathered = gathered

    def operand(self, along: int, name: str) -> MXTensor:
        """The MXFP8 operand blocked ``along`` (as ``grouped_ffn.weight_operand`` makes it)."""
        operands = self.gathered.operands
        if along not in operands:
            held = ", ".join(LAYOUT_NAMES[a] for a in sorted(operands)) or "none"
            raise RuntimeError(
                f"{name}: the {LAYOUT_NAMES[along]} GEMMs need the MXFP8 layout along dim {along}, but this "
                f"all-gather brought only: {held}. FSDP gathers the dgrad layout again in the backward only when "
                "it reshards after forward; titan_mok.moe.mxfp8_fsdp chooses the layouts per gather")
        return operands[along]

    def __repr__(self):
        return (f"MXFP8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"layouts={[LAYOUT_NAMES[a] for a in sorted(self.gathered.operands)]})")

    # Views and aliases with the weight's own shape share its operands: FSDP's unsharded parameter
    # (as_strided, detach), DTensor.to_local (view_as). Empty/zero tensors like it are plain (FSDP's
    # zero gradient); anything that would read its values raises.
    _ALIASES = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.view.default,
                torch.ops.aten.as_strided.default, torch.ops.aten._unsafe_view.default}
    _PLAIN_LIKE = {torch.ops.aten.zeros_like.default, torch.ops.aten.empty_like.default}

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = args[0]
        if func in cls._ALIASES and isinstance(weight, cls):
            out_shape = _alias_shape(func, weight, args, kwargs)
            if out_shape == tuple(weight.shape):
                return cls(weight.gathered, weight.shape, weight.dtype, weight.device)
        if func in cls._PLAIN_LIKE:
            args, kwargs = tree_map_only(
                cls, lambda w: torch.empty(w.shape, dtype=w.dtype, device=w.device), (args, kwargs))
            return func(*args, **kwargs)
        raise TypeError(
            f"{func}: an MXFP8-gathered expert weight holds only its MXFP8 operands (kernels/mxfp8_gathered.py); "
            f"the expert FFN reads them, and only views of its whole shape {tuple(weight.shape)} and dtype "
            f"{weight.dtype} are supported")


def _alias_shape(func, weight: torch.Tensor, args, kwargs) -> tuple | None:
    """The shape an aliasing op gives, or None when it is a view that changes strides or offset."""
    if func is torch.ops.aten.as_strided.default:
        size, stride = tuple(args[1]), tuple(args[2])
        offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
        return size if stride == weight.stride() and not offset else None
    if func in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
        return tuple(args[1])
    return tuple(weight.shape)
