"""Communication workspace of the fused mok path: symmetric-memory buffers (docs/design.md, the fused path).

Legend: P ep degree, T tokens per rank, K top-k, N = T·K slots per rank, H hidden.

One workspace per (EP group, T, K, H, dtype, device), allocated at the first call with that
shape (a collective: every rank of the group makes it at the same layer call, which holds in
training since all ranks run the same layers on the same fixed batch shape) and reused by
every MoE layer, step after step: never sized by a host-side count, never reallocated.

Buffers, carved from one ``torch.distributed._symmetric_memory`` allocation:
- ``x_TH`` [T, H]: this rank's token rows; the expert ranks pull them (forward dispatch).
- ``ids_N`` int32 [N]: this rank's top-k ids; every rank gathers them (the schedule).
- ``slots_NH`` [N, H]: one row per (token, slot); the expert ranks push expert outputs here
  (forward combine) and row gradients (backward dispatch; the megakernel's dgrad launch too).
- ``dy_NH`` [N, H]: w·dY per (token, slot); the expert ranks pull it (backward combine).
- ``arrivals_T`` int32 [T], ``x_ready`` int64 [1], ``dy_ready`` int64 [1]: the megakernel launches' per-token
  arrival counters (the forward's and the dgrad launch's, one running total) and their x_TH- and
  dy_NH-published flags (``kernels/mok_megakernel.py``, ``kernels/mok_megakernel_bwd.py``; the fused path leaves
  them alone). Zeroed at allocation, then only ever raised (epochs), by the megakernel calls whose count
  ``megakernel_calls`` keeps.
``tables[name]`` is the int64 [P] device tensor of every rank's address of that buffer (the peer
pointers the Triton kernels dereference).

Ordering instead of a ring: every transfer sits between two calls of ``barrier()``, symmetric
memory's device-side barrier on the current stream (no host sync). A buffer is rewritten only
after a barrier that every reader of its previous contents has passed, so one set of buffers is
safe for all layers, forward, backward and activation recomputation. Each barrier waits at most
``BARRIER_TIMEOUT_MS``: a dead or diverged peer ends in a device-side error, not a hung GPU.
With P = 1 (no group) the buffers are plain device memory and ``barrier()`` does nothing.

The megakernel shares these buffers with the fused path (its own ordering, by epochs instead of barriers,
keeps the same rule: kernels/mok_megakernel.py, "Across calls"; a fused call starts with a barrier that every
rank passes after its last megakernel finish, and a megakernel call's pushes into a rank wait for that rank's
x_ready (the dgrad launch's: dy_ready), which it stores after its last fused call's reads).

Where the symmetric allocation comes from: ``SYMMETRIC_ALLOCATORS`` by device type; CUDA's is torch's
symmetric memory. Nothing else provides one in the product; tests register a CPU stand-in (shared-memory
files mapped into gloo processes, tests/shared_file_symmetric.py) to run the protocol under Triton's
interpreter.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

BARRIER_TIMEOUT_MS = 60_000
"""Bound of every device-side wait on a peer (torch's symmetric-memory barrier traps after it)."""

_ALIGN = 256
_WORKSPACES: dict[tuple, "MokWorkspace"] = {}


@dataclass
class MegakernelCalls:
    """The megakernel launches' calls on a workspace's flags, forward and dgrad counted together: every rank of the
    group makes the same calls in the same order (the layers of a step: forward, recomputation and backward alike),
    so each rank's count is the same epoch."""

    epoch: int = 0
    """The last call's epoch (the value it published in x_ready, or a dgrad launch's in dy_ready)."""
    arrivals: int = 0
    """What every arrival counter holds after the last call: each call's rows per token, summed."""


@dataclass
class MokWorkspace:
    num_tokens: int
    top_k: int
    dim: int
    dtype: torch.dtype
    ep_degree: int
    ep_rank: int
    x_TH: torch.Tensor
    ids_N: torch.Tensor
    slots_NH: torch.Tensor
    dy_NH: torch.Tensor
    tables: dict[str, torch.Tensor]
    """Buffer name → int64 [P] addresses on every rank."""
    peer_ids: list[torch.Tensor]
    """[P] views of every rank's ``ids_N`` (peer memory)."""
    arrivals_T: torch.Tensor
    x_ready: torch.Tensor
    dy_ready: torch.Tensor
    handle: object = field(default=None, repr=False)
    """The symmetric-memory handle (None when P = 1): its ``barrier(channel, timeout_ms)``."""
    megakernel_calls: MegakernelCalls = field(default_factory=MegakernelCalls)

    def barrier(self) -> None:
        """Device-side barrier of the EP group on the current stream (bounded wait)."""
        if self.handle is not None:
            self.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)

    def gather_ids(self, ids_PN: torch.Tensor) -> None:
        """ids_PN[p] = rank p's ids (peer loads; call between two barriers)."""
        for rank, peer_ids_N in enumerate(self.peer_ids):
            ids_PN[rank].copy_(peer_ids_N)


