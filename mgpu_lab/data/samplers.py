"""Samplers for class imbalance across ranks (lesson 05).

:class:`DistributedWeightedSampler` draws a reproducible weighted sample split
across ranks; :func:`class_balanced_weights` makes every class equally likely.
The cost-balanced plan (equal work, not equal counts) is :mod:`mgpu_lab.data.balanced`,
which lesson 05's notebook does not import (its learners write it).

Example:
    >>> class_balanced_weights(torch.tensor([0, 0, 0, 1])).tolist()  # each class equally likely
    [0.3333333333333333, 0.3333333333333333, 0.3333333333333333, 1.0]
"""
from __future__ import annotations

import torch
from torch.utils.data import Sampler

# The same validation (and error messages) as the measurements of a partition use.
from mgpu_lab.data.workload import _as_costs, _check_replicas

__all__ = ["DistributedWeightedSampler", "class_balanced_weights"]


class DistributedWeightedSampler(Sampler[int]):
    """WeightedRandomSampler split across ranks: one weighted draw per epoch, each rank its share.

    Every rank draws the same ``num_replicas * len(self)`` indices with a generator
    seeded by ``seed + epoch`` and keeps every ``num_replicas``-th one from position
    ``rank``: the shares are disjoint parts of one draw (with ``replacement=False``,
    no index appears on two ranks), reproducible for the same seed and epoch.

    Args:
        weights: non-negative per-sample weights (need not sum to 1).
        num_samples: draws per epoch over all ranks (default ``len(weights)``);
            each rank gets ``ceil(num_samples / num_replicas)``.
        num_replicas, rank: the world size and this rank.
        replacement: draw with replacement (the usual choice for rebalancing classes).
        seed: the same on every rank.

    Example:
        >>> w = class_balanced_weights([0, 0, 0, 1])
        >>> s = DistributedWeightedSampler(w, num_samples=8, num_replicas=2, rank=1)
        >>> len(s)
        4
    """

    def __init__(self, weights, num_samples: int | None = None, num_replicas: int = 1, rank: int = 0,
                 replacement: bool = True, seed: int = 0):
        _check_replicas(num_replicas, rank)
        self.weights = _as_costs(weights)
        total = len(self.weights) if num_samples is None else num_samples
        if total < 1 or not self.weights.sum() > 0:
            raise ValueError(f"num_samples={total} and sum(weights)={self.weights.sum().item():g}: "
                             "need at least one draw and one positive weight")
        self.num_samples = -(-total // num_replicas)
        positive = int((self.weights > 0).sum())
        if not replacement and self.num_samples * num_replicas > positive:
            raise ValueError(f"replacement=False needs num_replicas * len(self) = "
                             f"{self.num_samples * num_replicas} <= {positive} samples with weight > 0; "
                             "lower num_samples or use replacement=True")
        self.num_replicas, self.rank, self.replacement, self.seed, self.epoch = (
            num_replicas, rank, replacement, seed, 0)

    def set_epoch(self, epoch: int) -> None:
        """Draw this epoch's sample (call it on every rank before iterating)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        drawn = torch.multinomial(self.weights, self.num_samples * self.num_replicas, self.replacement,
                                  generator=g)
        return iter(drawn[self.rank::self.num_replicas].tolist())


def class_balanced_weights(labels) -> torch.Tensor:
    """Per-sample weights ``1 / count(label)``: every class is drawn equally often.

    Example:
        >>> class_balanced_weights([0, 0, 0, 1]).tolist()
        [0.3333333333333333, 0.3333333333333333, 0.3333333333333333, 1.0]
    """
    y = torch.as_tensor(labels, dtype=torch.long)
    return 1.0 / torch.bincount(y)[y].double()

