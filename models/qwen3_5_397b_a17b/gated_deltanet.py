"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024), the linear-attention mixer of
Qwen3.5: a pure-PyTorch chunked form (the training path, CPU and GPU) beside the
token-by-token recurrence it must equal (``naive_recurrent_gated_delta_rule``).

Legend: B batch, S sequence, H hidden, Hk query/key heads, Hv value heads,
Dk key head dim, Dv value head dim, N chunks, C chunk length, W conv width,
J conv channels (2·Hk·Dk + Hv·Dv).

The recurrence per value head, with state ``S [Dk, Dv]`` and scalars ``g_t ≤ 0``
(log decay) and ``beta_t ∈ (0, 1)`` (write strength)::

    S_t = exp(g_t) · S_{t-1}
    S_t = S_t + k_t ⊗ beta_t · (v_t − S_tᵀ k_t)        (the delta rule)
    o_t = S_tᵀ q_t

with q and k L2-normalised and q scaled by Dk^-0.5. Query/key head ``i`` serves
value heads ``i·Hv/Hk … (i+1)·Hv/Hk − 1`` (grouped value attention), as in
flash-linear-attention and the Qwen3.5 checkpoints.

Row invariance (for RL's cached decode step, ``titan_mok.rl.cached_qwen``): the
causal conv is W elementwise multiply-adds (not ``F.conv1d``, whose algorithm
depends on the sequence length), the L2 norm reads a last-dim ``mean`` (which
``BatchInvariantMode`` tiles), and SiLU, sigmoid and softplus run on tensors
padded to a fixed multiple (``pointwise_padded``), so every token's values have
the same bits whatever the sequence or batch around it. The chunked rule reads a
chunk's later tokens only through exactly-zero coefficients, so one chunk
recomputed from its start state with zeros in its unwritten slots gives the full
pass's bits for the written ones.
"""

import torch
import torch.nn.functional as F
from torch import nn

from titan_mok.kernels.row_tiles import pointwise_padded

def causal_depthwise_conv(x_BSJ: torch.Tensor, weight_JW: torch.Tensor, history_BWJ: torch.Tensor | None = None):
    """Causal depthwise conv along S: ``y_t = Σ_i w_i · x_{t−W+1+i}`` in fp32, cast back to
    x's dtype. Positions before the first row read ``history`` (the W−1 rows before it;
    zeros when None). W elementwise multiply-adds in a fixed order: each output's bits
    depend only on its own window, whatever S or B."""
    batch, seq_len, channels = x_BSJ.shape
    width = weight_JW.shape[-1]
    if history_BWJ is None:
        history_BWJ = x_BSJ.new_zeros(batch, width - 1, channels)
    window_BXJ = torch.cat([history_BWJ, x_BSJ], dim=1).float()  # X = W − 1 + S
    weight_JW = weight_JW.float()
    y_BSJ = window_BXJ[:, :seq_len] * weight_JW[:, 0]
    for i in range(1, width):
        y_BSJ = y_BSJ + window_BXJ[:, i : i + seq_len] * weight_JW[:, i]
    return y_BSJ.to(x_BSJ.dtype)


def _l2_normalise(x_xD: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(Σ x² + 1e-6)`` (eps as FLA), the sum read as ``D · mean``: a last-dim mean
    is what ``BatchInvariantMode`` makes row-invariant."""
    return x_xD * torch.rsqrt((x_xD * x_xD).mean(-1, keepdim=True) * x_xD.shape[-1] + 1e-6)


def prepare_delta_inputs(q_BSHkDk, k_BSHkDk, v_BSHvDv, g_BSHv, beta_BSHv):
    """fp32, heads first, q/k L2-normalised, q scaled, q/k heads repeated to the value
    heads. Every op is per token. Returns tensors shaped [B, Hv, S, ·]."""
    num_k_heads, num_v_heads = k_BSHkDk.shape[2], v_BSHvDv.shape[2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
    group = num_v_heads // num_k_heads
    q_BSHvDk = _l2_normalise(q_BSHkDk.float().repeat_interleave(group, dim=2))
    k_BSHvDk = _l2_normalise(k_BSHkDk.float().repeat_interleave(group, dim=2))
    q_BSHvDk = q_BSHvDk * q_BSHvDk.shape[-1] ** -0.5
    # [B, S, Hv, ·] -> [B, Hv, S, ·]
    return (
        q_BSHvDk.transpose(1, 2),
        k_BSHvDk.transpose(1, 2),
        v_BSHvDv.float().transpose(1, 2),
        g_BSHv.float().transpose(1, 2),
        beta_BSHv.float().transpose(1, 2),
    )


def naive_recurrent_gated_delta_rule(q_BSHkDk, k_BSHkDk, v_BSHvDv, g_BSHv, beta_BSHv):
    """Reference: one token at a time, fp32. Returns o [B, S, Hv, Dv] in v's dtype."""
    q, k, v, g, beta = prepare_delta_inputs(q_BSHkDk, k_BSHkDk, v_BSHvDv, g_BSHv, beta_BSHv)
    batch, heads, seq_len, dk = k.shape
    state_BHvDkDv = v.new_zeros(batch, heads, dk, v.shape[-1])
    outputs = []
    for t in range(seq_len):
        state_BHvDkDv = state_BHvDkDv * g[:, :, t].exp()[..., None, None]
        read_BHvDv = torch.einsum("bhkv,bhk->bhv", state_BHvDkDv, k[:, :, t])
        delta_BHvDv = (v[:, :, t] - read_BHvDv) * beta[:, :, t, None]
        state_BHvDkDv = state_BHvDkDv + k[:, :, t, :, None] * delta_BHvDv[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state_BHvDkDv, q[:, :, t]))
    return torch.stack(outputs, dim=1).to(v_BSHvDv.dtype)  # [B, S, Hv, Dv]


