"""The multi-process CPU tests' harness: spawned ranks that each save what they saw, loaded back in the test."""

import torch
import torch.multiprocessing as mp


def rank_file(out_dir: str, rank: int) -> str:
    """Where rank ``rank``'s worker saves its results (``torch.save``)."""
    return f"{out_dir}/rank{rank}.pt"


def spawn_ranks(worker, world: int, out_dir: str) -> list:
    """Runs ``worker(rank, out_dir)`` in ``world`` spawned processes and returns each rank's saved results."""
    mp.spawn(worker, args=(out_dir,), nprocs=world, join=True)
    return [torch.load(rank_file(out_dir, rank), weights_only=False) for rank in range(world)]
