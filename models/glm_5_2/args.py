"""GLM-5.2 arguments: the shared MLA decoder's plus DSA (IndexShare) and MTP."""

from dataclasses import dataclass

from torch import nn

from titan_mok.models.common.args import MLADecoderArgs
from titan_mok.models.common.params import count_params


@dataclass
class GLM52Args(MLADecoderArgs):
    # DeepSeek Sparse Attention (lightning indexer)
    index_n_heads: int = 4
    index_head_dim: int = 32
    """Indexer head dim; its first qk_rope_head_dim dims are rotated."""
    index_topk: int = 8
    """Keys each query attends to (when the sequence is longer)."""
    index_topk_freq: int = 4
    """IndexShare: layer i runs an indexer iff max(i − offset + 1, 0) % freq == 0."""
    index_skip_topk_offset: int = 3
    index_loss_coef: float = 0.0
    """Weight of the indexer's KL loss to the attention it approximates (trains the
    indexer only; its gradient never reaches the rest of the model); 0: the indexer
    is not trained."""

    # Multi-token prediction
    n_mtp_layers: int = 1
    """0 or 1 MTP block (``layers[str(n_layers)]``, HF ``model.layers.{n_layers}``)."""
    mtp_loss_coef: float = 0.0
    """Weight of the MTP cross-entropy added to training; 0: the block is defined and
    loadable but not run (and gets no gradient)."""

    def __post_init__(self):
        super().__post_init__()
        if self.n_mtp_layers not in (0, 1):
            raise ValueError(f"n_mtp_layers = {self.n_mtp_layers}: only 0 or 1 MTP block is supported")
        if self.mtp_loss_coef < 0 or (self.mtp_loss_coef > 0 and self.n_mtp_layers == 0):
            raise ValueError(f"mtp_loss_coef = {self.mtp_loss_coef} needs n_mtp_layers = 1 and must be ≥ 0")
        if self.index_loss_coef < 0:
            raise ValueError(f"index_loss_coef = {self.index_loss_coef} must be ≥ 0")
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GLM52Args.{name} = {getattr(self, name)} must be > 0")
        if self.index_topk_freq < 1:
            raise ValueError(f"index_topk_freq = {self.index_topk_freq} must be ≥ 1")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"index_head_dim = {self.index_head_dim} must be ≥ qk_rope_head_dim = {self.qk_rope_head_dim}")

    def runs_indexer(self, layer_id: int) -> bool:
        """True on "full" IndexShare layers (the MTP block always runs its own)."""
        if layer_id >= self.n_layers:
            return True
        return max(layer_id - self.index_skip_topk_offset + 1, 0) % self.index_topk_freq == 0

    @property
    def indexer_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.runs_indexer(i)]

    def attention_flops_per_token(self, seq_len: int) -> int:
        """Model FLOPs: each query attends to min(S, K) keys (the SDPA path computes all
        S scores and masks them, so above K it does more work than counted). When S > K,
        each indexer layer adds its scores (forward only, or ×3 when trained) and, when
        trained, the head-summed attention probabilities of its KL target (forward only).
        The MTP block counts when trained."""
        mtp = 1 if self.mtp_loss_coef > 0 else 0
        keys = min(seq_len, self.index_topk)
        flops = 6 * (self.n_layers + mtp) * self.n_heads * (self.qk_head_dim + self.v_head_dim) * keys
        if seq_len > self.index_topk:
            n_index = len(self.indexer_layers) + mtp
            trained = self.index_loss_coef > 0
            flops += (6 if trained else 2) * n_index * self.index_n_heads * (self.index_head_dim + 1) * seq_len
            if trained:
                flops += 2 * n_index * self.n_heads * self.qk_head_dim * seq_len
        return flops

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        counts = count_params(model)
        matmul_active = counts.active - model.tok_embeddings.weight.numel()
        if self.n_mtp_layers and self.mtp_loss_coef == 0:
            matmul_active -= count_params(model.layers[str(self.n_layers)]).active  # not run
        elif self.n_mtp_layers:
            matmul_active += model.output.weight.numel()  # the head runs again on the MTP states
        indexer = sum(
            p.numel()
            for name, p in model.named_parameters()
            if ".indexer." in name and (self.mtp_loss_coef > 0 or not name.startswith(f"layers.{self.n_layers}."))
        )
        matmul_active -= indexer
        # the indexer projections run when S > K: forward (2 FLOPs/param) + weight grads when trained (2)
        indexer_flops = 0 if seq_len <= self.index_topk else (4 if self.index_loss_coef > 0 else 2) * indexer
        return counts.total, 6 * matmul_active + indexer_flops + self.attention_flops_per_token(seq_len)
