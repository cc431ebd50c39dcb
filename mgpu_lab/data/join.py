"""Ranks with unequal numbers of batches: DDP's ``Join`` (lesson 05).

:func:`train_with_join` trains a DDP model on a rank's own list of batches, however many,
under torch's ``Join`` context: a rank out of data shadows the others' collectives.

Example:
    >>> from mgpu_lab import launch
    >>> def uneven(batches_per_rank):
    ...     import torch.distributed as tdist
    ...     from torch.nn.parallel import DistributedDataParallel as DDP
    ...     torch.manual_seed(0)
    ...     model = DDP(torch.nn.Linear(4, 1))
    ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ...     batch = (torch.randn(2, 4), torch.randn(2, 1))
    ...     return train_with_join(model, [batch] * batches_per_rank[tdist.get_rank()], optimizer)
    >>> launch(uneven, 2, [3, 5])   # without Join, rank 1's 4th step would wait for rank 0 for ever
    launch: 2 ranks · ...
    [3, 5]
"""
from __future__ import annotations

import torch

__all__ = ["train_with_join"]


def train_with_join(model, batches, optimizer, loss_fn=None) -> int:
    """Train a DDP model on this rank's batches under ``Join``: ranks with different counts all finish.

    A rank that runs out of
    batches joins and shadows the others' gradient all-reduces (contributing
    zeros) until every rank has joined; gradients stay averaged over the
    initial world size, and every rank ends with the same model.

    Args:
        model: a ``DistributedDataParallel`` model.
        batches: this rank's ``(x, y)`` batches; other ranks may have more or fewer.
        optimizer: the optimizer of the model's parameters.
        loss_fn: default ``torch.nn.functional.mse_loss``.

    Returns:
        The number of optimizer steps this rank took.
    """
    from torch.distributed.algorithms.join import Join

    loss_fn = loss_fn or torch.nn.functional.mse_loss
    steps = 0
    with Join([model]):
        for x, y in batches:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            steps += 1
    return steps
