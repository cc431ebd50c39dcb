"""The timestamps of a pipeline schedule's actions, recorded in the ranks that run it (lesson 12).

:func:`record_actions` wraps this rank's ``PipelineStage`` objects while a
``torch.distributed.pipelining`` schedule runs: each forward, backward,
input-gradient and weight-gradient of a micro-batch becomes a span of the
rank's lane in one :class:`~mgpu_lab.parallel.timeline.Timeline`, labelled
``F3/s1`` (forward, micro-batch 3, stage 1), ``B``, ``I``, ``W``; the time spent
waiting for messages (torch's ``_wait_batch_p2p``) becomes ``wait`` spans.
Spans are timed with ``time.perf_counter``, one clock for every process of a
machine, so the lanes of all ranks line up. :func:`in_flight` reads from the
spans how many micro-batches had live activations at once, :func:`compute_bubble`
the idle fraction with the waits counted as idle.

Example:
    >>> spans = [("rank 0", "F0/s0", 0, 1), ("rank 0", "F1/s0", 1, 2), ("rank 0", "B0/s0", 3, 5),
    ...          ("rank 0", "wait", 2, 3), ("rank 0", "B1/s0", 5, 7)]
    >>> in_flight(spans), round(compute_bubble(spans), 3)
    ({'rank 0': 2}, 0.143)
"""
from __future__ import annotations

from contextlib import contextmanager

from mgpu_lab.parallel.timeline import Timeline

__all__ = ["record_actions", "in_flight", "compute_bubble", "parse"]


def parse(label: str) -> tuple[str, int, int] | None:
    """``"F3/s1"`` -> ``("F", 3, 1)``; None for a label that is no action (``wait``)."""
    action = Timeline._action(label)
    return None if action[0] is None else action


@contextmanager
def record_actions(stages, lane: str, timeline: Timeline | None = None):
    """Inside the block, time every action of ``stages`` (this rank's ``PipelineStage`` objects).

    Yields the :class:`Timeline` the spans go to (``timeline`` or a new one).
    """
    from torch.distributed.pipelining import schedules

    tl = timeline if timeline is not None else Timeline()
    tl.add_lane(lane)
    patched = []

    def wrap(stage, method, label_of):
        own = getattr(stage, method)

        def timed(*args, **kwargs):
            with tl.span(lane, label_of(*args, **kwargs)):
                return own(*args, **kwargs)

        setattr(stage, method, timed)
        patched.append((stage, method))

    for stage in stages:
        k = stage.stage_index
        wrap(stage, "forward_one_chunk", lambda mb, *a, k=k, **kw: f"F{mb}/s{k}")
        wrap(stage, "backward_one_chunk",
             lambda mb, *a, k=k, full_backward=True, **kw: f"{'B' if full_backward else 'I'}{mb}/s{k}")
        wrap(stage, "backward_weight_one_chunk", lambda mb, *a, k=k, **kw: f"W{mb}/s{k}")
    own_wait = schedules._wait_batch_p2p

    def waited(work):
        with tl.span(lane, "wait"):
            return own_wait(work)

    schedules._wait_batch_p2p = waited
    try:
        yield tl
    finally:
        schedules._wait_batch_p2p = own_wait
        for stage, method in patched:
            delattr(stage, method)  # the class's method again


def in_flight(spans) -> dict[str, int]:
    """Per lane, the most micro-batches whose activations were alive at once.

    A micro-batch's activations on a stage live from the start of its forward
    to the end of its last backward action there (``B``, or ``W`` when backward
    is split, since the weight gradient needs the layer inputs).
    """
    events: dict[str, list] = {}
    last: dict = {}
    for lane, label, start, end in spans:
        action = parse(label)
        if action is None:
            continue
        kind, mb, stage = action
        if kind == "F":
            events.setdefault(lane, []).append((start, 1))
        else:
            last[lane, mb, stage] = max(last.get((lane, mb, stage), end), end)
    for (lane, _, _), end in last.items():
        events.setdefault(lane, []).append((end, -1))
    out = {}
    for lane, evs in events.items():
        alive = peak = 0
        for _, delta in sorted(evs, key=lambda e: (e[0], e[1])):
            alive += delta
            peak = max(peak, alive)
        out[lane] = peak
    return out


def compute_bubble(spans) -> float:
    """The idle fraction of the lanes from the first action's start to the last action's end, counting
    only the actions (F, B, I, W) as busy: waits for messages are idle."""
    actions = [s for s in spans if parse(s[1])]
    if not actions:
        return 0.0
    lanes = {s[0] for s in spans}
    span = max(s[3] for s in actions) - min(s[2] for s in actions)
    busy = sum(end - start for _, _, start, end in actions)
    return 0.0 if span == 0 else 1.0 - busy / (len(lanes) * span)
