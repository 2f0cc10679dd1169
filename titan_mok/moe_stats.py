"""Per-layer statistics of titan-mok's MoE layers, for the metrics processor.

Legend: T tokens (this rank, one forward), E experts, K top-k.

The MoE modules are observed through what they expose: each layer's
``expert_load [E]`` buffer (top-k picks per expert, accumulated by the layer;
zeroed here after each read, as its docstring asks) and ``expert_bias [E]``;
forward hooks on the layer (tokens in, its own expert_load increment) and on
its router (whose forward returns
``weights_TK, topk_idx_TK, scores_TE``). Only training forwards count (grad
enabled: not validation, not RL rollouts). Everything accumulates on the device
between two logged steps, without host syncs; ``collect`` reads it with one
host sync and one all-reduce over the ranks that split the batch (the loss
mesh), so load and drops are global. The MoE layer runs eager under
``[compile]`` (``titan_mok.parallelize.apply_compile``), so the hooks always see it.

Logged per layer (``moe/<layer>/...``): ``load_max_over_mean``,
``load_min_over_mean``, ``load_cv`` (std/mean of the picks per expert),
``tokens_dropped`` (mok backend: token slots to route, T·K for the T tokens
that entered the layer, minus the rows its experts computed after dispatch,
both summed over the ranks: 0 when nothing was dropped), ``router_entropy`` (mean over tokens
of the entropy, in nats, of the router scores normalised to sum to 1),
``aux_loss`` (the unscaled load-balancing loss E·Σ_e f_e·P_e that
``aux_loss_coef`` multiplies in training, f_e the share of top-k picks and P_e
the mean score of expert e; averaged over forwards) and
``bias_norm`` (‖expert_bias‖₂). Over all layers: ``moe/tokens_dropped``. (The MoE
layers' share of the step's time: ``titan_mok.time_share``.)
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from titan_mok.moe import MoE

_WRAPPERS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def layer_label(path: str) -> str:
    """``layers.3.moe`` (with any AC/compile wrapper names) → ``layers_3``."""
    parts = [p for p in path.split(".") if p not in _WRAPPERS]
    if parts and parts[-1] == "moe":
        parts = parts[:-1]
    return "_".join(parts) or "moe"


@dataclass
class _Layer:
    label: str
    moe: MoE
    tokens: int = 0
    forwards: int = 0
    load: torch.Tensor | None = None
    """[E] fp64 on device: the layer's expert_load increments over training forwards."""
    sums: torch.Tensor | None = None
    """[2] fp64 on device: Σ token entropies, Σ aux losses (router hook)."""
    load_before: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    """[1] fp64 on device: rows the layer's experts computed over training forwards (mok backend)."""
    rows_before: torch.Tensor | None = None
    router_out: tuple[torch.Tensor, torch.Tensor] | None = None
    """(Σ token entropies, mean score per expert [E]) of the current forward."""


