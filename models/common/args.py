"""Model arguments shared by the MLA + MoE decoders (Kimi K2.7 Code, GLM-5.2)."""

from dataclasses import dataclass, field

from torch import nn

from torchtitan.config import JobConfig
from torchtitan.protocols.model import BaseModelArgs

from titan_mok.config import apply_mok_section
from titan_mok.moe.args import MoEArgs

from .params import count_params
from .rope import YaRN


def sigmoid_noaux_moe(num_experts: int, top_k: int, expert_dim: int, route_scale: float) -> MoEArgs:
    """DeepSeek-V3-style routing (Kimi, GLM-5): sigmoid scores, aux-loss-free correction
    bias (chooses experts, never weights them; nudged each step), top-k renormalised
    then scaled, one shared expert of the routed experts' size."""
    return MoEArgs(
        num_experts=num_experts,
        top_k=top_k,
        expert_dim=expert_dim,
        score_func="sigmoid",
        route_norm=True,
        route_scale=route_scale,
        use_expert_bias=True,
        load_balance_coeff=1e-3,
        shared_expert_dim=expert_dim,
    )


@dataclass
class MLADecoderArgs(BaseModelArgs):
    vocab_size: int = 128
    dim: int = 128
    """H: hidden size."""
    n_layers: int = 3
    """Main decoder layers (an MTP layer, where a model has one, comes on top)."""
    n_dense_layers: int = 1
    """The first this many layers use a dense SwiGLU FFN, the rest the MoE."""
    dense_inter_dim: int = 384
    """FFN size of the dense layers."""
    norm_eps: float = 1e-5
    """Epsilon of the block and final RMSNorms."""

    # Multi-head latent attention
    n_heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    latent_norm_eps: float = 1e-6
    """Epsilon of the q/kv latent RMSNorms (the reference code leaves them at 1e-6)."""

    # Rotary embedding
    rope_theta: float = 10000.0
    rope_interleaved: bool = True
    """Rotate interleaved pairs (DeepSeek-V3 / Kimi / GLM-5 checkpoints) or halves."""
    yarn: YaRN | None = None
    max_seq_len: int = 4096
    """Rotary cache length; set from ``[training] seq_len`` at build time."""

    moe_args: MoEArgs = field(default_factory=MoEArgs)

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "dense_inter_dim", "n_heads", "q_lora_rank", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{type(self).__name__}.{name} = {getattr(self, name)} must be > 0")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"n_dense_layers = {self.n_dense_layers} must be in [0, n_layers = {self.n_layers}]")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim = {self.qk_rope_head_dim} must be even")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        return scale * self.yarn.softmax_scale_factor() if self.yarn is not None else scale

    def update_from_config(self, job_config: JobConfig, **kwargs) -> None:
        self.max_seq_len = job_config.training.seq_len
        apply_mok_section(self.moe_args, job_config)

    def attention_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs of the score and value matmuls (TorchTitan's convention:
        fwd + bwd = 3 × 2 FLOPs per MAC, no discount for causality)."""
        return 6 * self.n_layers * self.n_heads * (self.qk_head_dim + self.v_head_dim) * seq_len

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Total parameters and training FLOPs per token: 6 × active matmul
        parameters (embedding lookup excluded) + attention."""
        counts = count_params(model)
        embedding = model.tok_embeddings.weight.numel()
        return counts.total, 6 * (counts.active - embedding) + self.attention_flops_per_token(seq_len)
