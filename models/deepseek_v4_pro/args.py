"""DeepSeek-V4-Pro model arguments.

Shapes with sources: shared/reference/model_shapes.json (the official config.json).
Attention per layer is chosen by ``compress_ratios`` (the official field):
0 = sliding window only, ``csa_ratio`` (4) = compressed sparse attention
(overlapping windows + lightning indexer top-k), ``hca_ratio`` (128) = heavily
compressed attention (every causal compressed entry). The MTP module uses 0.
"""

from dataclasses import dataclass, field, replace

from torch import nn
from torchtitan.protocols.model import BaseModelArgs

from titan_mok.config import apply_mok_section
from titan_mok.models.common.params import count_params
from titan_mok.moe import MoEArgs

PRO_COMPRESS_RATIOS = (128, 128) + (4, 128) * 29 + (4,)


@dataclass
class DeepSeekV4ModelArgs(BaseModelArgs):
    vocab_size: int = 129280
    dim: int = 7168
    n_layers: int = 61
    norm_eps: float = 1e-6
    max_seq_len: int = 4096

    # shared-KV multi-query attention
    n_heads: int = 128
    head_dim: int = 512
    """Query head dim = the single shared key/value head dim."""
    rope_head_dim: int = 64
    """RoPE on the last rope_head_dim dims of each head (interleaved pairs)."""
    q_lora_rank: int = 1536
    o_groups: int = 16
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = PRO_COMPRESS_RATIOS
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 1024

    # RoPE: plain theta for sliding-only layers, YaRN on compress_rope_theta for compressed layers
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1

    # manifold-constrained hyper-connections
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6

    n_hash_layers: int = 3
    moe_args: MoEArgs = field(
        default_factory=lambda: MoEArgs(
            num_experts=384,
            top_k=6,
            expert_dim=3072,
            score_func="sqrtsoftplus",
            route_norm=True,
            route_scale=2.5,
            use_expert_bias=True,
            load_balance_coeff=1e-3,
            swiglu_limit=10.0,
            shared_expert_dim=3072,
            shared_expert_swiglu_limit=10.0,
        )
    )
    n_mtp_layers: int = 1
    """Multi-token-prediction modules (built and loadable)."""
    mtp_loss_coef: float = 0.0
    """Weight of MTP module 0's next-next-token cross-entropy in the loss (attached,
    ``titan_mok.attached_loss``); 0: the modules are built and loadable but not run."""

    def __post_init__(self):
        if len(self.compress_ratios) != self.n_layers:
            raise ValueError(f"compress_ratios has {len(self.compress_ratios)} entries; n_layers is {self.n_layers}")
        bad = sorted(set(self.compress_ratios) - {0, self.csa_ratio, self.hca_ratio})
        if bad:
            raise ValueError(f"compress_ratios entries {bad} are not allowed; use 0, csa_ratio or hca_ratio")
        if self.mtp_loss_coef < 0 or (self.mtp_loss_coef > 0 and self.n_mtp_layers != 1):
            raise ValueError(f"mtp_loss_coef = {self.mtp_loss_coef} must be >= 0, and > 0 needs n_mtp_layers = 1 "
                             f"(got {self.n_mtp_layers}; chained MTP depths are not trained)")
        if (self.n_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"n_heads·head_dim ({self.n_heads * self.head_dim}) must divide into o_groups ({self.o_groups})")

    def layer_moe_args(self, layer_id: int) -> MoEArgs:
        """Layers below n_hash_layers route by the token-id table instead of the learned scores."""
        if layer_id < self.n_hash_layers:
            return replace(self.moe_args, hash_routing=True, hash_vocab_size=self.vocab_size)
        return self.moe_args

    def update_from_config(self, job_config, **kwargs) -> None:
        self.max_seq_len = job_config.training.seq_len
        apply_mok_section(self.moe_args, job_config)

    def get_nparams(self, model: nn.Module) -> tuple[int, int]:
        """(total, active per token) of the trunk; MTP modules excluded from active."""
        counts = count_params(model)
        mtp_active = sum(count_params(mtp).active for mtp in getattr(model, "mtp", {}).values())
        return counts.total, counts.active - mtp_active

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Total parameters and training FLOPs per token (the MTP module's too when it is
        trained): 6 × active non-embedding weights + 6·heads·2·head_dim per attended
        key, where a query attends its sliding window plus (HCA) seq/hca_ratio or (CSA)
        min(index_topk, seq/csa_ratio) compressed entries; CSA adds the indexer's
        6·index_heads·index_head_dim·seq/csa_ratio scoring."""
        total, active = self.get_nparams(model)
        window = min(self.sliding_window, seq_len)
        keys = indexer = 0
        if self.mtp_loss_coef > 0:  # MTP module 0 runs (a window-only block) and the head again
            active += count_params(model.mtp["0"]).active + self.vocab_size * self.dim
            keys += window
        for ratio in self.compress_ratios:
            keys += window
            if ratio == self.hca_ratio:
                keys += seq_len // ratio
            elif ratio == self.csa_ratio:
                keys += min(self.index_topk, seq_len // ratio)
                indexer += self.index_n_heads * self.index_head_dim * (seq_len // ratio)
        flops = 6 * (active - self.vocab_size * self.dim) + 6 * self.n_heads * 2 * self.head_dim * keys + 6 * indexer
        return total, flops
