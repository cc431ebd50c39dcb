"""Tensor parallelism by hand: the MLP split over TP ranks with a pair of conjugate autograd operators.

The reference of lesson 11's first exercise (``11.tp_mlp``): the lesson's notebook does
not import this module, and its check names these as answers an exercise must not call.

A column-parallel ``fc1`` (each rank holds ``hidden / tp`` of its output rows) needs the whole
input and gives a slice of the hidden activation; GELU acts element by element, so it runs
on the slice; a row-parallel ``fc2`` (each rank the matching ``hidden / tp`` input columns)
gives a partial sum of the output, and one all-reduce completes it. Autograd must see the
conjugates: :class:`CopyToTP` (identity forward, all-reduce backward: every rank's slice
contributed to ``x``'s gradient) and :class:`ReduceFromTP` (all-reduce forward, identity
backward: the output's gradient is the same on every rank already).

Example:
    >>> from mgpu_lab import launch
    >>> def in_a_rank():
    ...     rank, tp = tdist.get_rank(), tdist.get_world_size()
    ...     torch.manual_seed(0)
    ...     w1, b1, w2, b2 = torch.randn(8, 4), torch.randn(8), torch.randn(4, 8), torch.randn(4)
    ...     x = torch.randn(3, 4)
    ...     out = tp_mlp(x, w1.chunk(tp)[rank], b1.chunk(tp)[rank], w2.chunk(tp, dim=1)[rank], b2)
    ...     return torch.allclose(out, F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2), atol=1e-5)
    >>> launch(in_a_rank, 2)
    launch: 2 ranks · ...
    [True, True]
"""
from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F

__all__ = ["CopyToTP", "ReduceFromTP", "tp_mlp"]


class CopyToTP(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the TP group (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        tdist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (the partial sums of a row-parallel layer); identity backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, x, group=None):
        out = x.clone()
        tdist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def tp_mlp(x, w1_shard, b1_shard, w2_shard, b2, group=None):
    """``fc2(gelu(fc1(x)))`` with ``fc1`` split by output rows and ``fc2`` by input columns over the TP ranks.

    Args:
        x: the whole input ``[..., d]``, the same on every rank.
        w1_shard, b1_shard: this rank's ``[hidden / tp, d]`` rows of ``fc1``'s weight and its bias slice.
        w2_shard: this rank's ``[d, hidden / tp]`` columns of ``fc2``'s weight.
        b2: ``fc2``'s whole bias, added once, after the sum.
        group: the TP process group (default: every rank).
    """
    h = F.gelu(F.linear(CopyToTP.apply(x, group), w1_shard, b1_shard))
    return ReduceFromTP.apply(F.linear(h, w2_shard), group) + b2
