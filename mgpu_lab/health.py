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
    >>> if all_finite(loss):          # the same answer on every rank
    ...     optimizer.step()
    >>> ok, spread = weights_in_sync(model)
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
        >>> ok, spread = weights_in_sync(ddp_model)   # every 100 steps, say
    """
    c = weights_checksum(model)
    both = torch.cat([c, -c])
    device = next(getattr(model, "module", model).parameters()).device
    both = both.to(_comm_device(torch.empty(0, device=device)))
    tdist.all_reduce(both, op=tdist.ReduceOp.MAX)
    both = both.cpu()
    spread = float((both[:2] + both[2:]).abs().max())
    return spread <= atol, spread
