"""Lesson 06's reference answers, which its notebook does not import: the exercises are the learner's.

:func:`stage_step` is one training step of one pipeline stage in its own rank
(activations sent forward, their gradient received back); :func:`pipelined_step` is
GPipe's micro-batched step on one process, :func:`timed_step` the same with every stage's
work timed; :func:`bubble_fraction` is the idle fraction of GPipe's schedule
(:func:`mgpu_lab.parallel.schedule.gpipe_schedule`) in closed form, :func:`fit_bubble` that
of a measured step's fit. Scripts and later lessons may import them.

Example:
    >>> s1, s2 = nn.Linear(4, 8), nn.Linear(8, 1)
    >>> x, y = torch.randn(10, 4), torch.randn(10, 1)
    >>> loss = pipelined_step(s1, s2, x, y, nn.MSELoss(), 4)  # chunks of 3, 3, 3, 1
    >>> round(bubble_fraction([1.0, 1.0], [2.0, 2.0], 4), 3)
    0.2
"""
from __future__ import annotations

import torch
import torch.distributed as tdist
from torch import nn

from mgpu_lab.parallel.model_parallel import _device_of, _positive_int
from mgpu_lab.parallel.schedule import gpipe_schedule
from mgpu_lab.parallel.timeline import Timeline

__all__ = ["stage_step", "pipelined_step", "timed_step", "bubble_fraction", "fit_bubble"]


def pipelined_step(stage1: nn.Module, stage2: nn.Module, x: torch.Tensor, y: torch.Tensor,
                   loss_fn, n_micro: int) -> float:
    """Forward and backward of one batch as ``torch.chunk(x, n_micro)`` micro-batches (GPipe order).

    Every forward runs first, then one backward. Each micro-batch's (mean)
    loss is weighted by its share of the batch, ``len(chunk) / len(x)``, which
    is ``1 / n_micro`` when the chunks are equal: the gradients added to
    ``.grad`` are then those of the mean loss over the whole batch, as if it
    ran in one piece. The caller zeroes the gradients before, and steps after.

    Returns:
        The mean loss over the batch, as a float.

    Example:
        >>> s1, s2 = nn.Linear(4, 8), nn.Linear(8, 1)
        >>> x, y = torch.randn(10, 4), torch.randn(10, 1)
        >>> loss = pipelined_step(s1, s2, x, y, nn.MSELoss(), 4)  # chunks of 3, 3, 3, 1
    """
    _positive_int("n_micro", n_micro)
    dev1, dev2 = _device_of(stage1), _device_of(stage2)
    total = 0.0
    for xs, ys in zip(torch.chunk(x, n_micro), torch.chunk(y, n_micro)):
        out = stage2(stage1(xs.to(dev1)).to(dev2))
        total = total + loss_fn(out, ys.to(out.device)) * (len(xs) / len(x))
    total.backward()
    return float(total.detach())


def timed_step(stages, devices, x, y, loss_fn, n_micro: int, timeline: Timeline | None = None) -> float:
    """One GPipe step on one process (all forwards, then all backwards), each stage's work timed.

    The activations are cut from the graph at every stage boundary (detached,
    moved, ``requires_grad_``), so each stage's backward is a separate call
    that can be timed, and the gradient of the boundary is handed back by hand,
    as it is between processes. Lanes are named ``"stage s (device)"``, s = 1, 2, ...

    Returns:
        The mean loss (micro-batch losses weighted as in :func:`pipelined_step`).

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


def bubble_fraction(forward, backward, n_micro: int, transfer: float = 0.0) -> float:
    """The idle fraction of a GPipe step: stage s takes ``forward[s]`` and ``backward[s]`` per micro-batch,
    and a message between neighbouring stages arrives ``transfer`` after the span that made it ended.

    Each phase (every forward, then every backward) is a flow shop of ``n_micro`` identical jobs: one
    micro-batch crosses every stage and the ``p - 1`` transfers, and the other ``m - 1`` follow at the pace
    of the slowest stage. With equal stages and free transfers this is ``(p - 1) / (m + p - 1)``.

    Raises:
        ValueError: ``forward`` and ``backward`` of different lengths or empty; ``n_micro`` not an int >= 1.

    Example:
        >>> round(bubble_fraction([1, 1], [2, 2], 4), 4), round(bubble_fraction([1, 2], [2, 4], 4, transfer=0.5), 4)
        (0.2, 0.3571)
    """
    if len(forward) == 0 or len(forward) != len(backward):
        raise ValueError(f"forward and backward need one time per stage: got {len(forward)} and {len(backward)}")
    p, m = len(forward), _positive_int("n_micro", n_micro)
    step = sum(forward) + sum(backward) + 2 * (p - 1) * transfer + (m - 1) * (max(forward) + max(backward))
    return 1 - m * (sum(forward) + sum(backward)) / (p * step)


def fit_bubble(fit, transfer: float | None = None, overhead: float | None = None) -> float:
    """The idle fraction of GPipe's schedule replayed with a :class:`~mgpu_lab.parallel.timeline.GPipeFit`'s
    numbers; ``transfer=0, overhead=0`` leaves only the stages' own times."""
    return gpipe_schedule(fit.forward, fit.backward, fit.n_micro, fit.transfer if transfer is None else transfer,
                          fit.overhead if overhead is None else overhead, fit.lanes).idle_fraction()


def stage_step(stage, x, target, loss_fn, optimizer, act_shape) -> float | None:
    """One training step of one of two pipeline stages, each in its own rank (rank 0 first, rank 1 last).

    Rank 0 runs its stage on ``x`` and sends the activations (of shape ``act_shape``)
    to rank 1; rank 1 runs its stage on them, computes the loss against ``target``,
    runs backward and sends the activations' gradient back; rank 0 finishes its
    backward with it. Each rank then steps its optimizer.

    Returns:
        The loss as a float on rank 1, None on rank 0.
    """
    device = next(stage.parameters()).device
    optimizer.zero_grad()
    if tdist.get_rank() == 0:
        h = stage(x.to(device))
        tdist.send(h.detach().contiguous(), 1)
        grad = torch.empty_like(h)
        tdist.recv(grad, 1)
        h.backward(grad)
        optimizer.step()
        return None
    h = torch.empty(act_shape, device=device)
    tdist.recv(h, 0)
    h.requires_grad_()
    loss = loss_fn(stage(h), target.to(device))
    loss.backward()
    tdist.send(h.grad.contiguous(), 0)
    optimizer.step()
    return loss.item()
