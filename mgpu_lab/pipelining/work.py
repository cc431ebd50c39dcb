"""Layers that do fixed work: a set sleep in forward, in input-gradient and in weight-gradient (lesson 12).

On a machine whose ranks share two cores, the time a matrix product takes
depends on what the other ranks do at that moment, and the shape of a
pipeline schedule drowns in that noise. A :class:`Work` layer is a real linear
layer (its gradients are exact) that also *sleeps* a set time: ``t_f`` in
forward, ``t_b`` in the backward towards its input and ``t_w`` in the backward
towards its weight. A sleeping rank uses no core, so its timing depends far
less on how many share the machine (a busy machine still wakes a sleeping rank
late now and then), and a schedule's drawing shows its shape. Timelines made with these layers are *simulated work, really
scheduled*: the waits between ranks are real, the compute is not.

Where a schedule splits backward (zero-bubble), ``t_b`` is spent in the
input-gradient step and ``t_w`` in the weight-gradient step; otherwise one
backward spends both.

Example:
    >>> import torch, time
    >>> layer = Work(4, t_f=0.01, t_b=0.02)
    >>> start = time.perf_counter(); y = layer(torch.randn(3, 4, requires_grad=True)); y.sum().backward()
    >>> time.perf_counter() - start >= 0.03
    True
    >>> work_model(4, 8).__class__.__name__, len(work_model(4, 8))
    ('Sequential', 4)
"""
from __future__ import annotations

import time

import torch
from torch import nn

__all__ = ["Work", "work_model"]


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in forward and ``backward_s`` when its gradient passes."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        if forward_s > 0:
            time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()  # not a view: the zero-bubble backward detaches stage outputs in place

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_s > 0:
            time.sleep(ctx.backward_s)
        return grad, None, None


class Work(nn.Module):
    """A ``nn.Linear(width, width)`` followed by tanh that sleeps set times (seconds).

    Args:
        width: features in and out.
        t_f: seconds slept in forward.
        t_b: seconds slept in the backward towards the input (the activations' gradient).
        t_w: seconds slept in the backward towards the weight.
    """

    def __init__(self, width: int, t_f: float = 0.0, t_b: float = 0.0, t_w: float = 0.0):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.t_f, self.t_b, self.t_w = float(t_f), float(t_b), float(t_w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _Sleep.apply(self.linear.weight, 0.0, self.t_w) if self.t_w else self.linear.weight
        out = torch.tanh(nn.functional.linear(x, weight, self.linear.bias))
        return _Sleep.apply(out, self.t_f, self.t_b) if (self.t_f or self.t_b) else out

    def extra_repr(self) -> str:
        return f"t_f={self.t_f}, t_b={self.t_b}, t_w={self.t_w}"


def work_model(n_layers: int, width: int, t_f: float = 0.0, t_b: float = 0.0, t_w: float = 0.0,
               seed: int = 0) -> nn.Sequential:
    """``n_layers`` :class:`Work` layers in a ``nn.Sequential``, the same weights for the same ``seed``.

    Each layer sleeps the given times, so a stage of ``k`` layers does ``k`` times that work.
    """
    if n_layers < 1 or width < 1:
        raise ValueError(f"n_layers={n_layers} and width={width} must be >= 1")
    torch.manual_seed(seed)
    return nn.Sequential(*(Work(width, t_f, t_b, t_w) for _ in range(n_layers)))