def _layout(num_tokens: int, top_k: int, dim: int, dtype: torch.dtype) -> dict[str, tuple[int, tuple, torch.dtype]]:
    """Buffer name → (byte offset, shape, dtype) inside the one allocation."""
    slots = num_tokens * top_k
    shapes = {"x_TH": ((num_tokens, dim), dtype), "ids_N": ((slots,), torch.int32),
              "slots_NH": ((slots, dim), dtype), "dy_NH": ((slots, dim), dtype),
              "arrivals_T": ((num_tokens,), torch.int32), "x_ready": ((1,), torch.int64),
              "dy_ready": ((1,), torch.int64)}
    layout, offset = {}, 0
    for name, (shape, buf_dtype) in shapes.items():
        layout[name] = (offset, shape, buf_dtype)
        nbytes = buf_dtype.itemsize * torch.Size(shape).numel()
        offset += -(-nbytes // _ALIGN) * _ALIGN
    layout["_total"] = (offset, (), torch.uint8)
    return layout


def _carve(base_B: torch.Tensor, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    nbytes = dtype.itemsize * torch.Size(shape).numel()
    return base_B[offset : offset + nbytes].view(dtype).view(shape)


def _torch_symmetric_memory(group: dist.ProcessGroup, nbytes: int, device: torch.device):
    """(this rank's [nbytes] uint8, every rank's as tensors of this process, the handle) from torch's symmetric
    memory (collective)."""
    from torch.distributed import _symmetric_memory as symm_mem

    base_B = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(base_B, group)
    peer_bases = [handle.get_buffer(rank, (nbytes,), torch.uint8) for rank in range(dist.get_world_size(group))]
    return base_B, peer_bases, handle


SYMMETRIC_ALLOCATORS: dict[str, Callable] = {"cuda": _torch_symmetric_memory}
"""Device type → allocator(group, nbytes, device) → (own [nbytes] uint8, every rank's [nbytes] uint8 as tensors of
this process, a handle whose ``barrier(channel=, timeout_ms=)`` is the group's bounded barrier on the current
stream). Collective: every rank of the group calls it at the same point."""


def _allocate(group, num_tokens, top_k, dim, dtype, device) -> MokWorkspace:
    layout = _layout(num_tokens, top_k, dim, dtype)
    total = layout.pop("_total")[0]
    if group is None:
        base_B = torch.empty(total, dtype=torch.uint8, device=device)
        handle, ep_degree, ep_rank = None, 1, 0
        peer_bases = [base_B]
    else:
        allocator = SYMMETRIC_ALLOCATORS.get(torch.device(device).type)
        if allocator is None:
            raise ValueError(f"the mok workspace of an expert-parallel group needs symmetric memory, which "
                             f"{torch.device(device).type} tensors do not have: use CUDA tensors (device types with "
                             f"an allocator: {sorted(SYMMETRIC_ALLOCATORS)})")
        base_B, peer_bases, handle = allocator(group, total, device)
        ep_degree, ep_rank = dist.get_world_size(group), dist.get_rank(group)
    bases = [peer_B.data_ptr() for peer_B in peer_bases]
    bufs = {name: _carve(base_B, off, shape, buf_dtype) for name, (off, shape, buf_dtype) in layout.items()}
    tables = {
        name: torch.tensor([base + off for base in bases], dtype=torch.int64, device=device)
        for name, (off, _, _) in layout.items()
    }
    off, shape, _ = layout["ids_N"]
    peer_ids = [_carve(peer_B, off, shape, torch.int32) for peer_B in peer_bases]
    ws = MokWorkspace(num_tokens, top_k, dim, dtype, ep_degree, ep_rank, bufs["x_TH"], bufs["ids_N"],
                      bufs["slots_NH"], bufs["dy_NH"], tables, peer_ids, bufs["arrivals_T"], bufs["x_ready"],
                      bufs["dy_ready"], handle)
    ws.arrivals_T.zero_()
    ws.x_ready.zero_()
    ws.dy_ready.zero_()
    ws.barrier()  # no peer reads this rank's flags before they are zero
    return ws


def get_workspace(group: dist.ProcessGroup | None, num_tokens: int, top_k: int, dim: int, dtype: torch.dtype,
                  device: torch.device) -> MokWorkspace:
    """The workspace of this (group, shape); allocated once (collectively), then reused."""
    key = (None if group is None else group.group_name, num_tokens, top_k, dim, dtype, torch.device(device))
    if key not in _WORKSPACES:
        _WORKSPACES[key] = _allocate(group, num_tokens, top_k, dim, dtype, device)
    return _WORKSPACES[key]
