"""The benchmarks' timing loop: median of repeated calls after warm-up, max over ranks.

On CPU a call's time is this process's CPU time (``time.process_time``), not wall-clock time: the
CPU machines are shared, and wall-clock medians of a few calls there swing by several ms whenever
another process takes the cores (even a forward + backward "faster" than its forward alone). CPU
numbers check the benchmarks' plumbing; performance is measured on GPUs.
"""

import statistics
import time

import torch
import torch.distributed as dist


def _time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start_s = time.process_time()
    fn()
    return (time.process_time() - start_s) * 1e3


def medians_ms(fns, iters: int, warmup: int, device: torch.device | str = "cuda") -> list[float]:
    """Median ms of each of ``fns`` over ``iters`` timed calls after ``warmup`` untimed ones, the
    functions called in turn (so a change in the machine's load affects them alike): CUDA events
    on a CUDA device, this process's CPU time elsewhere."""
    device = torch.device(device)
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, fn_times in zip(fns, times):
            fn_times.append(_time_ms(fn, device))
    return [statistics.median(fn_times) for fn_times in times]


def median_ms(fn, iters: int, warmup: int, device: torch.device | str = "cuda") -> float:
    """Median ms of ``fn()`` over ``iters`` timed calls after ``warmup`` untimed ones."""
    return medians_ms([fn], iters, warmup, device)[0]


def max_over_ranks(value: float) -> float:
    """The largest ``value`` over the default process group (itself without one)."""
    if not dist.is_initialized():
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
