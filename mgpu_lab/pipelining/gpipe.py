"""GPipe on one process, timed, and the bubble of a measured step.

:func:`timed_step` runs GPipe's micro-batched step on one process (every forward,
then every backward) with every stage's work timed on a
:class:`~mgpu_lab.parallel.timeline.Timeline`; :func:`fit_bubble` is the idle
fraction of GPipe's schedule (:func:`mgpu_lab.pipelining.schedule.gpipe_schedule`)
replayed with a measured step's fit. Scripts, the course's checks and later lessons
import them.

Example:
    >>> from mgpu_lab.parallel.timeline import fit_gpipe
    >>> tl = Timeline()
    >>> loss = timed_step([nn.Linear(4, 8), nn.Linear(8, 1)], ["cpu", "cpu"], torch.randn(10, 4),
    ...                   torch.randn(10, 1), nn.MSELoss(), 4, tl)   # chunks of 3, 3, 3, 1
    >>> round(fit_bubble(fit_gpipe(gpipe_schedule([1.0, 1.0], [2.0, 2.0], 4))), 3)
    0.2
"""
from __future__ import annotations

import torch
from torch import nn

from mgpu_lab.parallel.model_parallel import _positive_int
from mgpu_lab.parallel.timeline import Timeline
from mgpu_lab.pipelining.schedule import gpipe_schedule

__all__ = ["timed_step", "fit_bubble"]


def timed_step(stages, devices, x, y, loss_fn, n_micro: int, timeline: Timeline | None = None) -> float:
    """One GPipe step on one process (all forwards, then all backwards), each stage's work timed.

    The activations are cut from the graph at every stage boundary (detached,
    moved, ``requires_grad_``), so each stage's backward is a separate call
    that can be timed, and the gradient of the boundary is handed back by hand,
    as it is between processes. Lanes are named ``"stage s (device)"``, s = 1, 2, ...

    Returns:
        The mean loss over the batch: each micro-batch's loss weighted by its share of the batch,
        ``len(chunk) / len(x)``.

    Example:
        >>> tl = Timeline()
        >>> s1, s2 = nn.Linear(4, 8), nn.Linear(8, 2)
        >>> loss = timed_step([s1, s2], ["cpu", "cpu"], torch.randn(8, 4), torch.randint(0, 2, (8,)),
        ...                   nn.CrossEntropyLoss(), 2, tl)
        >>> sorted(tl.lanes)
        ['stage 1 (cpu)', 'stage 2 (cpu)']
    """
    _positive_int("n_micro", n_micro)
    if len(stages) != len(devices):
        raise ValueError(f"{len(stages)} stages but {len(devices)} devices; pass one device per stage")
    timeline = Timeline() if timeline is None else timeline
    devices = [torch.device(d) for d in devices]
    lanes = [f"stage {s} ({d})" for s, d in enumerate(devices, 1)]
    saved, losses = [], []
    for i, (xs, ys) in enumerate(zip(torch.chunk(x, n_micro), torch.chunk(y, n_micro))):
        h, ins, outs = xs, [], []
        for s, (stage, dev) in enumerate(zip(stages, devices)):
            with timeline.span(lanes[s], f"F{i}", dev):
                h_in = h.detach().to(dev).requires_grad_(s > 0)
                h = stage(h_in)
                if s == len(stages) - 1:
                    h = loss_fn(h, ys.to(dev)) * (len(xs) / len(x))
            ins.append(h_in)
            outs.append(h)
        saved.append((ins, outs))
        losses.append(h.detach())  # no float() here: on a GPU it would wait for the pipe to drain
    for i, (ins, outs) in enumerate(saved):
        grad = None
        for s in reversed(range(len(stages))):
            with timeline.span(lanes[s], f"B{i}", devices[s]):
                outs[s].backward(None if grad is None else grad.to(devices[s]))
            grad = ins[s].grad
    timeline.resolve()
    return float(sum(loss.to(losses[0].device) for loss in losses))


def fit_bubble(fit, transfer: float | None = None, overhead: float | None = None) -> float:
    """The idle fraction of GPipe's schedule replayed with a :class:`~mgpu_lab.parallel.timeline.GPipeFit`'s
    numbers; ``transfer=0, overhead=0`` leaves only the stages' own times."""
    return gpipe_schedule(fit.forward, fit.backward, fit.n_micro, fit.transfer if transfer is None else transfer,
                          fit.overhead if overhead is None else overhead, fit.lanes).idle_fraction()
