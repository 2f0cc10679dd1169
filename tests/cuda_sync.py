"""The GPU tests' no-host-sync check."""

import torch


def run_without_host_sync(fn) -> None:
    """``fn()`` with ``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation inside raises. Call it
    once before (compiles the kernels, allocates the workspaces): the first call may sync."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
