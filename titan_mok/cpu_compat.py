"""Every place TorchTitan 0.2.2 assumes CUDA, adapted for CPU (gloo) runs.

`apply()` is called by the train entry only when no CUDA device is present, so
none of this touches GPU behaviour. Each adaptation says why it exists; each is
pinned by a test in tests/train/test_cpu_compat.py that fails once TorchTitan or
torch no longer needs it.
"""

import os
import platform
import resource
import types

import torch

_applied = False


class CpuDeviceModule:
    """Stands in for `torch.cuda` where TorchTitan calls a device module."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    # barrier(device_ids=[current_device()]) needs an int; torch.cpu returns "cpu".
    def current_device(self) -> int:
        return 0

    # torch.cpu has no get_device_name; the metrics processor logs it.
    def get_device_name(self, device=None) -> str:
        return platform.processor() or platform.machine()

    # torch.cpu has no get_device_properties; memory percentages need a capacity.
    def get_device_properties(self, device=None):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(total_memory=total, name=self.get_device_name())

    # torch.cpu has no memory_stats; report this process's peak RSS instead.
    def memory_stats(self, device=None) -> dict:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0, "num_ooms": 0}

    # torch.cpu has neither; peak RSS cannot be reset, the cache does not exist.
    def reset_peak_memory_stats(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass


class TorchWithCpuIntHistc:
    """Stands in for `torch` inside TorchTitan's MoE module: `histc` of int64 expert ids on CPU
    counts them as floats (exact below 2^24) and returns the ids' dtype, as CUDA's histc does."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def histc(input, *args, **kwargs):
        if input.device.type == "cpu" and not input.is_floating_point():
            return torch.histc(input.float(), *args, **kwargs).to(input.dtype)
        return torch.histc(input, *args, **kwargs)


def apply() -> None:
    """Adapt TorchTitan for a CPU-only process. Idempotent."""
    global _applied
    if _applied:
        return
    if torch.cuda.is_available():
        raise RuntimeError("titan_mok.cpu_compat.apply() is for CPU-only processes; a CUDA device is present")

    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.moe.utils as tt_moe_utils
    import torchtitan.tools.profiling as profiling
    import torchtitan.tools.utils as tt_utils

    # tools/utils falls back to "cuda" when no accelerator exists; it must say "cpu".
    cpu = CpuDeviceModule()
    for module in (tt_utils, metrics, dist_utils, profiling):
        if hasattr(module, "device_module"):
            module.device_module = cpu
    for module in (tt_utils, metrics, dist_utils, parallel_dims):
        module.device_type = "cpu"

    # The token permutation for EP>1 is a Triton kernel; on CPU tensors use TorchTitan's CPU path.
    triton_permute = tt_moe_utils.generate_permute_indices

    def generate_permute_indices(tokens_per_expert_group, *args, **kwargs):
        kwargs.setdefault("use_cpu", tokens_per_expert_group.device.type == "cpu")
        return triton_permute(tokens_per_expert_group, *args, **kwargs)

    tt_moe_utils.generate_permute_indices = generate_permute_indices

    # TorchTitan's own MoE (router, reorderer) counts picks with torch.histc on int64 ids, which
    # torch implements on CUDA only.
    import torchtitan.models.moe.moe as tt_moe

    tt_moe.torch = TorchWithCpuIntHistc()
    _applied = True


def use_sum_reductions(model: torch.nn.Module) -> None:
    """gloo has no ReduceOp.PREMUL_SUM, which FSDP uses for a custom gradient divide
    factor (experts under EP): reduce with SUM and divide afterwards, the same math."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
