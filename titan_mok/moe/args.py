"""Arguments of titan-mok's MoE layer: the one contract all four models use.

Legend: B batch, S sequence, T = B·S tokens, H hidden, I expert FFN size,
E experts, K top-k.
"""

from dataclasses import dataclass
from typing import Literal


@dataclass
class MoEArgs:
    num_experts: int = 8
    """E: routed experts."""
    top_k: int = 2
    """K: experts per token."""
    expert_dim: int = 256
    """I: routed expert FFN size (w_gate/w_up [E, I, H], w_down [E, H, I])."""

    score_func: Literal["sigmoid", "softmax", "sqrtsoftplus"] = "sigmoid"
    """Router score: sigmoid (Kimi, GLM), softmax (Qwen3.5), sqrt(softplus) (DeepSeek-V4)."""
    route_norm: bool = True
    """Renormalise the K selected scores to sum to 1."""
    route_scale: float = 1.0
    """Routed scaling factor applied to the combine weights."""
    use_expert_bias: bool = True
    """Aux-loss-free correction bias: chooses experts, never weights them."""
    load_balance_coeff: float | None = 1e-3
    """Step size of the bias update (TorchTitan's optimizer hook); None disables it.
    Ignored (the hook sees None) when use_expert_bias is False. Hash-routed layers
    keep it set: TorchTitan's hook stops updating every layer if one MoE layer has None."""
    num_expert_groups: int | None = None
    """Group-limited routing: E experts in this many groups (None: off)."""
    num_limited_groups: int | None = None
    """Groups kept per token under group-limited routing."""
    hash_routing: bool = False
    """Route by a fixed token-id → experts table [vocab, K] (DeepSeek-V4 layers 0–2)."""
    hash_vocab_size: int = 0
    """Rows of the hash table (the model's vocabulary) when hash_routing."""
    aux_loss_coef: float = 0.0
    """Auxiliary load-balancing loss coefficient (Qwen3.5: 1e-3); 0 disables it.
    Per layer: coef · E · Σ_e f_e · P_e over the layer's local tokens (f_e: share of
    top-k picks, P_e: mean router probability). HF transformers pools f and P over
    all layers before multiplying; this layer keeps it per layer (no cross-layer state)."""

    swiglu_limit: float | None = None
    """Clamp of the routed experts' SwiGLU (DeepSeek-V4: 10); None: no clamp.
    As DeepSeek-V4 (HF transformers' DeepseekV4Experts): gate.clamp(max=limit),
    up.clamp(-limit, limit), before silu(gate) · up."""

    shared_expert_dim: int = 0
    """Shared expert FFN size (0: no shared expert). Always BF16."""
    shared_expert_gate: bool = False
    """Sigmoid scalar gate on the shared expert's output (Qwen3.5)."""
    shared_expert_swiglu_limit: float | None = None
    """Same clamp on the shared expert (HF transformers' DeepseekV4MLP clamps the
    shared expert with swiglu_limit too: set 10.0 for DeepSeek-V4); None: no clamp."""

    max_rows_per_rank: int | None = None
    """Capacity (rows) of each EP rank's receive buffer in the mok backend.
    None: the worst case (every row of every rank), which can never overflow.
    A smaller value saves memory; a batch that would overflow it raises an error
    naming both sizes (dropless: rows are never dropped)."""

    # Set from the [mok] TOML section at build time (update_from_config).
    backend: Literal["mok", "torchtitan"] = "mok"
    """"mok": titan-mok's schedule → dispatch → experts → combine; "torchtitan": TorchTitan
    0.2.2's GroupedExperts (+ its all-to-all ExpertParallel under EP), the baseline."""
    precision: Literal["bf16", "mxfp8"] = "bf16"
    """Routed-expert GEMMs: "bf16" (the activations' dtype) or "mxfp8" (kernels/mxfp8.py)."""
    kernels: Literal["auto", "reference", "triton", "megakernel"] = "auto"
    """"reference": pure PyTorch; "triton": the fused path (Hopper); "megakernel": the routed experts'
    forward in the MoK megakernel, one launch per rank (any EP degree), bf16 or mxfp8 (Hopper); "auto": the fastest
    measured path: the fused path for CUDA tensors on SM90+, except with ``max_rows_per_rank`` set (and in RL
    rollouts), where it runs the reference schedule with the Triton expert FFN; pure PyTorch elsewhere."""
