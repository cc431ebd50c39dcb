"""Per-sample costs, and how evenly a partition of them spreads the work across ranks (lesson 05).

A sample's *cost* is whatever its step time grows with (tokens of a sequence,
pixels of an image). :func:`heavy_tailed_lengths` makes realistic costs;
:func:`rank_costs`, :func:`imbalance` and :func:`step_imbalance` measure any
partition of them into per-rank lists, and :func:`distributed_sampler_lists` is
the partition torch's ``DistributedSampler`` makes, the baseline to beat. The
samplers that balance the work are in :mod:`mgpu_lab.data.samplers`.

Example:
    >>> costs = heavy_tailed_lengths(1000, seed=0)
    >>> lists = distributed_sampler_lists(len(costs), 4, seed=0)
    >>> round(imbalance(lists, costs), 3), round(step_imbalance(lists, costs, batch_size=8), 3)
    (1.088, 1.427)
"""
from __future__ import annotations

import math

import torch
from torch.utils.data import DistributedSampler

__all__ = ["heavy_tailed_lengths", "rank_costs", "imbalance", "step_imbalance", "distributed_sampler_lists"]


def heavy_tailed_lengths(n: int, seed: int = 0, median: float = 48.0, sigma: float = 1.0,
                         max_len: int = 2048) -> torch.Tensor:
    """Sequence lengths with a heavy (log-normal) tail: most short, a few very long.

    Args:
        n: number of samples.
        seed: the same seed gives the same lengths on every process.
        median: the median length in tokens.
        sigma: spread of log-length; 1.0 puts the longest of 1000 near 20x the median.
        max_len: lengths are clipped to ``1..max_len``.

    Returns:
        int64 tensor of ``n`` lengths; use them as per-sample costs.

    Example:
        >>> heavy_tailed_lengths(5, seed=1).tolist()
        [93, 63, 51, 89, 31]
    """
    if n < 0 or median <= 0 or sigma < 0 or max_len < 1:
        raise ValueError(f"heavy_tailed_lengths(n={n}, median={median}, sigma={sigma}, max_len={max_len}): "
                         "need n >= 0, median > 0, sigma >= 0, max_len >= 1")
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g, dtype=torch.float64)
    return (math.log(median) + sigma * z).exp().round().clamp(1, max_len).long()


def _as_costs(costs) -> torch.Tensor:
    c = torch.as_tensor(costs, dtype=torch.float64).flatten()
    bad = ~torch.isfinite(c) | (c < 0)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"costs[{i}] = {c[i].item()}: every cost must be a finite number >= 0 "
                         "(e.g. the sequence length of the sample)")
    return c


def _check_replicas(num_replicas: int, rank: int | None = None) -> None:
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas!r}: pass the number of ranks, an int >= 1")
    if rank is not None and not 0 <= rank < num_replicas:
        raise ValueError(f"rank={rank} with num_replicas={num_replicas}: the rank must lie in "
                         f"0..{num_replicas - 1}")


def rank_costs(lists, costs) -> torch.Tensor:
    """Total cost of each rank's list (float64 tensor, one entry per rank).

    Example:
        >>> rank_costs([[0, 1], [2, 3]], [1, 2, 3, 4]).tolist()
        [3.0, 7.0]
    """
    c = _as_costs(costs)
    return torch.stack([c[torch.as_tensor(list(lst), dtype=torch.long)].sum() for lst in lists])


def imbalance(lists, costs) -> float:
    """max/mean of the ranks' total costs: 1.0 is perfect, 1.2 means the busiest has 20% extra.

    Example:
        >>> imbalance([[0, 1], [2, 3]], [1, 2, 3, 4])
        1.4
    """
    totals = rank_costs(lists, costs)
    mean = totals.mean().item()
    return totals.max().item() / mean if mean > 0 else 1.0


def step_imbalance(lists, costs, batch_size: int) -> float:
    """Sum over steps of the slowest rank's batch cost over the mean rank's: the straggler factor.

    With one synchronisation per step (DDP's gradient all-reduce), an epoch lasts
    about this many times as long as perfectly balanced work would.

    Example:
        >>> step_imbalance([[0, 3], [1, 2]], [4, 1, 1, 4], batch_size=1)
        1.6
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    c = _as_costs(costs)
    per_rank = torch.stack([c[torch.as_tensor(list(lst), dtype=torch.long)] for lst in lists])
    steps = -(-per_rank.shape[1] // batch_size)
    padded = torch.nn.functional.pad(per_rank, (0, steps * batch_size - per_rank.shape[1]))
    batch = padded.view(len(per_rank), steps, batch_size).sum(2)
    mean = batch.mean(0).sum().item()
    return batch.max(0).values.sum().item() / mean if mean > 0 else 1.0


def distributed_sampler_lists(n: int, num_replicas: int, *, seed: int = 0, epoch: int = 0,
                              shuffle: bool = True, drop_last: bool = False) -> torch.Tensor:
    """The lists torch's DistributedSampler gives every rank, ``[num_replicas, num_samples]``.

    Example:
        >>> distributed_sampler_lists(5, 2, shuffle=False).tolist()
        [[0, 2, 4], [1, 3, 0]]
    """
    _check_replicas(num_replicas)
    rows = []
    for r in range(num_replicas):
        s = DistributedSampler(range(n), num_replicas=num_replicas, rank=r, shuffle=shuffle,
                               seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        rows.append(list(s))
    return torch.tensor(rows, dtype=torch.long).view(num_replicas, -1)
