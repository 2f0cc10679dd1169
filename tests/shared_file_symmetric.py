"""A CPU stand-in for torch's symmetric memory, for tests of the mok workspace's protocols between gloo processes
under Triton's interpreter. Not a product path: CPU tensors have no symmetric memory
(``titan_mok.moe.workspace.SYMMETRIC_ALLOCATORS`` has CUDA's only), so a test registers this one.

What it is: each rank's allocation is a file in a folder every process of the group sees (the test's tmp folder),
mapped shared (``torch.from_file(shared=True)``) into every process of the group; rank r's own buffer is its
mapping of its file, and its peer table holds its own mappings' addresses of every rank's file, so a kernel in
process r loads and stores the peers' memory through those addresses, as a GPU kernel does through symmetric
memory's peer pointers. The interpreter's atomics are the CPU's, on the shared pages, so they are atomic across
the processes. The barrier is a gloo barrier (a host barrier: on CPU every kernel launch has finished when it
returns, so it orders what the launches wrote, as the device barrier does on the GPU stream).

What it is not: GPU memory over NVLink, its memory model or its device barrier; nothing here runs two kernels of
the group at the same time with spinning waits (the megakernel runs its serialized mode here).
"""

import itertools
import os

import torch
import torch.distributed as dist


class _GlooBarrier:
    """The group's barrier with the symmetric-memory handle's signature (timeout: the group's own)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def barrier(self, channel: int = 0, timeout_ms: int | None = None) -> None:
        dist.barrier(group=self.group)


def shared_file_allocator(folder: str):
    """An allocator for ``SYMMETRIC_ALLOCATORS["cpu"]``: (own [nbytes] uint8, every rank's [nbytes] uint8 mapped in
    this process, a handle with ``barrier``). Collective, as torch's: every rank calls it at the same point."""
    allocations = itertools.count()

    def allocate(group: dist.ProcessGroup, nbytes: int, device: torch.device):
        if torch.device(device).type != "cpu":
            raise ValueError(f"shared_file_allocator maps CPU memory, not {device}")
        index = next(allocations)
        rank, ranks = dist.get_rank(group), dist.get_world_size(group)
        path = lambda r: os.path.join(folder, f"symmetric_{group.group_name}_{index}_rank{r}")  # noqa: E731
        with open(path(rank), "wb") as f:
            f.truncate(nbytes)  # zeros
        dist.barrier(group=group)  # every rank's file exists before any maps it
        buffers_B = [torch.from_file(path(r), shared=True, size=nbytes, dtype=torch.uint8) for r in range(ranks)]
        return buffers_B[rank], buffers_B, _GlooBarrier(group)

    return allocate
