"""Faults inside a training step: non-finite losses and gradients, the fault injection that
tests them, and what a failed collective means (docs/faults.md).

``NonfiniteGuard`` (``[training] nonfinite``): before each optimizer update, one flag says
whether any rank's step losses or local gradients hold a NaN/Inf (an inf-norm per gradient, an
all-reduce of the flag, a host sync). On a bad step it re-runs the step's forward passes
(no grad, same weights, same batches: the forward is deterministic) under hooks that find the
first module, in forward order over all ranks, whose output is non-finite, then stops the run
or drops the step's gradients. Non-finite MoE router logits already raise inside the forward
(``titan_mok.moe.moe``, on every EP rank alike); the guard names the module there too and stops.

``NonfiniteInjection`` (``[debug] fault_nonfinite_*``): a forward hook that writes a NaN into
one module's output on one rank at one step: the fault the guard's tests inject.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

from titan_mok.checkpoint import gather_objects


class NonfiniteError(FloatingPointError):
    """A step's loss, gradients or router logits are non-finite; raised alike on every rank."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []


def _nonfinite(output) -> bool:
    floats = [_local(t).detach() for t in _tensors(output) if t.is_floating_point()]
    return any(not torch.isfinite(t).all() for t in floats)  # NOTE: host sync per tensor (diagnosis only)


class NonfiniteInjection:
    """At ``step``, while armed for microbatch 0, the output of ``module_name`` on ``rank`` gets a
    NaN in its first element (a copy, so autograd carries it into the backward)."""

    def __init__(self, model: torch.nn.Module, step: int, module_name: str, rank: int):
        modules = dict(model.named_modules())
        if module_name not in modules:
            near = sorted(n for n in modules if n and n.count(".") <= 2)[:12]
            raise ValueError(f"[debug] fault_nonfinite_module = {module_name!r}: the model has no such module; "
                             f"names look like {near}")
        self.step, self.module_name, self.rank = step, module_name, rank
        self.armed = False
        if (dist.get_rank() if dist.is_initialized() else 0) == rank:
            modules[module_name].register_forward_hook(self._poison)

    @classmethod
    def from_config(cls, job_config, model: torch.nn.Module) -> "NonfiniteInjection | None":
        debug = job_config.debug
        if debug.fault_nonfinite_step <= 0:
            return None
        logger.warning(f"fault injection: NaN in {debug.fault_nonfinite_module!r} on rank "
                       f"{debug.fault_nonfinite_rank} at step {debug.fault_nonfinite_step} ([debug] fault_nonfinite_*)")
        return cls(model, debug.fault_nonfinite_step, debug.fault_nonfinite_module, debug.fault_nonfinite_rank)

    @contextmanager
    def arming(self, step: int, microbatch: int):
        self.armed = step == self.step and microbatch == 0
        try:
            yield
        finally:
            self.armed = False

    def _poison(self, module, args, output):
        if not self.armed or not isinstance(output, torch.Tensor):
            return None
        poisoned = output.clone()
        _local(poisoned).view(-1)[0] = float("nan")
        return poisoned


