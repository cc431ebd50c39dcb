"""A toy classification batch and its one-process gradients: what the model-parallel and pipeline tests compare
their ranks' results with (tests/parallel/test_model_parallel.py, tests/pipelining/test_gpipe.py)."""
from __future__ import annotations

import copy

import torch
from torch import nn


def toy_data(batch=12, features=8, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, features, generator=g), torch.randint(0, classes, (batch,), generator=g)


def full_batch_grads(model, x, y, loss_fn=nn.CrossEntropyLoss()):
    """The loss and every parameter's gradient of one process on the whole batch (``model`` is left untouched)."""
    model = copy.deepcopy(model)
    loss = loss_fn(model(x), y)
    loss.backward()
    return float(loss.detach()), [p.grad for p in model.parameters()]


def all_close(a, b):
    return len(a) == len(b) and all(torch.allclose(g, r, atol=1e-6, rtol=1e-4) for g, r in zip(a, b))
