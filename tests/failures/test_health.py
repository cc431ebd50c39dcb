"""mgpu_lab.failures.health: a NaN on one rank seen by every rank; drifting replicas detected."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mgpu_lab import launch
from mgpu_lab.failures import health

pytestmark = pytest.mark.timeout(120)


def _finite(bad_rank):
    value = torch.ones(3)
    if dist.get_rank() == bad_rank:
        value[1] = float("nan")
    return health.all_finite(value)


def _sync(drift):
    torch.manual_seed(0)
    model = DDP(nn.Linear(3, 2))
    before = health.weights_in_sync(model)
    if drift and dist.get_rank() == 1:
        with torch.no_grad():
            model.module.bias.add_(1e-3)
    return before, health.weights_in_sync(model)


def test_all_finite_is_the_same_answer_on_every_rank():
    assert launch(_finite, 2, 1) == [False, False]
    assert launch(_finite, 2, -1) == [True, True]


def test_weights_in_sync_is_exact_for_replicas_and_catches_a_drifted_rank():
    (before, after), _ = launch(_sync, 2, True)
    assert before == (True, 0.0)
    assert after[0] is False and after[1] > 0
    assert launch(_sync, 2, False)[0][1] == (True, 0.0)