def gated_delta_chunks(
    q_BHvSDk, k_BHvSDk, v_BHvSDv, g_BHvS, beta_BHvS, chunk_size: int, state_BHvDkDv=None, chunk_B=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The chunked rule (the WY/UT representation of DeltaNet, with gating) on prepared
    inputs (``prepare_delta_inputs``), from ``state`` (zeros when None): inside a chunk all
    tokens are handled by matrix products and one unit-lower-triangular solve; only the
    [Dk, Dv] state crosses chunk boundaries. fp32 throughout.

    Returns o [B, Hv, S, Dv], the state after the last chunk and, with ``chunk_B``, the
    state entering chunk ``chunk_B[b]`` (≤ N) of each sequence b, else None."""
    batch, heads, seq_len, dk = k_BHvSDk.shape
    dv = v_BHvSDv.shape[-1]
    pad = (-seq_len) % chunk_size
    # zero-padded tail tokens have beta = 0 and g = 0: they neither write nor decay
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q_BHvSDk, k_BHvSDk, v_BHvSDv))
    g, beta = (F.pad(x, (0, pad)) for x in (g_BHvS, beta_BHvS))
    n_chunks = (seq_len + pad) // chunk_size
    # [B, Hv, S, ·] -> [B, Hv, N, C, ·] (contiguous: one layout whatever the caller's)
    q_BHNCDk, k_BHNCDk, v_BHNCDv = (x.reshape(batch, heads, n_chunks, chunk_size, -1).contiguous() for x in (q, k, v))
    beta_BHNC = beta.reshape(batch, heads, n_chunks, chunk_size).contiguous()
    gcum_BHNC = g.reshape(batch, heads, n_chunks, chunk_size).cumsum(-1)  # log decay since chunk start

    # decay between positions j ≤ i of one chunk: exp(gcum_i − gcum_j), zero above the diagonal
    causal_CC = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay_BHNCC = (gcum_BHNC[..., :, None] - gcum_BHNC[..., None, :]).masked_fill(~causal_CC, float("-inf")).exp()

    # (I + A) with A_ij = beta_i (k_i · k_j) decay_ij for j < i; the solve reads only the
    # strictly-lower part (unitriangular), so the diagonal of the product is ignored.
    kbeta_BHNCDk = k_BHNCDk * beta_BHNC[..., None]
    ut_BHNCC = (kbeta_BHNCDk @ k_BHNCDk.transpose(-1, -2)) * decay_BHNCC
    # u: the values to write once the chunk's own earlier writes are accounted for;
    # w: the keys (decayed to chunk start) through which the incoming state is read
    u_BHNCDv = torch.linalg.solve_triangular(ut_BHNCC, v_BHNCDv * beta_BHNC[..., None], upper=False, unitriangular=True)
    w_BHNCDk = torch.linalg.solve_triangular(
        ut_BHNCC, kbeta_BHNCDk * gcum_BHNC.exp()[..., None], upper=False, unitriangular=True
    )
    attn_BHNCC = (q_BHNCDk @ k_BHNCDk.transpose(-1, -2)) * decay_BHNCC
    q_decayed_BHNCDk = q_BHNCDk * gcum_BHNC.exp()[..., None]
    k_to_end_BHNCDk = k_BHNCDk * (gcum_BHNC[..., -1:] - gcum_BHNC).exp()[..., None]
    chunk_decay_BHN = gcum_BHNC[..., -1].exp()

    if state_BHvDkDv is None:
        state_BHvDkDv = q.new_zeros(batch, heads, dk, dv)
    entering_BHvDkDv = None if chunk_B is None else state_BHvDkDv
    outputs = []
    for n in range(n_chunks):
        v_new_BHCDv = u_BHNCDv[:, :, n] - w_BHNCDk[:, :, n] @ state_BHvDkDv
        outputs.append(q_decayed_BHNCDk[:, :, n] @ state_BHvDkDv + attn_BHNCC[:, :, n] @ v_new_BHCDv)
        state_BHvDkDv = (
            state_BHvDkDv * chunk_decay_BHN[:, :, n, None, None]
            + k_to_end_BHNCDk[:, :, n].transpose(-1, -2) @ v_new_BHCDv
        )
        if chunk_B is not None:
            entering_BHvDkDv = torch.where((chunk_B == n + 1)[:, None, None, None], state_BHvDkDv, entering_BHvDkDv)
    return torch.cat(outputs, dim=2)[:, :, :seq_len], state_BHvDkDv, entering_BHvDkDv


def chunk_gated_delta_rule(q_BSHkDk, k_BSHkDk, v_BSHvDv, g_BSHv, beta_BSHv, chunk_size: int = 64):
    """The chunked rule from a zero state (``gated_delta_chunks``). Returns o [B, S, Hv, Dv]
    in v's dtype; equals the recurrence up to rounding."""
    prepared = prepare_delta_inputs(q_BSHkDk, k_BSHkDk, v_BSHvDv, g_BSHv, beta_BSHv)
    o_BHvSDv, _, _ = gated_delta_chunks(*prepared, chunk_size)
    return o_BHvSDv.transpose(1, 2).to(v_BSHvDv.dtype)  # [B, S, Hv, Dv]


class GatedRMSNorm(nn.Module):
    """RMSNorm over the value head dim, then a SiLU output gate (weight init 1,
    not zero-centred): ``w · rmsnorm(x) · silu(z)``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, z):
        x_f = x.float()
        x_f = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x_f.to(x.dtype) * pointwise_padded(F.silu, z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention mixer: fused q/k/v projection → causal depthwise
    conv (width W) + SiLU → L2-normalised q/k → gated delta rule → gated RMSNorm
    → output projection. Decay ``g = −exp(A_log) · softplus(a + dt_bias)``,
    write strength ``beta = sigmoid(b)``."""

    def __init__(
        self,
        dim: int,
        num_k_heads: int,
        num_v_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        conv_kernel: int,
        norm_eps: float,
        chunk_size: int,
    ):
        super().__init__()
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        self.key_dim, self.value_dim = num_k_heads * k_head_dim, num_v_heads * v_head_dim
        self.chunk_size = chunk_size
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(dim, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(dim, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, num_v_heads, bias=False)
        # depthwise causal conv weights [conv_dim, 1, W] (nn.Conv1d layout, as the checkpoints)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(v_head_dim, norm_eps)
        self.out_proj = nn.Linear(self.value_dim, dim, bias=False)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        q_BSHkDk, k_BSHkDk, v_BSHvDv, g_BSHv, beta_BSHv = self.delta_inputs(x_BSH, self.conv(self.in_proj_qkv(x_BSH)))
        o_BSHvDv = chunk_gated_delta_rule(q_BSHkDk, k_BSHkDk, v_BSHvDv, g_BSHv, beta_BSHv, self.chunk_size)
        return self.project_out(o_BSHvDv, x_BSH)

    def conv(self, qkv_BSJ: torch.Tensor, history_BWJ: torch.Tensor | None = None) -> torch.Tensor:
        """Causal depthwise conv + SiLU of the fused q/k/v projection (``history``: the W−1
        projected rows before the first, zeros when None)."""
        conv_BSJ = causal_depthwise_conv(qkv_BSJ, self.conv1d.weight[:, 0], history_BWJ)  # weight [J, 1, W] -> [J, W]
        return pointwise_padded(F.silu, conv_BSJ)

    def delta_inputs(self, x_BSH: torch.Tensor, conv_BSJ: torch.Tensor):
        """q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], log decay g and write strength beta [B, S, Hv]."""
        batch, seq_len, _ = x_BSH.shape
        q, k, v = conv_BSJ.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q_BSHkDk = q.reshape(batch, seq_len, self.num_k_heads, self.k_head_dim)
        k_BSHkDk = k.reshape(batch, seq_len, self.num_k_heads, self.k_head_dim)
        v_BSHvDv = v.reshape(batch, seq_len, self.num_v_heads, self.v_head_dim)
        beta_BSHv = pointwise_padded(torch.sigmoid, self.in_proj_b(x_BSH))
        g_BSHv = -self.A_log.float().exp() * pointwise_padded(F.softplus, self.in_proj_a(x_BSH).float() + self.dt_bias)
        return q_BSHkDk, k_BSHkDk, v_BSHvDv, g_BSHv, beta_BSHv

    def project_out(self, o_BSHvDv: torch.Tensor, x_BSH: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm (gate from ``x``) and the output projection: [B, S, H]."""
        batch, seq_len, _ = x_BSH.shape
        z_BSHvDv = self.in_proj_z(x_BSH).reshape(batch, seq_len, self.num_v_heads, self.v_head_dim)
        o_BSHvDv = self.norm(o_BSHvDv, z_BSHvDv)
        return self.out_proj(o_BSHvDv.reshape(batch, seq_len, self.value_dim))

    def init_weights(self, init_std: float):
        for linear in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.out_proj.weight, mean=0.0, std=init_std)
        nn.init.kaiming_uniform_(self.conv1d.weight, a=5**0.5)
        nn.init.ones_(self.dt_bias)
        # A ~ U(0.01, 16), as transformers' Qwen3.5 initialisation (log A stays finite)
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
        nn.init.ones_(self.norm.weight)
