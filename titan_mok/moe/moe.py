"""titan-mok's MoE layer: router → (routed experts ∥ shared expert) → combine.

Legend: B batch, S sequence, T = B·S tokens, H hidden, I expert FFN size,
E experts, L local experts, K top-k, R routed rows on this rank.

One module for all four models (docs/design.md, the MoE layer). Parameters (state-dict names):
``router.gate.weight [E, H]``, ``experts.w_gate / w_up [E, I, H]``,
``experts.w_down [E, H, I]``, ``shared_expert.{w_gate, w_up}.weight [I_s, H]``,
``shared_expert.w_down.weight [H, I_s]``, ``shared_expert.output_gate.weight [1, H]``
(gated shared expert only). Buffers: ``expert_bias [E]`` fp32 (persistent),
``tokens_per_expert [E]`` fp32 (TorchTitan's load-balancing hook reads and
zeroes it), ``expert_load [E]`` fp32 (metrics read and zero it),
``router.hash_table [V, K]`` int64 (hash-routed layers).
"""

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torchtitan.tools.utils import has_cuda_capability


from titan_mok.attached_loss import attach_loss
from titan_mok.kernels.mok_combine import ref_slot_reduce
from titan_mok.kernels.row_tiles import autocast_dtype
from titan_mok.moe.args import MoEArgs
from titan_mok.moe.aux_loss import load_balance_aux_loss
from titan_mok.moe.dispatch import build_dispatch_handle, combine, dispatch, shared_output
from titan_mok.moe.experts import RoutedExperts, SharedExpert
from titan_mok.moe.fused import fused_routed_experts
from titan_mok.moe.megakernel_autograd import TokenRouting
from titan_mok.moe.router import TopKRouter
from titan_mok.moe.torchtitan_backend import TorchTitanExperts, routed_torchtitan


KERNELS = ("auto", "reference", "triton", "megakernel")
"""The choices of ``[mok] kernels`` (MoEArgs.kernels)."""