class NonfiniteGuard:
    """``[training] nonfinite`` for a TorchTitan Trainer whose ``forward_backward_step`` reports
    each microbatch (``microbatch``, ``record_loss``, ``forward_failure``)."""

    def __init__(self, trainer, mode: str, injection: NonfiniteInjection | None):
        self.trainer, self.mode, self.injection = trainer, mode, injection
        self.microbatches: list[tuple[dict, torch.Tensor]] = []
        self.losses: list[torch.Tensor] = []
        if mode != "ignore":
            handle = trainer.optimizers.register_step_pre_hook(self._before_update)
            # first, before TorchTitan's MoE load-balancing hook: a skipped step must not move the biases
            trainer.optimizers._optimizer_step_pre_hooks.move_to_end(handle.id, last=False)

    # ---- called by the trainer ----

    def start_step(self) -> None:
        self.microbatches, self.losses = [], []

    @contextmanager
    def microbatch(self, input_dict: dict, labels: torch.Tensor):
        """Around one microbatch's forward/backward: keeps its inputs for a diagnosis, arms the injection."""
        index = len(self.microbatches)
        self.microbatches.append((input_dict, labels))
        if self.injection is None:
            yield
            return
        with self.injection.arming(self.trainer.step, index):
            yield

    def record_loss(self, loss: torch.Tensor) -> None:
        self.losses.append(loss.detach())

    def forward_failure(self, error: FloatingPointError) -> NonfiniteError:
        """The error to stop with when a forward raised FloatingPointError on every rank (the MoE
        router's check): the same, naming the step and where the non-finite values began."""
        where = self._diagnose()
        return NonfiniteError(f"step {self.trainer.step}: {error}; first non-finite forward output: {where}. "
                              f"{self._stop_note()}")

    # ---- the check before the optimizer update ----

    def _local_nonfinite(self) -> torch.Tensor:
        grads = [_local(p.grad) for part in self.trainer.model_parts for p in part.parameters() if p.grad is not None]
        grads = [g for g in grads if g.numel()]
        checks = [torch.stack(self.losses).float()] if self.losses else []
        if grads:
            checks.append(torch.stack(torch._foreach_norm(grads, float("inf"))).float())  # NaN/Inf propagate
        if not checks:
            return torch.zeros((), dtype=torch.int64, device=self.trainer.device)
        return (~torch.isfinite(torch.cat([c.reshape(-1) for c in checks])).all()).to(torch.int64)

    def _before_update(self, optimizer, args, kwargs):
        flag = self._local_nonfinite()
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():  # NOTE: host sync, once per step
            return None
        where = self._diagnose()
        step = self.trainer.step
        if self.mode == "stop":
            raise NonfiniteError(f"step {step}: the loss or the gradients are not finite; first non-finite forward "
                                 f"output: {where}. {self._stop_note()}")
        logger.warning(f"step {step}: the loss or the gradients are not finite; first non-finite forward output: "
                       f"{where}. [training] nonfinite = 'skip': the step's update is skipped (weights, optimizer "
                       f"state and MoE biases unchanged; its data and LR schedule step are used up)")
        for part in self.trainer.model_parts:
            for p in part.parameters():
                p.grad = None  # the optimizer leaves parameters without a gradient as they are
            for name, buffer in part.named_buffers():
                if name.endswith("tokens_per_expert"):  # the load-balancing hook then moves no bias
                    buffer.zero_()
        return None

    def _stop_note(self) -> str:
        last = getattr(self.trainer.checkpointer, "last_complete", None)
        return ("The run stops before this step's update; no checkpoint holds non-finite weights"
                + (f"; the newest checkpoint is {last}." if last else "."))

    # ---- diagnosis ----

    def _diagnose(self) -> str:
        """Re-run the step's forwards (no grad) until some rank finds a non-finite module output;
        the first such module in forward order (ties: the lowest rank), with every rank's first."""
        trainer = self.trainer
        model = trainer.model_parts[0]
        saved = {name: b.clone() for name, b in model.named_buffers()}
        calls, first = [0], [None]

        def hook(name):
            def check(module, args, output):
                if first[0] is None and _nonfinite(output):
                    first[0] = (calls[0], name)
                calls[0] += 1
            return check

        handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
        found = []
        try:
            for index, (input_dict, labels) in enumerate(self.microbatches):
                calls[0], first[0] = 0, None
                inputs, labels, extra_inputs, extra_kwargs = trainer.post_dataloading_process(input_dict, labels)
                arming = self.injection.arming(trainer.step, index) if self.injection else _nothing()
                with arming, torch.no_grad(), trainer.train_context(), trainer.maybe_enable_amp:
                    try:
                        model(inputs, **extra_inputs, **extra_kwargs)
                    except FloatingPointError:
                        pass  # the router's check, raised on every rank at the same layer
                found = [(f[0], rank, f[1], index) for rank, f in enumerate(gather_objects(first[0])) if f is not None]
                if found:
                    break
        finally:
            for handle in handles:
                handle.remove()
            with torch.no_grad():
                for name, buffer in model.named_buffers():
                    buffer.copy_(saved[name])
            # these forwards have no backward, whose end reshards FSDP's modules; left unsharded,
            # the next step computed with stale parameter state (non-finite weights seen): reshard
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        if not found:
            return "none: every module's forward output is finite on every rank (the non-finite values arose in the backward)"
        found.sort()
        _, rank, name, index = found[0]
        others = "; ".join(f"rank {r}: {n}" for _, r, n, _ in found[1:])
        return f"{name!r} on rank {rank} (microbatch {index})" + (f" (then {others})" if others else "")


@contextmanager
def _nothing():
    yield


_LOST_PEER = ("Timed out", "timed out", "Connection reset", "Connection closed", "Broken pipe", "ProcessGroupNCCL",
              "NCCL error", "DistBackendError")


def explain_failure(error: BaseException, trainer) -> None:
    """Log, on this rank, what a collective failure means (the exception itself follows)."""
    text = f"{type(error).__name__}: {error}"
    if not isinstance(error, RuntimeError) or not any(marker in text for marker in _LOST_PEER):
        return
    comm = trainer.job_config.comm
    step = getattr(trainer, "step", 0)
    bound = comm.train_timeout_seconds if step > 1 else comm.init_timeout_seconds
    key = "train_timeout_seconds" if step > 1 else "init_timeout_seconds"
    last = getattr(getattr(trainer, "checkpointer", None), "last_complete", None)
    logger.error(
        f"rank {dist.get_rank() if dist.is_initialized() else 0}: step {step}: a collective with the other ranks "
        f"failed: another rank died, hung or was stopped (collectives wait at most [comm] {key} = {bound} s). "
        f"Newest complete checkpoint: {last or 'none'}; a start with the same config resumes from it.")
