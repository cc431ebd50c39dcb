"""Lesson 02's loaders, ready-made: ``make_loader``, ``seed_worker``, ``best_num_workers``.

These are the reference answers of lesson 02's exercises: its checks name them
(an answer that calls one fails), its tests hold them to full marks, and later
lessons may import them. Lesson 02's notebook does not import this module, and
nothing it imports does: its demos use the learner's own functions.

Example:
    >>> from mgpu_lab.data.images import EncodedImages
    >>> loader = make_loader(EncodedImages(n=16), 4, "cpu", train=False)
    >>> loader.pin_memory, loader.drop_last, len(loader)
    (False, False, 4)
"""
from __future__ import annotations

import os
import random
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

__all__ = ["make_loader", "seed_worker", "best_num_workers"]


def make_loader(dataset, batch_size: int, device, num_workers: int = 0, train: bool = True) -> DataLoader:
    """A DataLoader for training (shuffled, full batches) or evaluation (in order, every sample).

    Args:
        dataset: The map-style data set.
        batch_size: Samples per batch.
        device: Where the batches will be used; pinned memory only for a CUDA device.
        num_workers: Worker processes; they persist across epochs when > 0.
        train: Shuffle and drop the last incomplete batch when True.

    Returns:
        The configured ``torch.utils.data.DataLoader``.
    """
    return DataLoader(dataset, batch_size=batch_size, shuffle=train, drop_last=train,
                      num_workers=num_workers, pin_memory=torch.device(device).type == "cuda",
                      persistent_workers=num_workers > 0)


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn``: reseed torch, Python's ``random`` and NumPy, differently in every (rank, worker).

    torch's per-worker seed (``base_seed + worker_id``) is the same on every rank
    whose loader has the same generator seed; the rank (``RANK``, 0 without a
    launcher) is hashed in with it, so no two (rank, worker) pairs share a seed,
    every epoch draws anew and a seeded generator repeats the run.

    Args:
        worker_id: The worker's index (torch's per-worker seed already includes it).
    """
    rank = int(os.environ.get("RANK", 0))
    seed = int(np.random.SeedSequence([torch.initial_seed(), rank]).generate_state(1)[0])
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def best_num_workers(dataset, candidates: list[int], batch_size: int, n_batches: int) -> int:
    """The ``num_workers`` among ``candidates`` with the most samples per second, after a warm-up.

    Args:
        dataset: The data set to load.
        candidates: The ``num_workers`` values to try.
        batch_size: Samples per batch.
        n_batches: Batches timed per candidate, after ``max(1, k)`` warm-up batches.

    Returns:
        The fastest candidate (a ``num_workers`` value).

    Raises:
        ValueError: ``candidates`` is empty or ``n_batches < 1``.
    """
    if not candidates or n_batches < 1:
        raise ValueError(f"candidates={candidates!r}, n_batches={n_batches}: give at least one candidate "
                         "and time at least one batch")
    best, best_rate = None, -1.0
    for k in candidates:
        it = iter(DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=k))
        for _ in range(max(1, k)):  # warm-up: every worker has started and delivered a batch
            next(it)
        start = time.perf_counter()
        for _ in range(n_batches):
            next(it)
        rate = n_batches * batch_size / (time.perf_counter() - start)
        del it  # stops the workers now
        if rate > best_rate:
            best, best_rate = k, rate
    return best
