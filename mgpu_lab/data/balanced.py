"""Equal work, not equal counts: a cost-balanced partition of an epoch across ranks (lesson 05).

:class:`torch.utils.data.DistributedSampler` gives each rank the same *number* of
samples. When samples cost different amounts (sequence lengths, image sizes),
the ranks get different *work*, and every step waits for the slowest rank.
:func:`plan_balanced` partitions one epoch's indices into equal-length per-rank
lists of (nearly) equal total cost, the same plan on every rank from
``(costs, seed + epoch)``; :class:`CostBalancedSampler` serves one rank's
list, in place of a ``DistributedSampler``; ``bench/samplers.py`` times the plan on a
million samples. Making costs and measuring a partition's imbalance is
:mod:`mgpu_lab.data.workload`.

Example:
    >>> from mgpu_lab.data.workload import heavy_tailed_lengths, imbalance
    >>> costs = heavy_tailed_lengths(1000, seed=0)
    >>> lists = plan_balanced(costs, 4, seed=0, epoch=0)
    >>> lists.shape, round(imbalance(lists, costs), 3)
    (torch.Size([4, 250]), 1.0)
"""
from __future__ import annotations

import heapq

import numpy as np
import torch
from torch.utils.data import Sampler

# The same validation (and error messages) as the measurements of a partition use.
from mgpu_lab.data.workload import _as_costs, _check_replicas

__all__ = ["plan_balanced", "CostBalancedSampler"]


# Samples planned exactly (largest first, each to the lightest rank with room); the
# cheaper rest of a huge epoch is dealt in vectorised rounds (error below one cheap sample).
EXACT_LIMIT = 1 << 16


def _lpt(costs: list, world: int, per_rank: int) -> tuple[list, list]:
    """Largest first, each to the lightest rank that has room: (rank of each sample, loads)."""
    heap = [(0.0, r) for r in range(world)]  # (total cost so far, rank): ties go to the lower rank
    counts, loads, owner = [0] * world, [0.0] * world, [0] * len(costs)
    for i, cost in enumerate(costs):
        load, r = heapq.heappop(heap)
        owner[i], counts[r], loads[r] = r, counts[r] + 1, load + cost
        if counts[r] < per_rank:
            heapq.heappush(heap, (loads[r], r))
    return owner, loads


def plan_balanced(costs, num_replicas: int, *, seed: int = 0, epoch: int = 0, shuffle: bool = True,
                  drop_last: bool = False) -> torch.Tensor:
    """Every rank's index list for one epoch: equal lengths, (nearly) equal total cost.

    The plan depends only on its arguments, so each rank computes the same plan
    on its own. Steps: shuffle the indices with a generator seeded by
    ``seed + epoch`` (this breaks ties between equal costs differently each
    epoch); pad by repeating indices (or drop the tail when ``drop_last``) so the
    count divides evenly; give the samples, costliest first, each to the rank
    with the smallest total so far that still has room (greedy
    longest-processing-time); finally apply one shared shuffle of positions, so
    the k-th sample of every rank has a similar cost and every *step* is
    balanced, not only the epoch.

    Args:
        costs: non-negative per-sample costs (a sequence or tensor), e.g. lengths.
        num_replicas: number of ranks.
        seed, epoch: the generator's seed is ``seed + epoch``.
        shuffle: ``False`` gives the same plan every epoch (costliest first).
        drop_last: drop ``n % num_replicas`` samples instead of padding.

    Returns:
        int64 tensor ``[num_replicas, num_samples]``; row ``r`` is rank ``r``'s list.

    Raises:
        ValueError: a negative or non-finite cost, or ``num_replicas < 1``.

    Example:
        >>> plan_balanced([4, 3, 3, 2, 1, 1], 2, shuffle=False).tolist()
        [[0, 3, 4], [1, 2, 5]]
    """
    _check_replicas(num_replicas)
    c = _as_costs(costs)
    n, world = len(c), num_replicas
    per_rank = n // world if drop_last else -(-n // world)
    total = per_rank * world
    g = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(n, generator=g) if shuffle else torch.arange(n)
    order = order.repeat(-(-total // n))[:total] if n else order  # pad by repeating, or drop the tail
    order = order[torch.sort(c[order], descending=True, stable=True).indices]
    owner = torch.empty(total, dtype=torch.long)
    exact = min(total, EXACT_LIMIT)
    head, loads = _lpt(c[order[:exact]].tolist(), world, per_rank)
    owner[:exact] = torch.tensor(head, dtype=torch.long)
    if exact < total:
        _deal_rest(owner, exact, world, per_rank, loads)
    # Grouping by owner keeps each rank's samples costliest first, so positions line up by cost.
    # (NumPy's stable argsort of 16-bit ints is a radix sort: 10x torch's on a million samples.)
    small = owner.numpy().astype(np.int16 if world <= np.iinfo(np.int16).max else np.int32)
    lists = order[torch.from_numpy(np.argsort(small, kind="stable"))].view(world, per_rank)
    if shuffle:
        lists = lists[:, torch.randperm(per_rank, generator=g)]
    return lists


def _deal_rest(owner: torch.Tensor, start: int, world: int, per_rank: int, loads: list) -> None:
    """Vectorised tail of a huge plan: snake rounds, lightest rank first; extra room gets the cheapest."""
    counts = torch.bincount(owner[:start], minlength=world)
    room = per_rank - counts
    rounds = int(room.min())
    lightest = torch.tensor(sorted(range(world), key=lambda r: (loads[r], r)))
    snake = torch.cat([lightest, lightest.flip(0)]).repeat(-(-rounds // 2))[: rounds * world]
    owner[start: start + rounds * world] = snake
    owner[start + rounds * world:] = torch.repeat_interleave(torch.arange(world), room - rounds)


class CostBalancedSampler(Sampler[int]):
    """A DistributedSampler that balances the ranks' total cost, not just their counts.

    Every rank builds the same plan (:func:`plan_balanced`) from ``costs``,
    ``seed`` and the epoch, and yields its own row. Call :meth:`set_epoch`
    before each epoch, as with DistributedSampler.

    Args:
        costs: non-negative per-sample costs, e.g. sequence lengths.
        num_replicas: number of ranks. rank: this rank, ``0..num_replicas-1``.
        shuffle: a new order every epoch. seed: the same on every rank.
        drop_last: drop the tail instead of padding by repeating samples.

    Example:
        >>> s = CostBalancedSampler([9, 1, 1, 1, 5, 5], num_replicas=2, rank=0)
        >>> s.set_epoch(3)
        >>> len(s), sorted(s)
        (3, [0, 2, 3])
    """

    def __init__(self, costs, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        _check_replicas(num_replicas, rank)
        self.costs = _as_costs(costs)
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        n = len(self.costs)
        self.num_samples = n // num_replicas if drop_last else -(-n // num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Use the plan of this epoch (call it on every rank before iterating)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def plan(self) -> torch.Tensor:
        """Every rank's list for the current epoch, ``[num_replicas, num_samples]``."""
        return plan_balanced(self.costs, self.num_replicas, seed=self.seed, epoch=self.epoch,
                             shuffle=self.shuffle, drop_last=self.drop_last)

    def __iter__(self):
        return iter(self.plan()[self.rank].tolist())
