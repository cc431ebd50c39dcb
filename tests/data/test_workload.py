"""mgpu_lab.data.workload: per-sample costs and the measures of a partition's imbalance."""
from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

from mgpu_lab.data.workload import distributed_sampler_lists, heavy_tailed_lengths, imbalance, rank_costs, step_imbalance


def test_metrics():
    assert rank_costs([[0, 1], [2, 3]], [1, 2, 3, 4]).tolist() == [3.0, 7.0]
    assert imbalance([[0], [1]], [0, 0]) == 1.0
    assert step_imbalance([[0, 1, 2]], [1, 1, 1], 2) == 1.0  # one rank, a short last batch
    assert step_imbalance([[0, 1], [3, 2]], [4, 1, 1, 4], 1) == 1.0  # step by step equal
    assert step_imbalance([[0, 3], [1, 2]], [4, 1, 1, 4], 2) == 1.6  # one step: 8 against a mean of 5


def test_distributed_sampler_lists_are_torchs():
    lists = distributed_sampler_lists(11, 3, seed=2, epoch=1)
    for r in range(3):
        s = DistributedSampler(range(11), 3, r, seed=2)
        s.set_epoch(1)
        assert lists[r].tolist() == list(s)


def test_heavy_tailed_lengths_stay_in_range_around_the_median():
    lengths = heavy_tailed_lengths(1000, seed=0, median=48, max_len=300)
    assert lengths.min() >= 1 and lengths.max() <= 300 and 40 <= lengths.median() <= 56


def test_bad_arguments_say_the_values_and_the_fix():
    with pytest.raises(ValueError, match=r"batch_size=0"):
        step_imbalance([[0]], [1], 0)
    with pytest.raises(ValueError, match=r"heavy_tailed_lengths\(n=-1"):
        heavy_tailed_lengths(-1)
    with pytest.raises(ValueError, match=r"costs\[1\] = -2.0: every cost must be a finite number >= 0"):
        rank_costs([[0, 1]], [1, -2])
    with pytest.raises(ValueError, match=r"num_replicas=0: pass the number of ranks"):
        distributed_sampler_lists(4, 0)
