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
    """Step size of the bias update (TorchTitan's optimizer hook); None disables it."""
    num_expert_groups: int | None = None
    """Group-limited routing: E experts in this many groups (None: off)."""
    num_limited_groups: int | None = None
    """Groups kept per token under group-limited routing."""
    hash_routing: bool = False
    """Route by a fixed token-id → experts table [vocab, K] (DeepSeek-V4 layers 0–2)."""
    hash_vocab_size: int = 0
    """Rows of the hash table (the model's vocabulary) when hash_routing."""
    aux_loss_coef: float = 0.0
    """Auxiliary load-balancing loss coefficient (Qwen3.5: 1e-3); 0 disables it."""

    swiglu_limit: float | None = None
    """Clamp of the routed experts' SwiGLU (DeepSeek-V4: 10); None: no clamp."""

    shared_expert_dim: int = 0
    """Shared expert FFN size (0: no shared expert). Always BF16."""
    shared_expert_gate: bool = False
    """Sigmoid scalar gate on the shared expert's output (Qwen3.5)."""

    # Set from the [mok] TOML section at build time (update_from_config).
    backend: Literal["mok", "torchtitan"] = "mok"
    precision: Literal["bf16", "mxfp8"] = "bf16"
    kernels: Literal["auto", "reference", "triton"] = "auto"
