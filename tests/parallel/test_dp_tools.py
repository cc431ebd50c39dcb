"""mgpu_lab.parallel.dp_tools: what lesson 03's notebook runs around DataParallel (the forward it is given)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mgpu_lab.parallel.data_parallel import StepByStepDataParallel
from mgpu_lab.parallel.dp_tools import TracedDataParallel, traced_step
from mgpu_lab.parallel.timeline import Timeline

CPU2 = [torch.device("cpu")] * 2


def forward(model, batch, devices):  # the library's DataParallel forward
    return StepByStepDataParallel(model, devices)(batch)


def deep_forward(model, batch, devices):  # replicas that deep-copy the module (and its hooks)
    outs = [copy.deepcopy(model)(c) for c in batch.chunk(len(devices))]
    return torch.cat(outs)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 4))


def test_traced_forward_equals_the_model_and_draws_every_phase():
    model = _model()
    ref = copy.deepcopy(model)
    tl = Timeline()
    dp = TracedDataParallel(model, forward, CPU2, timeline=tl)
    x, y = torch.randn(10, 6), torch.randint(0, 4, (10,))
    torch.testing.assert_close(dp(x), ref(x))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    assert traced_step(dp, x, y, nn.CrossEntropyLoss(), opt, timeline=tl) == pytest.approx(
        traced_step(ref, x, y, nn.CrossEntropyLoss(), ref_opt), rel=1e-5)
    assert tl.lanes == ["cpu (replica 0)", "cpu (replica 1)"]
    assert {s[1] for s in tl.spans} == {"scatter+replicate", "forward", "gather", "loss+backward", "optimizer"}
    assert sum(s[1] == "forward" for s in tl.spans) == 4  # 2 forwards x 2 replicas


def test_without_a_timeline_it_only_calls_the_forward_and_deep_copies_work():
    x = torch.randn(4, 6)
    model = _model()
    torch.testing.assert_close(TracedDataParallel(model, forward, CPU2)(x), model(x))
    tl = Timeline()
    out = TracedDataParallel(model, deep_forward, CPU2, timeline=tl)(x)
    torch.testing.assert_close(out, model(x))
    assert sum(s[1] == "forward" for s in tl.spans) == 2
