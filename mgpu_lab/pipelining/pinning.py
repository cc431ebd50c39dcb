"""One process per stage on a CPU: each rank pinned to its own core (lesson 06).

With one thread on its own core, two ranks really compute at the same time, as
two GPUs would.
"""
from __future__ import annotations

import os

import torch

from mgpu_lab import dist

__all__ = ["pin_to_core"]


def pin_to_core(rank: int | None = None, threads: int = 1) -> int | None:
    """Pin this process to CPU core ``rank % cores`` and ``threads`` intra-op threads.

    Returns:
        The core, or None where affinity cannot be set (then only the thread count is set).

    Example:
        >>> from mgpu_lab import launch
        >>> launch(pin_to_core, 1)   # in a rank: pinning the caller would pin this process for good
        launch: 1 rank · ...
        [0]
    """
    rank = dist.rank() if rank is None else rank
    torch.set_num_threads(threads)
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    os.sched_setaffinity(0, {core})
    return core
