"""Errors that are not hangs: a NaN on one rank, and ranks whose weights have silently drifted apart.

DDP keeps the replicas identical only as long as every rank applies the same
averaged gradient to the same weights. A NaN in one rank's loss becomes a NaN
in everyone's gradient at the all-reduce; a rank that changes its weights
outside DDP (a rank-dependent update, a buffer DDP does not sync, a
non-deterministic kernel) drifts away without any error. Both checks here
cost one tiny all-reduce:

- :func:`all_finite` tells every rank whether *any* rank's value is NaN or
  infinite, so all of them can skip the step together;
- :func:`weights_in_sync` compares a checksum of the weights across the ranks.

Example:
    >>> from mgpu_lab import launch
    >>> def step():                   # in every rank; rank 1's loss is NaN
    ...     loss = torch.tensor(float("nan") if torch.distributed.get_rank() == 1 else 1.0)
    ...     torch.manual_seed(0)
    ...     return all_finite(loss), weights_in_sync(nn.Linear(2, 1))[0]
    >>> launch(step, 2)               # the same answer on every rank: skip the step together
    launch: 2 ranks · ...
    [(False, True), (False, True)]
"""
from __future__ import annotations

import torch
import torch.distributed as tdist
from torch import nn

__all__ = ["all_finite", "weights_checksum", "weights_in_sync"]


def _comm_device(t: torch.Tensor) -> torch.device:
    # NCCL reduces CUDA tensors only; gloo is happy with CPU ones.
    return t.device if tdist.get_backend() == "nccl" else torch.device("cpu")


def all_finite(value: torch.Tensor) -> bool:
    """True on every rank when no rank's ``value`` holds a NaN or an infinity.

    One all-reduce (MIN) of a 0/1 flag: a rank that skipped its step alone
    would leave the replicas different, so the decision must be the same everywhere.
    """
    ok = torch.isfinite(value.detach()).all().to(torch.float32).reshape(1)
    ok = ok.to(_comm_device(value))
    tdist.all_reduce(ok, op=tdist.ReduceOp.MIN)
    return bool(ok.item() == 1.0)


def weights_checksum(model: nn.Module) -> torch.Tensor:
    """``[sum, sum of squares]`` of every parameter and buffer, in float64: two numbers per rank."""
    inner = getattr(model, "module", model)
    total = torch.zeros(2, dtype=torch.float64)
    for t in [*inner.parameters(), *inner.buffers()]:
        if t.is_floating_point():
            d = t.detach().to(torch.float64)
            total += torch.stack([d.sum(), d.square().sum()]).cpu()
    return total


def weights_in_sync(model: nn.Module, atol: float = 0.0) -> tuple[bool, float]:
    """Whether every rank holds the same weights, by comparing :func:`weights_checksum` across ranks.

    One all-reduce (MAX) of ``[checksum, -checksum]`` gives the largest and the
    smallest checksum at once; identical replicas give identical checksums
    (the same floats summed in the same order), so ``atol=0`` is exact.

    Returns:
        ``(in_sync, spread)``: the spread is the largest difference between two ranks' checksums.

    Example:
        >>> from mgpu_lab import launch
        >>> def drifted():          # rank 1's weight differs by 0.5
        ...     model = nn.Linear(1, 1, bias=False)
        ...     torch.nn.init.constant_(model.weight, 1.0 + 0.5 * torch.distributed.get_rank())
        ...     return weights_in_sync(model)
        >>> launch(drifted, 2)      # every 100 steps, say: the sums of squares differ by 1.5² - 1² = 1.25
        launch: 2 ranks · ...
        [(False, 1.25), (False, 1.25)]
    """
    c = weights_checksum(model)
    both = torch.cat([c, -c])
    device = next(getattr(model, "module", model).parameters()).device
    both = both.to(_comm_device(torch.empty(0, device=device)))
    tdist.all_reduce(both, op=tdist.ReduceOp.MAX)
    both = both.cpu()
    spread = float((both[:2] + both[2:]).abs().max())
    return spread <= atol, spread
