"""Lesson 02's loaders, ready-made: ``make_loader``, ``seed_worker``, ``best_num_workers``.

These are the reference answers of lesson 02's exercises. Later lessons import
them instead of repeating them, and lesson 02's own demos fall back on them
(:func:`yours_or_reference`) while an exercise is still unwritten, saying so.

Example:
    >>> from mgpu_lab.data.images import EncodedImages
    >>> loader = make_loader(EncodedImages(n=16), 4, "cpu", train=False)
    >>> loader.pin_memory, loader.drop_last, len(loader)
    (False, False, 4)
"""
from __future__ import annotations

import random
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

__all__ = ["make_loader", "seed_worker", "best_num_workers", "yours_or_reference"]


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
    """``worker_init_fn``: seed Python's ``random`` and NumPy from torch's per-worker seed.

    Args:
        worker_id: The worker's index (torch's per-worker seed already includes it).
    """
    seed = torch.initial_seed() % 2**32
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


def yours_or_reference(yours, reference, try_now: tuple | None = None):
    """``yours``, or ``reference`` for as long as ``yours`` still raises NotImplementedError.

    For demos that call an exercise: a learner who has not written it yet still
    gets the demo, and one printed line says which function ran instead.

    Args:
        yours: The learner's function.
        reference: What runs instead while ``yours`` is not written.
        try_now: Arguments to call ``yours`` with once, now, to choose here; for
            functions that run where a note cannot be seen (a DataLoader worker).
            The random states of Python, NumPy and torch are restored after the try.

    Example:
        >>> def make_loader(*args, **kwargs):
        ...     raise NotImplementedError
        >>> import mgpu_lab.data.loaders as loaders
        >>> build = yours_or_reference(make_loader, loaders.make_loader)
        >>> loader = build(list(range(8)), 4, "cpu")
        note: your make_loader is not written yet; this demo uses mgpu_lab.data.loaders.make_loader
    """
    said = []

    def note():
        if not said:
            print(f"note: your {getattr(yours, '__name__', 'function')} is not written yet; this demo uses "
                  f"{reference.__module__}.{reference.__name__}", flush=True)
            said.append(True)

    if try_now is not None:
        states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
        try:
            yours(*try_now)
            return yours
        except NotImplementedError:
            note()
            return reference
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.random.set_rng_state(states[2])

    def call(*args, **kwargs):
        try:
            return yours(*args, **kwargs)
        except NotImplementedError:
            note()
            return reference(*args, **kwargs)

    call.__name__ = getattr(yours, "__name__", "call")
    return call
