"""Expert modules: the routed experts' weights and the shared expert.

Legend: T tokens, R routed rows, H hidden, I expert FFN size, E experts,
L experts held on this rank (E under no EP, E / ep under EP).
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.models.utils import trunc_normal_

from titan_mok.kernels.grouped_ffn import grouped_swiglu_ffn, ref_swiglu
from titan_mok.kernels.mxfp8_gathered import MXFP8GatheredWeight
from titan_mok.kernels.row_tiles import pointwise_padded, row_invariant_linear
from titan_mok.moe.args import MoEArgs
from titan_mok.moe.megakernel import MegakernelConfig
from titan_mok.moe.megakernel_autograd import ExpertPrecision, TokenRouting, megakernel_routed_experts_trainable


def local_expert_weights(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w_gate_LIH, w_up_LIH, w_down_LHI) as plain tensors: this rank's experts (both backends)."""
    return tuple(w.to_local() if isinstance(w, DTensor) else w for w in (experts.w_gate, experts.w_up, experts.w_down))


def init_expert_weights(experts: nn.Module, init_std: float) -> None:
    """w_gate ~ N(0, 0.02), then w_up, w_down ~ N(0, init_std), truncated (TorchTitan's
    scheme). One order for both backends, so one seed gives the same weights."""
    trunc_normal_(experts.w_gate, mean=0.0, std=0.02)
    trunc_normal_(experts.w_up, mean=0.0, std=init_std)
    trunc_normal_(experts.w_down, mean=0.0, std=init_std)


class RoutedExperts(nn.Module):
    """The E routed SwiGLU experts: ``w_gate, w_up [E, I, H]``, ``w_down [E, H, I]``.

    ``forward(x_RH, group_end_L)`` runs the FFN (``titan_mok.kernels.grouped_ffn.grouped_swiglu_ffn``)
    on rows grouped by this rank's experts; ``forward(x_TH, routing=TokenRouting(...))`` (``[mok] kernels =
    "megakernel"``, this rank of ``ep_mesh``'s group, or alone) runs the routed experts and the combine on token rows
    through the megakernel (``titan_mok.moe.megakernel_autograd``). The layer calls it (rather than reading
    the weights itself) so that FSDP's hooks on this module gather the weights.
    Under expert parallelism the weights are DTensors ``Shard(0)`` on the ``ep``
    mesh and ``ep_mesh`` is that mesh (set by the EP strategy).
    """

    def __init__(self, dim: int, args: MoEArgs, use_triton: bool):
        super().__init__()
        self.num_experts = args.num_experts
        self.w_gate = nn.Parameter(torch.empty(args.num_experts, args.expert_dim, dim))
        self.w_up = nn.Parameter(torch.empty(args.num_experts, args.expert_dim, dim))
        self.w_down = nn.Parameter(torch.empty(args.num_experts, dim, args.expert_dim))
        self.precision = args.precision
        self.swiglu_limit = args.swiglu_limit
        self.use_triton = use_triton
        self.kernels = args.kernels
        self.ep_mesh = None
        # Set by parallelize when FSDP (and so EP) gathers these weights before every forward; under
        # mxfp8 they must then arrive as MXFP8 (titan_mok/moe/mxfp8_fsdp.py), never as values to keep
        # quantized copies of (a gathered tensor's version does not identify its values)
        self.weights_gathered = False
        # The megakernel's launch sizes (kernels = "megakernel"); None fields: sized for the device
        self.megakernel_config = MegakernelConfig()
        # Rows these experts computed on this rank (after dispatch), accumulated: summed over the
        # ranks it equals T·K routed slots exactly when no row was dropped (the metrics check it).
        self.register_buffer("rows_computed", torch.zeros(1, dtype=torch.float32), persistent=False)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return local_expert_weights(self)

    def forward(self, x: torch.Tensor, group_end_L: torch.Tensor | None = None,
                routing: TokenRouting | None = None) -> torch.Tensor:
        """Rows grouped by local expert (x_RH [R, H], ends ``group_end_L`` [L]) → expert outputs [R, H] in x's
        dtype; or, with ``routing`` instead of ``group_end_L``, token rows x_TH [T, H] → the combined output
        [T, H] in ``routing.out_dtype`` (the megakernel)."""
        if (group_end_L is None) == (routing is None):
            raise TypeError("RoutedExperts.forward takes grouped rows with group_end_L, or token rows with routing: "
                            "exactly one of the two")
        if routing is not None:
            return self._megakernel(x, routing)
        x_RH = x
        with torch.no_grad():
            self.rows_computed.add_(group_end_L[-1])  # rows past group_end_L[-1] are padding
        sources = self.local_weights()
        self._check_gathered(sources)
        w_gate_LIH, w_up_LIH, w_down_LHI = (w.to(x_RH.dtype) for w in sources)
        # "auto" runs the Triton FFN on CUDA tensors only: a CPU copy of the layer runs the reference
        use_triton = self.use_triton and (x_RH.is_cuda or self.kernels == "triton")
        return grouped_swiglu_ffn(
            x_RH, group_end_L, w_gate_LIH, w_up_LIH, w_down_LHI,
            precision=self.precision, swiglu_limit=self.swiglu_limit, use_triton=use_triton, weights_owner=self,
            weight_sources=sources,
        )

    def _check_gathered(self, sources) -> None:
        if self.weights_gathered and self.precision == "mxfp8" and not isinstance(sources[0], MXFP8GatheredWeight):
            raise RuntimeError("RoutedExperts: FSDP gathered these mxfp8 experts' weights as values, not as MXFP8: "
                               "their parameters lost the MXFP8 all-gather (titan_mok.moe.mxfp8_fsdp.gather_as_mxfp8)")

    def _megakernel(self, x_TH: torch.Tensor, routing: TokenRouting) -> torch.Tensor:
        sources = self.local_weights()
        self._check_gathered(sources)
        # the megakernel reads contiguous weights in the activations' dtype (under AMP: a cast of the fp32 masters);
        # under mxfp8 their MXFP8 operands, kept under this module as the Triton FFN keeps them
        weights = tuple(w.to(x_TH.dtype).contiguous() for w in sources)
        group = self.ep_mesh.get_group() if self.ep_mesh is not None and self.ep_mesh.size() > 1 else None
        out_TH, group_end_L = megakernel_routed_experts_trainable(
            x_TH, routing, weights, num_experts=self.num_experts, group=group, swiglu_limit=self.swiglu_limit,
            config=self.megakernel_config, experts_precision=ExpertPrecision(self.precision, self, sources))
        with torch.no_grad():
            self.rows_computed.add_(group_end_L[-1])
        return out_TH

    def init_weights(self, init_std: float) -> None:
        init_expert_weights(self, init_std)
        self.rows_computed.zero_()


