"""FSDP2 all-gathers the routed-expert weights as MXFP8 (``precision = "mxfp8"`` under FSDP, and so under EP).

Each rank quantizes its own shard of each expert weight, from the bits the bf16 path would gather
(the parameter cast to FSDP's ``param_dtype``), once per optimizer step per layout, inside the step
(``kernels/weight_cache.py`` keeps them and ``weight_cache.step_post_hook``, the trainers' optimizer step
post-hook, makes them again), and the all-gather moves E4M3 data and E8M0 scales as uint8: (1 + 1/32)
bytes per element against bf16's 2. The kept copies are stale after ``weight_cache.weights_written()``
(the checkpointer's load, the RL reference policy's swaps: made again at their next gather) and after an
in-place write through the parameter (its ``_version``); a write through another alias of the shard's
storage (the state dict's tensors) must call ``weights_written``: in-place ops on a DTensor leave its
local tensor's version as it was. The expert FFN reads the gathered operands as they are
(``kernels/mxfp8_gathered.py``), the reference kernels included; the weight gradients and their
reduce-scatter stay in bf16/fp32.

The hook is FSDP2's all-gather extension: the shard's local tensor is an ``MXFP8ShardWeight`` (a tensor
subclass over the plain fp32 shard) with ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``; everything else
it meets (the optimizer, initialization, ``to_empty``, checkpoint loads) runs on the plain shard, and the
module's state dict holds the plain shard (checkpoints carry no subclass; the MXFP8 copies are derived
state, never saved).

Which layouts a gather carries (``gather_layouts``): the forward's GEMMs read the weights blocked along their
last dim (``along`` 2), the dgrad's blocked along dim 1 (``along`` 1). When FSDP reshards after forward and
the layer's forward is not recomputed in the backward, the forward's all-gather brings the forward layout
and the backward's all-gather the dgrad layout: each moves (1 + 1/32) / 2 of the bf16 bytes. Otherwise one
all-gather serves both (no reshard: the forward's gather is kept for the backward; activation
checkpointing: the backward's gather also serves the recomputed forward) and carries both layouts,
(1 + 1/32) of the bf16 bytes: FSDP2 sizes each parameter's all-gather buffers at its first gather, so every
gather of a parameter moves the same number of bytes.

What FSDP2's extension points cannot express: sharding along a dim other than 0 (FSDP copies each gathered
tensor out through views of the parameter's shard shape, which the 1/32-size scales do not have) and uneven
dim-0 shards (every all-gather input must then have the padded shard's shape). So each rank must hold whole
experts, the same number on each: ``gather_as_mxfp8`` raises otherwise (TorchTitan shards the experts along
dim 1 exactly when there are fewer experts per EP rank than expert-FSDP ranks). A one-rank shard group
gathers nothing: FSDP2 copies only the first all-gather input there, so its operands go as one packed buffer.

Legend: S experts in this rank's shard, E = S * shard ranks experts gathered, X, Y the stored weight's dims
(``w_gate``, ``w_up`` [., I, H]; ``w_down`` [., H, I]).
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.autograd.graph import increment_version
from torch.utils._pytree import tree_leaves, tree_map_only

from titan_mok.kernels import weight_cache
from titan_mok.kernels.grouped_ffn import weight_operand
from titan_mok.kernels.mxfp8 import BLOCK, SCALE_DTYPE, MXTensor
from titan_mok.kernels.mxfp8_gathered import GatheredOperands, MXFP8GatheredWeight
from titan_mok.moe.experts import RoutedExperts

WEIGHT_NAMES = ("w_gate", "w_up", "w_down")
FORWARD, DGRAD = 2, 1
"""``along`` of each layout (``grouped_ffn.weight_operand``)."""


def gather_layouts(reshards_after_forward: bool, recomputes_forward: bool) -> dict[str, tuple[int, ...]]:
    """The layouts each all-gather carries, by the pass it runs in ("forward" / "backward": inside
    autograd's backward, where FSDP gathers again and where activation checkpointing recomputes)."""
    if reshards_after_forward and not recomputes_forward:
        return {"forward": (FORWARD,), "backward": (DGRAD,)}
    return {"forward": (FORWARD, DGRAD), "backward": (FORWARD, DGRAD)}


def gather_as_mxfp8(experts: RoutedExperts, shard_degree: int, layouts: dict[str, tuple[int, ...]]) -> None:
    """Before ``fully_shard``: makes FSDP gather ``experts``' weights as MXFP8, ``layouts`` per pass
    (``gather_layouts``); ``shard_degree``: the ranks FSDP shards these weights over."""
    if experts.precision != "mxfp8":
        raise ValueError(f"gather_as_mxfp8: the experts run precision = {experts.precision!r}, not 'mxfp8'")
    local_experts = experts.w_gate.to_local().shape[0] if isinstance(experts.w_gate, DTensor) else experts.num_experts
    if local_experts % shard_degree:
        raise ValueError(
            f"precision = 'mxfp8' under FSDP gathers whole experts as MXFP8: the {local_experts} experts held per EP "
            f"rank must split evenly over the {shard_degree} ranks FSDP shards them over (expert-FSDP degree = "
            "data_parallel_shard_degree / expert_parallel_degree under EP, else data_parallel_shard_degree); "
            "pick degrees that divide them, or precision = 'bf16'")
    if set(layouts) != {"forward", "backward"} or not all(set(v) <= {FORWARD, DGRAD} and v for v in layouts.values()):
        raise ValueError(f"gather_as_mxfp8: layouts must map 'forward' and 'backward' to alongs in (2, 1), "
                         f"got {layouts}")
    for name in WEIGHT_NAMES:
        param = getattr(experts, name)
        local = param.detach().to_local() if isinstance(param, DTensor) else param.detach()
        if isinstance(local, MXFP8ShardWeight):
            raise ValueError(f"gather_as_mxfp8: {name} is gathered as MXFP8 already")
        shard = MXFP8ShardWeight(local, name, layouts)
        if isinstance(param, DTensor):
            shard = DTensor.from_local(shard, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                       stride=param.stride())
        experts.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
    experts.register_state_dict_post_hook(_plain_state_dict)


def _plain_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """The state dict holds the plain shards (the same storage): checkpoints save and load plain tensors."""
    for name in WEIGHT_NAMES:
        value = state_dict[prefix + name]
        if isinstance(value, DTensor) and isinstance(value.to_local(), MXFP8ShardWeight):
            state_dict[prefix + name] = DTensor.from_local(
                value.to_local().plain, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                stride=value.stride())
        elif isinstance(value, MXFP8ShardWeight):
            state_dict[prefix + name] = value.plain


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (FSDP's own test for it)."""
    return torch._C._current_graph_task_id() != -1


class MXFP8ShardWeight(torch.Tensor):
    """The local tensor of a routed-expert weight's FSDP shard (``plain``: the fp32 master values),
    carrying FSDP2's all-gather extension (module docstring): ``layouts`` by pass (``gather_layouts``)."""

    @staticmethod
    def __new__(cls, plain: torch.Tensor, name: str, layouts: dict[str, tuple[int, ...]]):
        return torch.Tensor._make_wrapper_subclass(cls, plain.shape, strides=plain.stride(), dtype=plain.dtype,
                                                   device=plain.device)

    def __init__(self, plain: torch.Tensor, name: str, layouts: dict[str, tuple[int, ...]]):
        self.plain, self.weight_name, self.layouts = plain, name, layouts

    def __repr__(self):
        return f"MXFP8ShardWeight({self.weight_name}, {self.plain!r})"

    # Ops that make the same weight in a new tensor object stay wrapped (FSDP's sharding: new_zeros, slice,
    # view; nn.Parameter: detach; to_empty: empty_like); every other op runs on the plain shard and
    # returns plain tensors (optimizer states, gradients, checkpoint copies).
    _SAME_WEIGHT = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.view.default,
                    torch.ops.aten.slice.Tensor, torch.ops.aten.as_strided.default, torch.ops.aten.new_zeros.default,
                    torch.ops.aten.empty_like.default}

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        plain_args, plain_kwargs = tree_map_only(cls, lambda t: t.plain, (args, kwargs or {}))
        out = func(*plain_args, **plain_kwargs)
        if func._schema.is_mutable:
            # An op run here on the local tensor of a DTensor leaves its _version as it was; the kept
            # MXFP8 copies' stamp reads it, so writes through the parameter bump it here
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, cls):
                    increment_version(t.plain)
        if func in cls._SAME_WEIGHT:
            return cls(out, args[0].weight_name, args[0].layouts)
        return out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        layouts = self.layouts["backward" if _in_backward() else "forward"]
        dtype = mp_policy.param_dtype or self.plain.dtype
        plain, name = self.plain, self.weight_name
        packed = weight_cache.operand(  # kept under the experts module, made again in each optimizer step
            module, name, layouts, (weight_cache.stamp(plain), dtype),
            lambda: _packed_operands(plain.to(dtype), layouts, name),
            lambda: ((weight_cache.stamp(plain), dtype), _packed_operands(plain.to(dtype), layouts, name)))
        inputs = (packed,) if mesh.size() == 1 else _unpacked(packed, self.shape, layouts)
        return inputs, (layouts, mesh.size() == 1)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        layouts, packed = metadata
        shape = self.shape if packed else (outputs[0].shape[0], *self.shape[1:])
        pieces = _unpacked(outputs[0], shape, layouts) if packed else outputs
        operands = {along: MXTensor(data=data.view(torch.float8_e4m3fn), scale=scale.view(SCALE_DTYPE), dim=2,
                                    mma_order=True)
                    for along, data, scale in zip(layouts, pieces[0::2], pieces[1::2])}
        if out is not None:  # FSDP refills the gathered parameter it made at the first all-gather
            gathered = out._local_tensor if isinstance(out, DTensor) else out
            gathered.gathered.operands = operands
            return None
        # The all-gather outputs hold the operands; FSDP frees and refills those itself: no inner tensors
        return MXFP8GatheredWeight(GatheredOperands(operands), shape, param_dtype, self.device), ()


