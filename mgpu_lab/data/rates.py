"""Samples per second of a DataLoader, timed after its workers have started, for several ``num_workers``.

:func:`measure` times one loader after a warm-up (start-up reported apart);
:func:`sweep_workers` builds a shuffled loader per ``num_workers`` and times each.
:func:`mgpu_lab.data.throughput.show_sweep` plots such a sweep.

Example:
    >>> from mgpu_lab.data.images import EncodedImages
    >>> rows = sweep_workers(EncodedImages(n=64), [0], batch_size=8, n_batches=2, progress=False)
    >>> rows[0]["num_workers"], rows[0]["samples_per_s"] > 0
    (0, True)
"""
from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["measure", "sweep_workers", "batch_size_of"]


def _bar(iterable=None, **kwargs):
    from tqdm.auto import tqdm

    return tqdm(iterable, **kwargs)


def batch_size_of(batch) -> int:
    """Samples in a batch: the length of its first tensor (batches may be tuples, lists or dicts)."""
    while isinstance(batch, (list, tuple, dict)):
        if not batch:
            return 0
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return len(batch) if isinstance(batch, torch.Tensor) and batch.dim() > 0 else 1


def measure(loader, n_batches: int, warmup: int = 1) -> dict:
    """Time ``n_batches`` of ``loader`` after ``warmup`` batches (worker start-up excluded).

    Returns:
        ``{"startup_s", "seconds", "samples", "samples_per_s"}``: start-up is the
        time to create the iterator and draw the warm-up batches.

    Raises:
        ValueError: the loader has fewer than ``warmup + n_batches`` batches.
    """
    if n_batches < 1 or warmup < 0:
        raise ValueError(f"n_batches={n_batches}, warmup={warmup}: time at least one batch, warmup >= 0")
    try:
        available = len(loader)
    except TypeError:
        available = None
    if available is not None and available < warmup + n_batches:
        raise ValueError(f"the loader has {available} batches but warmup={warmup} + n_batches={n_batches} "
                         "were asked for; lower n_batches or use a larger data set")
    start = time.perf_counter()
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    timed = time.perf_counter()
    samples = sum(batch_size_of(next(it)) for _ in range(n_batches))
    end = time.perf_counter()
    del it  # stops the workers of a non-persistent loader now
    return {"startup_s": timed - start, "seconds": end - timed, "samples": samples,
            "samples_per_s": samples / max(end - timed, 1e-9)}


def sweep_workers(dataset: Dataset, workers, batch_size: int = 32, n_batches: int = 10,
                  warmup: int = 1, progress: bool = True, **loader_kwargs) -> list[dict]:
    """Throughput of ``DataLoader(dataset, num_workers=k, ...)`` for every ``k`` in ``workers``.

    Each loader is timed after ``max(warmup, k)`` batches, so that every worker
    has delivered its first batch (start-up is reported apart, as ``startup_s``).

    Returns:
        One dict per ``k``: ``num_workers`` plus the keys of :func:`measure`.
    """
    rows = []
    bar = _bar(list(workers), desc="num_workers sweep", disable=not progress, leave=False)
    for k in bar:
        bar.set_postfix(num_workers=k)
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=k, **loader_kwargs)
        rows.append({"num_workers": k, **measure(loader, n_batches, warmup=max(warmup, k))})
    bar.close()
    return rows