class SharedExpert(nn.Module):
    """Always-on SwiGLU FFN, computed in the activations' dtype (BF16 in training).

    Parameters: ``w_gate.weight [I, H]``, ``w_up.weight [I, H]``, ``w_down.weight [H, I]``,
    and with ``output_gate``: ``output_gate.weight [1, H]`` (Qwen3.5's
    ``shared_expert_gate``: output · sigmoid(x · output_gate)).

    With ``use_triton`` (the routed experts' setting) and BF16 CUDA activations it runs as one
    expert through the routed experts' Triton FFN (``grouped_swiglu_ffn``, all T rows in
    one group): row-invariant by construction, two launches forward instead of a GEMM
    per 64-row tile. Otherwise on 64-row tiles (``row_invariant_linear``).
    """

    def __init__(self, dim: int, hidden_dim: int, output_gate: bool, swiglu_limit: float | None, use_triton: bool):
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden_dim, bias=False)
        self.w_up = nn.Linear(dim, hidden_dim, bias=False)
        self.w_down = nn.Linear(hidden_dim, dim, bias=False)
        self.output_gate = nn.Linear(dim, 1, bias=False) if output_gate else None
        self.swiglu_limit = swiglu_limit
        self.use_triton = use_triton

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        """Returns the shared output [T, H]: x's dtype, or fp32 when gated (the
        combine adds it in fp32 and rounds once)."""
        dtype = x_TH.dtype
        w_gate_IH, w_up_IH, w_down_HI = (linear.weight.to(dtype) for linear in (self.w_gate, self.w_up, self.w_down))
        if self.use_triton and dtype == torch.bfloat16 and x_TH.is_cuda:
            group_end_1 = torch.full((1,), x_TH.shape[0], dtype=torch.int32, device=x_TH.device)
            # [I, H] -> [1, I, H]: one expert holding every row
            y_TH = grouped_swiglu_ffn(
                x_TH, group_end_1, w_gate_IH[None], w_up_IH[None], w_down_HI[None],
                swiglu_limit=self.swiglu_limit, use_triton=True,
            )
        else:
            gate_TI = row_invariant_linear(x_TH, w_gate_IH)
            up_TI = row_invariant_linear(x_TH, w_up_IH)
            y_TH = row_invariant_linear(ref_swiglu(gate_TI, up_TI, self.swiglu_limit), w_down_HI)
        if self.output_gate is None:
            return y_TH
        gate_logit_T1 = row_invariant_linear(x_TH.float(), self.output_gate.weight.float())
        return y_TH.float() * pointwise_padded(torch.sigmoid, gate_logit_T1)

    def init_weights(self, init_std: float) -> None:
        trunc_normal_(self.w_gate.weight, mean=0.0, std=0.02)
        for linear in (self.w_up, self.w_down):
            trunc_normal_(linear.weight, mean=0.0, std=init_std)
        if self.output_gate is not None:
            trunc_normal_(self.output_gate.weight, mean=0.0, std=init_std)
