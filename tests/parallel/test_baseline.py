"""mgpu_lab.parallel.baseline: one process with the global batch, and each rank's share of an evaluation."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mgpu_lab import launch
from mgpu_lab.data import datasets
from mgpu_lab.parallel import baseline

DATA = datasets.synthetic_classification(24, seed=1)
VAL = datasets.synthetic_classification(10, seed=3)


def model_fn():
    torch.manual_seed(0)
    return nn.Linear(8, 3)


def test_reference_train_without_set_epoch_is_another_training():
    right = baseline.reference_train(model_fn, DATA, 2, 8, 0.2)
    assert baseline.max_diff(right, baseline.reference_train(model_fn, DATA, 2, 8, 0.2)) == 0
    assert baseline.max_diff(right, baseline.reference_train(model_fn, DATA, 2, 8, 0.2, set_epoch=False)) > 1e-4


def _shares(how):
    return baseline.shard_sums(model_fn(), VAL, how=how)["count"]


def test_shard_sums_counts_each_rank_s_share_the_three_ways():
    got = {how: launch(_shares, 4, how) for how in ("exact", "padded", "drop_last")}
    assert got == {"exact": [3, 3, 2, 2], "padded": [3, 3, 3, 3], "drop_last": [2, 2, 2, 2]}


def test_shard_sums_in_one_process_sees_everything_and_refuses_an_unknown_way():
    whole = baseline.shard_sums(model_fn(), VAL)
    assert whole["count"] == 10 and 0 <= whole["correct"] <= 10 and whole["loss"] > 0
    with pytest.raises(ValueError, match="how='sum'"):
        baseline.shard_sums(model_fn(), VAL, how="sum")