def check_moe_args(args: MoEArgs, dim: int) -> None:
    """Build-time validation; errors name the MoEArgs field and what is allowed."""
    if dim <= 0 or args.expert_dim <= 0 or args.num_experts <= 0:
        raise ValueError(
            f"MoE dims must be positive: dim={dim}, expert_dim={args.expert_dim}, num_experts={args.num_experts}"
        )
    if not 1 <= args.top_k <= args.num_experts:
        raise ValueError(f"MoEArgs.top_k = {args.top_k} must be in [1, num_experts = {args.num_experts}]")
    if args.score_func not in ("sigmoid", "softmax", "sqrtsoftplus"):
        raise ValueError(f"MoEArgs.score_func = {args.score_func!r}; choose 'sigmoid', 'softmax' or 'sqrtsoftplus'")
    if args.num_expert_groups is not None:
        groups, kept = args.num_expert_groups, args.num_limited_groups
        if groups <= 0 or args.num_experts % groups or args.num_experts // groups < 2:
            raise ValueError(
                f"MoEArgs.num_expert_groups = {groups} must divide num_experts = {args.num_experts} "
                "into groups of at least 2 experts"
            )
        if kept is None or not 1 <= kept <= groups:
            raise ValueError(f"MoEArgs.num_limited_groups = {kept} must be in [1, num_expert_groups = {groups}]")
        if args.top_k > kept * (args.num_experts // groups):
            raise ValueError(
                f"MoEArgs.top_k = {args.top_k} exceeds the {kept * (args.num_experts // groups)} experts "
                f"in num_limited_groups = {kept} groups"
            )
    elif args.num_limited_groups is not None:
        raise ValueError("MoEArgs.num_limited_groups is set but num_expert_groups is None; set both or neither")
    if args.hash_routing and args.hash_vocab_size <= 0:
        raise ValueError(f"MoEArgs.hash_vocab_size = {args.hash_vocab_size}: hash routing needs the vocabulary size")
    if args.hash_routing and args.num_expert_groups is not None:
        raise ValueError("MoEArgs.hash_routing and num_expert_groups exclude each other")
    if args.load_balance_coeff is not None and args.load_balance_coeff <= 0:
        raise ValueError(f"MoEArgs.load_balance_coeff = {args.load_balance_coeff} must be > 0 or None")
    if args.aux_loss_coef < 0:
        raise ValueError(f"MoEArgs.aux_loss_coef = {args.aux_loss_coef} must be >= 0")
    for name in ("swiglu_limit", "shared_expert_swiglu_limit"):
        limit = getattr(args, name)
        if limit is not None and limit <= 0:
            raise ValueError(f"MoEArgs.{name} = {limit} must be > 0 or None")
    if args.shared_expert_dim < 0 or (args.shared_expert_gate and args.shared_expert_dim == 0):
        raise ValueError(
            f"MoEArgs.shared_expert_dim = {args.shared_expert_dim} must be >= 0, and > 0 when shared_expert_gate"
        )
    if args.max_rows_per_rank is not None and args.max_rows_per_rank <= 0:
        raise ValueError(f"MoEArgs.max_rows_per_rank = {args.max_rows_per_rank} must be > 0 or None")
    if args.backend not in ("mok", "torchtitan"):
        raise ValueError(f"MoEArgs.backend = {args.backend!r}; choose 'mok' or 'torchtitan'")
    if args.precision not in ("bf16", "mxfp8"):
        raise ValueError(f"MoEArgs.precision = {args.precision!r}; choose 'bf16' or 'mxfp8'")
    if args.precision == "mxfp8" and (dim % 32 or args.expert_dim % 32):
        raise ValueError(f"MoEArgs.precision = 'mxfp8' needs dim ({dim}) and expert_dim ({args.expert_dim}) "
                         "to be multiples of 32 (the MXFP8 block)")
    if args.backend == "torchtitan" and (args.precision != "bf16" or args.kernels in ("triton", "megakernel")):
        raise ValueError(
            "MoEArgs.backend = 'torchtitan' is TorchTitan's bf16 grouped GEMM baseline: it needs precision 'bf16' "
            f"and kernels 'auto' or 'reference', got precision {args.precision!r}, kernels {args.kernels!r}"
        )
    if args.kernels not in KERNELS:
        raise ValueError(f"MoEArgs.kernels = {args.kernels!r}; choose one of {list(KERNELS)}")
    if args.kernels in ("triton", "megakernel") and not has_cuda_capability(9, 0):
        raise ValueError(f"MoEArgs.kernels = {args.kernels!r} needs a CUDA GPU with compute capability >= 9.0; "
                         "use 'reference' or 'auto'")
    if args.kernels == "megakernel" and args.max_rows_per_rank is not None:
        raise ValueError(f"MoEArgs.max_rows_per_rank = {args.max_rows_per_rank} bounds the reference schedule's "
                         "receive buffer; kernels = 'megakernel' has none (a fixed ring, dropless): set it to None")


def routed_experts_on_triton(kernels: str) -> bool:
    """Whether ``[mok] kernels`` runs the experts' Triton FFN (kernels/grouped_ffn.py) here: "triton",
    "megakernel", or "auto" on Hopper or newer."""
    return kernels in ("triton", "megakernel") or (kernels == "auto" and has_cuda_capability(9, 0))


def routed_schedule(kernels: str, max_rows_per_rank: int | None, hopper_tensors: bool, fixed_token_count: bool) -> str:
    """How a call's rows reach the experts and come back: "reference" (``titan_mok.moe.dispatch``: host-known
    counts, ``all_to_all_single``), "fused" (``titan_mok.moe.fused``: symmetric memory, no host sync) or
    "megakernel" (``titan_mok.moe.megakernel_autograd``).

    "auto" takes the fastest measured path: "fused" (the ``"triton"`` kernels) for CUDA tensors on SM90+
    (``hopper_tensors``), since it beat the reference schedule with the Triton FFN in every shape measured,
    forward and backward; but "reference" where the fused path cannot run: with ``max_rows_per_rank`` set (the
    fused buffers are sized for the worst case), or when the token count may change between calls or differ
    between EP ranks (``fixed_token_count`` False: RL rollouts; the fused buffers are allocated per count,
    collectively). Elsewhere (CPU tensors, older GPUs) "reference"."""
    if kernels == "auto":
        fused = hopper_tensors and max_rows_per_rank is None and fixed_token_count
        return "fused" if fused else "reference"
    return {"reference": "reference", "triton": "fused", "megakernel": "megakernel"}[kernels]


class MoE(nn.Module):
    def __init__(self, args: MoEArgs, dim: int):
        super().__init__()
        check_moe_args(args, dim)
        self.args = args
        self.dim = dim
        # The experts' FFN (kernels/grouped_ffn.py): Triton kernels on Hopper under "auto" (routed and,
        # in BF16, shared).
        self.use_triton = routed_experts_on_triton(args.kernels)
        # Whether every call has the same token count, on every EP rank (training); RL rollouts clear it
        # (titan_mok.rl.trainer), so that "auto" keeps the reference schedule there (routed_schedule).
        self.fixed_token_count = True
        self.router = TopKRouter(args, dim)
        if args.backend == "mok":
            self.experts = RoutedExperts(dim, args, self.use_triton)
        else:
            self.experts = TorchTitanExperts(dim, args.expert_dim, args.num_experts, args.swiglu_limit)
        self.shared_expert = (
            SharedExpert(
                dim, args.shared_expert_dim, args.shared_expert_gate, args.shared_expert_swiglu_limit, self.use_triton
            )
            if args.shared_expert_dim > 0
            else None
        )
        # TorchTitan's build_optimizers_with_moe_load_balancing reads these three.
        self.load_balance_coeff = args.load_balance_coeff if args.use_expert_bias else None
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32), persistent=False)
        self.register_buffer("expert_load", torch.zeros(args.num_experts, dtype=torch.float32), persistent=False)

    def _check_inputs(self, x_BSH: torch.Tensor, token_ids_BS: torch.Tensor | None) -> None:
        if x_BSH.dim() != 3 or x_BSH.shape[-1] != self.dim:
            raise ValueError(f"MoE input x_BSH must be [batch, seq, {self.dim}], got shape {tuple(x_BSH.shape)}")
        if x_BSH.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"MoE input x_BSH must be float32, bfloat16 or float16, got {x_BSH.dtype}")
        if x_BSH.device != self.expert_bias.device:
            raise ValueError(f"MoE input x_BSH is on {x_BSH.device} but the layer's buffers are on {self.expert_bias.device}")
        if self.args.hash_routing:
            if token_ids_BS is None:
                raise ValueError("this MoE layer is hash-routed: forward needs token_ids_BS")
            if token_ids_BS.shape != x_BSH.shape[:2] or token_ids_BS.dtype not in (torch.int32, torch.int64):
                raise ValueError(
                    f"token_ids_BS must be int32/int64 of shape {tuple(x_BSH.shape[:2])}, "
                    f"got {token_ids_BS.dtype} {tuple(token_ids_BS.shape)}"
                )

    def _ep_group(self) -> dist.ProcessGroup | None:
        mesh = self.experts.ep_mesh
        return mesh.get_group() if mesh is not None and mesh.size() > 1 else None

    def _check_data_all_ranks(self, logits_TE, token_ids_T, group) -> None:
        """NaN/Inf router logits or out-of-range token ids on any EP rank raise the same
        error on every rank (one rank raising alone would leave the others waiting in
        the dispatch collectives). NOTE: host sync, and an all-reduce under EP: the
        reference's checks; the fused path checks on device."""
        bad_ids = torch.zeros((), dtype=torch.bool, device=logits_TE.device)
        if token_ids_T is not None:
            bad_ids = ((token_ids_T < 0) | (token_ids_T >= self.args.hash_vocab_size)).any()
        flags = torch.stack([~torch.isfinite(logits_TE).all(), bad_ids]).to(torch.int64)
        if group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        nonfinite, bad_ids = flags.tolist()
        if nonfinite:
            raise FloatingPointError("MoE router logits contain NaN or Inf (on some EP rank): check the layer input")
        if bad_ids:
            raise ValueError(f"token_ids_BS must lie in [0, hash_vocab_size = {self.args.hash_vocab_size}) on every rank")

    def _schedule(self, x_TH: torch.Tensor) -> str:
        """This call's routed path (routed_schedule): "reference", "fused" or "megakernel"."""
        return routed_schedule(self.args.kernels, self.args.max_rows_per_rank, self.use_triton and x_TH.is_cuda,
                               self.fixed_token_count)

    def routed(self, x_TH, weights_TK, topk_idx_TK, shared, group, out_dtype) -> torch.Tensor:
        """Routed experts and combine on given router outputs (the layer's forward past the router
        and shared expert; the layer benchmark times it alone): y_TH [T, H] in out_dtype.

        ``shared``: the shared expert's output [T, H], None, or a function returning it, called once the
        routed experts are launched: its host time then overlaps their GPU time instead of delaying them."""
        if self.args.backend == "torchtitan":
            y_TKH = routed_torchtitan(self.experts, x_TH, topk_idx_TK)
            return ref_slot_reduce(y_TKH, weights_TK, shared_output(shared), out_dtype)
        schedule = self._schedule(x_TH)
        if schedule == "fused":  # symmetric memory (titan_mok.moe.fused), no host sync
            return fused_routed_experts(
                x_TH, weights_TK, topk_idx_TK, shared, group, self.experts,
                num_experts=self.args.num_experts, max_rows_per_rank=self.args.max_rows_per_rank, out_dtype=out_dtype,
            )
        if schedule == "megakernel":  # this rank's launch; under EP its peers through the symmetric workspace
            # x's gradient is a sum over its consumers, in the order the autograd engine reaches them: later nodes
            # first. On the fused path the dispatch node precedes the shared expert's; the shared output goes into
            # the megakernel's finish, so the shared expert runs first here, and this view, made before it, keeps
            # the routed experts' gradient reaching x after the shared expert's: the same sum, bit for bit.
            x_rows_TH = x_TH.view_as(x_TH)
            routing = TokenRouting(weights_TK, topk_idx_TK, shared_output(shared), out_dtype)
            # called as the experts module, so that FSDP's hooks gather its weights
            return self.experts(x_rows_TH, routing=routing)
        handle = build_dispatch_handle(topk_idx_TK, self.args.num_experts, group, self.args.max_rows_per_rank)
        y_RH = self.experts(dispatch(x_TH, handle), handle.group_end)
        return combine(y_RH, weights_TK, shared_output(shared), handle, out_dtype)

    def forward(self, x_BSH: torch.Tensor, token_ids_BS: torch.Tensor | None = None) -> torch.Tensor:
        """x_BSH [B, S, H] → y_BSH [B, S, H] (same dtype); token_ids_BS only for hash routing."""
        self._check_inputs(x_BSH, token_ids_BS)
        batch, seq, dim = x_BSH.shape
        x_TH = x_BSH.reshape(batch * seq, dim)
        token_ids_T = token_ids_BS.reshape(-1) if self.args.hash_routing else None
        expert_bias_E = self.expert_bias if self.args.use_expert_bias else None
        group = self._ep_group()
        logits_TE = self.router.logits(x_TH)
        if self.args.backend == "torchtitan" or self._schedule(x_TH) == "reference":
            # the fused path and the megakernel do not sync with the host (ids checked on device)
            self._check_data_all_ranks(logits_TE, token_ids_T, group)
        weights_TK, topk_idx_TK, scores_TE = self.router(logits_TE, expert_bias_E, token_ids_T)

        with torch.no_grad():
            # index_add_, not bincount: bincount's output size needs a host sync on CUDA.
            idx_N = topk_idx_TK.reshape(-1)  # [T·K]
            ones_N = torch.ones_like(idx_N, dtype=torch.float32)
            picks_E = torch.zeros(self.args.num_experts, device=idx_N.device).index_add_(0, idx_N, ones_N)
            self.tokens_per_expert.add_(picks_E)
            self.expert_load.add_(picks_E)

        # Under AMP (TorchTitan's mixed precision without FSDP, e.g. one GPU) the experts compute in
        # autocast's dtype, as nn.Linear would; the combine returns the layer's input dtype.
        x_ffn_TH = x_TH.to(autocast_dtype(x_TH))
        shared = partial(self.shared_expert, x_ffn_TH) if self.shared_expert is not None else None
        y_TH = self.routed(x_ffn_TH, weights_TK, topk_idx_TK, shared, group, x_TH.dtype)
        if self.args.aux_loss_coef > 0 and torch.is_grad_enabled():
            aux_loss = load_balance_aux_loss(scores_TE, topk_idx_TK)
            y_TH = attach_loss(y_TH, aux_loss, self.args.aux_loss_coef, "moe_aux")
        return y_TH.view(batch, seq, dim)

    @torch.no_grad()
    def init_weights(self, init_std: float, buffer_device: torch.device) -> None:
        self.router.init_weights(init_std, buffer_device)
        self.experts.init_weights(init_std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(init_std)
        with torch.device(buffer_device):
            self.expert_bias = torch.zeros(self.args.num_experts, dtype=torch.float32)
            self.tokens_per_expert = torch.zeros(self.args.num_experts, dtype=torch.float32)
            self.expert_load = torch.zeros(self.args.num_experts, dtype=torch.float32)
