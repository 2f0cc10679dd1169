"""Qwen3.5-397B-A17B (text) model arguments.

Shapes with sources: shared/reference/model_shapes.json (the official
config.json's ``text_config``). Only text positions are modelled: Qwen3.5's
interleaved M-RoPE (sections [11, 11, 10]) reduces to plain partial RoPE when
the temporal/height/width positions are equal, which they are for text.
"""

from dataclasses import dataclass, field

from torch import nn
from torchtitan.protocols.model import BaseModelArgs

from titan_mok.config import apply_mok_section
from titan_mok.models.common.params import count_params
from titan_mok.moe import MoEArgs


@dataclass
class Qwen35ModelArgs(BaseModelArgs):
    vocab_size: int = 248320
    dim: int = 4096
    n_layers: int = 60
    full_attention_interval: int = 4
    """Layer i is gated full attention when (i + 1) % interval == 0, else Gated DeltaNet."""
    norm_eps: float = 1e-6
    max_seq_len: int = 4096

    # gated full attention
    n_heads: int = 32
    n_kv_heads: int = 2
    head_dim: int = 256
    partial_rotary_factor: float = 0.25
    rope_theta: float = 1e7

    # Gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 64
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    deltanet_chunk_size: int = 64

    moe_args: MoEArgs = field(
        default_factory=lambda: MoEArgs(
            num_experts=512,
            top_k=10,
            expert_dim=1024,
            score_func="softmax",
            route_norm=True,
            route_scale=1.0,
            use_expert_bias=False,
            load_balance_coeff=None,
            aux_loss_coef=1e-3,
            shared_expert_dim=1024,
            shared_expert_gate=True,
        )
    )
    n_mtp_layers: int = 1
    """Multi-token-prediction module: 1 (the published model) or 0 (not built)."""
    mtp_loss_coef: float = 0.0
    """Weight of the MTP module's next-next-token cross-entropy in the loss (attached,
    ``titan_mok.attached_loss``); 0: the module is built and loadable but not run."""

    def __post_init__(self):
        if self.n_mtp_layers not in (0, 1):
            raise ValueError(f"n_mtp_layers = {self.n_mtp_layers}: Qwen3.5 has one MTP module; choose 0 or 1")
        if self.mtp_loss_coef < 0 or (self.mtp_loss_coef > 0 and self.n_mtp_layers == 0):
            raise ValueError(f"mtp_loss_coef = {self.mtp_loss_coef} must be >= 0, and > 0 needs n_mtp_layers = 1")
        if self.n_layers % self.full_attention_interval:
            raise ValueError(
                f"n_layers ({self.n_layers}) must be a multiple of full_attention_interval "
                f"({self.full_attention_interval}): Qwen3.5 stacks [DeltaNet x{self.full_attention_interval - 1}, full]"
            )
        if self.n_heads % self.n_kv_heads or self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads and linear value heads of linear key heads")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_full_attention(self, layer_id: int) -> bool:
        return (layer_id + 1) % self.full_attention_interval == 0

    def update_from_config(self, job_config, **kwargs) -> None:
        self.max_seq_len = job_config.training.seq_len
        apply_mok_section(self.moe_args, job_config)

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Total parameters (MTP included) and training FLOPs per token of the
        main trunk (and of the MTP module when it is trained): 6 × active
        non-embedding weights, plus causal-agnostic attention
        6·L_full·heads·2·head_dim·seq_len (TorchTitan's convention),
        plus the DeltaNet state work 6·L_linear·Hv·2·Dk·Dv (one state read and
        one rank-1 write per token and value head)."""
        total, active = self.get_nparams(model)
        embedding = self.vocab_size * self.dim
        n_full = sum(self.is_full_attention(i) for i in range(self.n_layers))
        if self.mtp_loss_coef > 0:  # the MTP module runs (one full-attention block) and the head again
            active += count_params(model.mtp).active + self.vocab_size * self.dim
            n_full += 1
        n_linear = self.n_layers - n_full
        flops = (
            6 * (active - embedding)
            + 6 * n_full * self.n_heads * 2 * self.head_dim * seq_len
            + 6 * n_linear * self.linear_num_value_heads * 2 * self.linear_key_head_dim * self.linear_value_head_dim
        )
        return total, flops

    def get_nparams(self, model: nn.Module) -> tuple[int, int]:
        """(total, active per token) of the trunk, MTP modules excluded from active."""
        counts = count_params(model)
        mtp_active = count_params(model.mtp).active if getattr(model, "mtp", None) is not None else 0
        return counts.total, counts.active - mtp_active
