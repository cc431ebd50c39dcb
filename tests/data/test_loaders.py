"""mgpu_lab.data.loaders: lesson 02's reference loaders (what its checks name as references)."""
from __future__ import annotations

import pytest
import torch

from mgpu_lab.data import loaders


def test_make_loader_trains_shuffled_full_batches_and_evaluates_everything_in_order():
    data = [torch.tensor([float(i)]) for i in range(10)]
    train = loaders.make_loader(data, 4, "cpu", num_workers=0, train=True)
    evaluate = loaders.make_loader(data, 4, torch.device("cuda", 1), num_workers=0, train=False)
    assert [len(b) for b in train] == [4, 4] and not train.pin_memory
    assert [b.flatten().tolist() for b in evaluate] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert evaluate.pin_memory  # decided from the device: building a pinned loader needs no GPU


def test_best_num_workers_refuses_nothing_to_measure():
    with pytest.raises(ValueError, match="candidates=\\[\\]"):
        loaders.best_num_workers(list(range(8)), [], 2, 1)
