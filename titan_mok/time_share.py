"""Where a training step's time goes: the MoE layers, the attention, the rest.

Timed modules, by category:

- ``moe``: every MoE layer, titan-mok's (``titan_mok.moe.MoE``) or TorchTitan's
  (``torchtitan.models.moe.MoE``, the end-to-end baseline's);
- ``attention``: every block's token mixer, the module named ``attention`` (MLA, DSA,
  gated or compressed attention) or ``linear_attention`` (Qwen3.5's Gated DeltaNet).

A module's forward is timed by hooks around it; its backward from the gradient of its
output to the gradient of its input (tensor hooks). Stamps are CUDA events on a GPU (read
at ``collect``: no host sync per step), perf_counter on CPU. Only training forwards count
(grad enabled: not validation, not RL rollouts).

Activation checkpointing: a checkpointed block recomputes its forward inside its backward,
when the backward first needs a saved activation; in the blocks here that is inside the
backward of the block's last part (the MoE layer's, or the hyper-connection merge's in
DeepSeek-V4). A forward that runs inside the backward is a recompute: its time counts to its
own category and is taken off every category whose backward was open around it, so each
share is the category's forward + recompute + backward. (Norms and residual adds recomputed
inside an MoE backward stay in the MoE's share.)

``collect(interval_s)`` returns ``<category>/time_share``: this rank's seconds in the
category over the wall time since the last log. A category is left out when the model has
no such module, or when one of them runs inside a compiled module (hooks there would be
traced into the graph; a warning names it).
"""

import time
from collections import Counter
from functools import partial

import torch
from torch import nn
from torchtitan.models.moe import MoE as TorchTitanMoE
from torchtitan.tools.logging import logger

from titan_mok.moe import MoE

CATEGORIES = ("moe", "attention")
_ATTENTION_NAMES = frozenset({"attention", "linear_attention"})


def category_of(path: str, module: nn.Module) -> str | None:
    if isinstance(module, (MoE, TorchTitanMoE)):
        return "moe"
    if path.rsplit(".", 1)[-1] in _ATTENTION_NAMES:
        return "attention"
    return None


class Clock:
    """Wall-clock stamps: CUDA events on a GPU (read at ``collect``), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def stamp(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class TimeShare:
    """Hooks into the timed modules of ``model_parts``; ``collect`` turns what accumulated
    since the last call into ``<category>/time_share`` metrics."""

    def __init__(self, model_parts: list[nn.Module]):
        self.timed: dict[str, list[str]] = {c: [] for c in CATEGORIES}
        self.left_out: dict[str, list[str]] = {c: [] for c in CATEGORIES}
        self._handles = []
        self._pending: dict[int, tuple] = {}
        self._open: Counter = Counter()
        """Categories whose backward is running (gradient of an output seen, of its input not yet)."""
        self._intervals: list[tuple[str, object, object, tuple[str, ...]]] = []
        """(category, start, end, categories whose backward was open around it: recomputes only)."""
        device = None
        for part in model_parts:
            compiled, chosen = [], []
            for path, module in part.named_modules():
                inside = lambda prefixes: any(path.startswith(p + ".") for p in prefixes)  # noqa: E731
                if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
                    compiled.append(path)
                category = category_of(path, module)
                if category is None or inside(chosen):
                    continue
                chosen.append(path)
                if inside(compiled):
                    self.left_out[category].append(path)
                    continue
                self.timed[category].append(path)
                device = device or next((p.device for p in module.parameters()), None)
                self._handles += [
                    module.register_forward_pre_hook(partial(self._before, category), with_kwargs=True),
                    module.register_forward_hook(partial(self._after, category), with_kwargs=True),
                ]
        for category, paths in self.left_out.items():
            if paths:
                logger.warning(f"{category}/time_share is not logged: {paths[0]} (and {len(paths) - 1} more) run "
                               "inside a compiled module")
        self._clock = Clock(device or torch.device("cpu"))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before(self, category: str, module, args, kwargs) -> None:
        if not torch.is_grad_enabled():
            return
        recompute = torch._C._current_graph_task_id() != -1  # a forward inside a backward
        open_now = tuple(c for c, n in self._open.items() if n > 0) if recompute else ()
        self._pending[id(module)] = (self._clock.stamp(), recompute, open_now)

    def _after(self, category: str, module, args, kwargs, output) -> None:
        pending = self._pending.pop(id(module), None)
        if pending is None:
            return
        start, recompute, open_now = pending
        self._intervals.append((category, start, self._clock.stamp(), open_now))
        if recompute:
            return
        x, y = _first_tensor((*args, *kwargs.values())), _first_tensor(output)
        if x is None or y is None or not (x.requires_grad and y.requires_grad):
            return
        backward = {}

        def started(grad):
            backward["start"] = self._clock.stamp()
            self._open[category] += 1

        def finished(grad):
            if "start" in backward:
                self._open[category] -= 1
                self._intervals.append((category, backward.pop("start"), self._clock.stamp(), ()))

        y.register_hook(started)
        x.register_hook(finished)

    def collect(self, interval_s: float) -> dict[str, float]:
        """The shares since the last call; forgets what it read.
        NOTE: on a GPU one host sync (every event must have completed); called on logged steps only."""
        if self._clock.cuda and self._intervals:
            torch.cuda.synchronize()
        seconds = dict.fromkeys(CATEGORIES, 0.0)
        for category, start, end, open_around in self._intervals:
            duration = self._clock.seconds(start, end)
            seconds[category] += duration
            for other in open_around:
                seconds[other] -= duration
        self._intervals = []
        self._open.clear()
        self._pending.clear()  # a recompute cut short by checkpoint's early stop never reaches its forward hook
        return {
            f"{category}/time_share": seconds[category] / interval_s
            for category in CATEGORIES
            if self.timed[category] and not self.left_out[category]
        }


def _first_tensor(values) -> torch.Tensor | None:
    if isinstance(values, torch.Tensor):
        return values
    if isinstance(values, (tuple, list)):
        return next((v for v in values if isinstance(v, torch.Tensor)), None)
    return None