class MoEStats:
    """Hooks into every titan-mok ``MoE`` in ``model_parts``; ``collect`` turns what
    accumulated since the last call into metrics."""

    def __init__(self, model_parts: list[nn.Module], group: dist.ProcessGroup | None):
        self.group = group
        self.layers = [
            _Layer(layer_label(path), module)
            for part in model_parts
            for path, module in part.named_modules()
            if isinstance(module, MoE)
        ]
        self._handles = []
        for layer in self.layers:
            self._handles += [
                layer.moe.register_forward_pre_hook(partial(self._before_moe, layer), with_kwargs=True),
                layer.moe.register_forward_hook(partial(self._after_moe, layer), with_kwargs=True),
                layer.moe.router.register_forward_hook(partial(self._after_router, layer)),
            ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @staticmethod
    def _training_forward() -> bool:
        """A forward that trains: grad enabled (not validation, not rollouts) and not an
        activation-checkpoint recompute (that runs inside backward; counting it would count
        the layer twice, and its extra ops would break selective AC's op matching)."""
        return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1

    @staticmethod
    def _input(args, kwargs) -> torch.Tensor:
        return args[0] if args else kwargs["x_BSH"]

    def _before_moe(self, layer: _Layer, module, args, kwargs) -> None:
        if not self._training_forward():
            return
        x_BSH = self._input(args, kwargs)
        layer.tokens += x_BSH.shape[0] * x_BSH.shape[1]
        layer.load_before = layer.moe.expert_load.clone()
        if _counts_rows(layer.moe):
            layer.rows_before = layer.moe.experts.rows_computed.clone()

    def _after_moe(self, layer: _Layer, module, args, kwargs, y_BSH) -> None:
        if not self._training_forward():
            return
        x_BSH = self._input(args, kwargs)
        with torch.no_grad():
            picks_E = layer.moe.expert_load - layer.load_before
            layer.load = picks_E.double() if layer.load is None else layer.load + picks_E.double()
            if _counts_rows(layer.moe):
                rows = (layer.moe.experts.rows_computed - layer.rows_before).double()
                layer.rows = rows if layer.rows is None else layer.rows + rows
            if layer.router_out is not None:
                entropy_sum, mean_score_E = layer.router_out
                # load_balance_aux_loss (titan_mok.moe.aux_loss) from the layer's own pick counts:
                # the same value, without its bincount (a host sync on CUDA).
                num_tokens = x_BSH.shape[0] * x_BSH.shape[1]
                aux = layer.moe.args.num_experts * (picks_E / num_tokens * mean_score_E).sum()
                sums = torch.stack([entropy_sum, aux]).double()
                layer.sums = sums if layer.sums is None else layer.sums + sums
                layer.forwards += 1
                layer.router_out = None

    def _after_router(self, layer: _Layer, module, args, output) -> None:
        _, _, scores_TE = output
        if not self._training_forward() or scores_TE.shape[0] == 0:
            return
        with torch.no_grad():
            scores_TE = scores_TE.detach().float()
            p_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
            layer.router_out = (torch.special.entr(p_TE).sum(), scores_TE.mean(dim=0))

    def collect(self) -> dict[str, float]:
        """The metrics since the last call; zeroes the accumulators. Every rank of the
        group must call it at the same step (TorchTitan logs on every rank).
        NOTE: one all-reduce and one host sync; called on logged steps only."""
        if not self.layers:
            return {}
        packed = torch.cat([self._counts(layer) for layer in self.layers])  # [Σ_layers (E + 5)]
        if self.group is not None:
            dist.all_reduce(packed, group=self.group)
        bias_norms = torch.stack([layer.moe.expert_bias.double().norm() for layer in self.layers])
        values = torch.cat([packed, bias_norms]).tolist()

        metrics, offset, dropped = {}, 0, 0.0
        for i, layer in enumerate(self.layers):
            num_experts = layer.moe.args.num_experts
            load = values[offset : offset + num_experts]
            entropy_sum, aux_sum, rows, tokens, forwards = values[offset + num_experts : offset + num_experts + 5]
            offset += num_experts + 5
            prefix = f"moe/{layer.label}"
            metrics.update(_load_metrics(prefix, load))
            metrics[f"{prefix}/bias_norm"] = values[len(packed) + i]
            if _counts_rows(layer.moe):
                # Routed slots (T·K over the ranks) minus rows the experts computed (over the ranks).
                layer_dropped = tokens * layer.moe.args.top_k - rows
                metrics[f"{prefix}/tokens_dropped"] = layer_dropped
                dropped += layer_dropped
            metrics[f"{prefix}/router_entropy"] = entropy_sum / tokens if tokens else float("nan")
            metrics[f"{prefix}/aux_loss"] = aux_sum / forwards if forwards else float("nan")
            self._reset(layer)
        metrics["moe/tokens_dropped"] = dropped
        return metrics

    def _counts(self, layer: _Layer) -> torch.Tensor:
        """[E + 5] fp64: picks per expert, Σ entropy, Σ aux loss, rows computed, tokens, forwards."""
        device = layer.moe.expert_load.device
        if layer.load is None:
            load_E = torch.zeros(layer.moe.args.num_experts, dtype=torch.float64, device=device)
        else:
            load_E = layer.load
        sums = layer.sums if layer.sums is not None else torch.zeros(2, dtype=torch.float64, device=device)
        rows = layer.rows if layer.rows is not None else torch.zeros(1, dtype=torch.float64, device=device)
        counts = torch.tensor([layer.tokens, layer.forwards], dtype=torch.float64, device=device)
        return torch.cat([load_E, sums, rows, counts])

    @staticmethod
    def _reset(layer: _Layer) -> None:
        layer.moe.expert_load.zero_()
        layer.load = layer.sums = layer.rows = layer.router_out = None
        layer.tokens = layer.forwards = 0


def _counts_rows(moe: MoE) -> bool:
    """The mok backend's experts count the rows they compute; TorchTitan's do not."""
    return hasattr(moe.experts, "rows_computed")


def _load_metrics(prefix: str, load: list[float]) -> dict[str, float]:
    """max/mean, min/mean and coefficient of variation of the picks per expert (NaN before any pick)."""
    mean = sum(load) / len(load)
    if mean == 0:
        nan = float("nan")
        return {f"{prefix}/load_max_over_mean": nan, f"{prefix}/load_min_over_mean": nan, f"{prefix}/load_cv": nan}
    std = (sum((v - mean) ** 2 for v in load) / len(load)) ** 0.5
    return {
        f"{prefix}/load_max_over_mean": max(load) / mean,
        f"{prefix}/load_min_over_mean": min(load) / mean,
        f"{prefix}/load_cv": std / mean,
    }
