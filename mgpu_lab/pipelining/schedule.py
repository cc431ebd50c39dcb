"""GPipe's schedule replayed from stage times, a transfer time and an overhead (lesson 06).

:func:`mgpu_lab.parallel.model_parallel.ideal_timeline`
draws it for equal stages, and :func:`mgpu_lab.pipelining.gpipe.fit_bubble` replays a measured step.
"""
from __future__ import annotations

from mgpu_lab.parallel.timeline import Timeline

__all__ = ["gpipe_schedule"]


def gpipe_schedule(forward, backward, n_micro: int, transfer: float = 0.0, overhead: float = 0.0,
                   lanes=None) -> Timeline:
    """GPipe's schedule with the given durations: every forward, then every backward, in micro-batch order.

    A stage starts a micro-batch once it has finished its previous span (plus
    ``overhead``, the host's work between two spans) and once the stage it
    depends on has finished that micro-batch (plus ``transfer``, the time the
    activations, or in backward the gradients, take to arrive).

    Args:
        forward, backward: seconds of one micro-batch's forward and backward on each stage.
        n_micro: micro-batches per step.
        transfer: seconds from the end of a span to the start of the span of the
            next stage (forward) or previous stage (backward) that needs its result.
        overhead: seconds between two consecutive spans of one stage.
        lanes: the stages' lane names (default ``"stage 1"``, ``"stage 2"``, ...).

    Returns:
        A :class:`Timeline`, spans labelled ``F{i}``/``B{i}``, starting at 0. With
        equal stages and ``transfer = overhead = 0`` its idle fraction is
        ``(p - 1) / (m + p - 1)``, GPipe's formula.

    Example:
        >>> round(gpipe_schedule([1, 1], [2, 2], 4).idle_fraction(), 6)
        0.2
    """
    forward, backward = [float(v) for v in forward], [float(v) for v in backward]
    p, m = len(forward), int(n_micro)
    if p < 1 or len(backward) != p or m < 1:
        raise ValueError(f"forward and backward need one duration per stage (got {len(forward)} and "
                         f"{len(backward)}) and n_micro={n_micro!r} must be >= 1")
    lanes = list(lanes) if lanes is not None else [f"stage {s + 1}" for s in range(p)]
    tl, free = Timeline(), [None] * p  # free[s]: when stage s ended its last span
    ends = {}
    for phase, order, durations in (("F", range(p), forward), ("B", range(p - 1, -1, -1), backward)):
        for i in range(m):
            for s in order:
                ready = 0.0 if free[s] is None else free[s] + overhead
                before = s - 1 if phase == "F" else s + 1
                if (phase, before, i) in ends:
                    ready = max(ready, ends[phase, before, i] + transfer)
                ends[phase, s, i] = free[s] = ready + durations[s]
                tl.add(lanes[s], f"{phase}{i}", ready, free[s])
    return tl