def _packed_operands(w_SXY: torch.Tensor, layouts: tuple[int, ...], name: str) -> torch.Tensor:
    """The MXFP8 data and scales (uint8) of each layout of ``w_SXY``, one after another in one buffer.
    The Triton quantizer on CUDA, the reference elsewhere: the same bits (tests/kernels/test_mxfp8_quant.py)."""
    parts = []
    for along in layouts:
        op = weight_operand(w_SXY, "mxfp8", along, name, reference=not w_SXY.is_cuda)
        parts += [op.data.view(torch.uint8).reshape(-1), op.scale.view(torch.uint8).reshape(-1)]
    return torch.cat(parts)


def _unpacked(packed: torch.Tensor, shape, layouts: tuple[int, ...]) -> list[torch.Tensor]:
    """Views of ``packed`` (``_packed_operands`` of a weight of ``shape`` [S, X, Y]): per layout its data
    [S, N, K] and scales [S, N, K/32] ([N, K] = [X, Y] along 2, [Y, X] along 1), each contiguous."""
    num, dim_x, dim_y = shape
    pieces, start = [], 0
    for along in layouts:
        n, k = (dim_x, dim_y) if along == FORWARD else (dim_y, dim_x)
        for size in ((num, n, k), (num, n, k // BLOCK)):
            count = size[0] * size[1] * size[2]
            pieces.append(packed[start:start + count].view(size))
            start += count
    return pieces
