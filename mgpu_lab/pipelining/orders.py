"""Each pipeline schedule's order of actions per rank, and the schedule replayed from action times (lesson 12).

:func:`orders` gives every rank's actions under GPipe, 1F1B,
interleaved 1F1B and ZBV as labels ``F3/s1`` (forward of micro-batch 3 on
stage 1), ``B`` (whole backward), ``I`` (input gradient), ``W`` (weight
gradient); interleaved and ZBV orders are torch's own, read from a built
schedule's ``pipeline_order`` (:func:`~mgpu_lab.pipelining.torch_orders.torch_orders`),
so the drawing is what ``step()`` runs.
:func:`simulate` replays the orders with fixed times per action and returns a
:class:`~mgpu_lab.parallel.timeline.Timeline`, with a message naming the first
actions that wait for each other when an order cannot finish.

Example:
    >>> orders("1f1b", 3, 4)[0]
    ['F0/s0', 'F1/s0', 'F2/s0', 'B0/s0', 'F3/s0', 'B1/s0', 'B2/s0', 'B3/s0']
    >>> round(simulate(orders("gpipe", 4, 8), {"F": 1.0, "B": 2.0}).idle_fraction(), 4)
    0.2727
"""
from __future__ import annotations


from mgpu_lab.parallel.timeline import Timeline
from mgpu_lab.pipelining.record import parse

__all__ = ["orders", "needs", "simulate", "formula", "stage_of_rank"]


def stage_of_rank(schedule: str, n_ranks: int, virtual: int = 1) -> dict[int, int]:
    """Stage -> rank: one stage per rank, ``virtual`` in a loop (interleaved) or two in a V (ZBV)."""
    n = n_ranks * (2 if schedule == "zbv" else virtual if schedule == "interleaved" else 1)
    if schedule == "zbv":
        return {s: s if s < n_ranks else n - 1 - s for s in range(n)}
    return {s: s % n_ranks for s in range(n)}


def orders(schedule: str, n_ranks: int, n_micro: int, virtual: int = 1) -> dict[int, list[str]]:
    """Every rank's compute actions, in the order it runs them.

    Under 1F1B rank ``r`` warms up with ``n_ranks - r - 1`` forwards (fewer when there are fewer
    micro-batches), then runs one forward and one backward in turn, then the backwards left.

    Example:
        >>> orders("1f1b", 2, 3)[0]
        ['F0/s0', 'F1/s0', 'B0/s0', 'F2/s0', 'B1/s0', 'B2/s0']
        >>> orders("zbv", 2, 2)[1][:4]
        ['F0/s1', 'F0/s2', 'F1/s1', 'F1/s2']
    """
    if schedule in ("interleaved", "zbv"):
        from mgpu_lab.pipelining.torch_orders import torch_orders

        return torch_orders(schedule, n_ranks, n_micro, virtual)
    if schedule == "gpipe":
        return {r: [f"F{i}/s{r}" for i in range(n_micro)] + [f"B{i}/s{r}" for i in range(n_micro)]
                for r in range(n_ranks)}
    if schedule == "1f1b":
        out = {}
        for r in range(n_ranks):
            warm = min(n_ranks - r - 1, n_micro)
            acts = [f"F{i}" for i in range(warm)]
            for i in range(n_micro - warm):
                acts += [f"F{warm + i}", f"B{i}"]
            out[r] = [f"{a}/s{r}" for a in acts + [f"B{i}" for i in range(n_micro - warm, n_micro)]]
        return out
    raise ValueError(f"schedule={schedule!r}: pick one of 'gpipe', '1f1b', 'interleaved', 'zbv'")


def _needs(kind: str, mb: int, stage: int, last: int) -> list[tuple[str, int, int]]:
    """The actions that must have ended before this one may start."""
    if kind == "F":
        return [("F", mb, stage - 1)] if stage else []
    if kind == "W":
        return [("I", mb, stage)]
    return [("F", mb, stage)] + ([("B", mb, stage + 1)] if stage < last else [])


def needs(kind: str, mb: int, stage: int, last: int, done) -> list[tuple[str, int, int]]:
    """The actions ``(kind, mb, stage)`` that must have ended before this one; ``done`` holds the actions that
    ended (a split backward's ``I`` is the backward the previous stage waits for)."""
    out = _needs(kind, mb, stage, last)
    return [("I", m, s) if k == "B" and ("B", m, s) not in done and ("I", m, s) in done else (k, m, s)
            for k, m, s in out]


def simulate(per_rank: dict, durations: dict, transfer: float = 0.0) -> Timeline:
    """Replay every rank's actions (labels) with ``durations`` (``{"F": s, "B": s, "I": s, "W": s}``; a key
    ``(kind, stage)`` gives one stage its own time); ``transfer``: seconds a message takes between ranks.

    A rank runs its actions in order, each once the rank is free and the actions it
    needs have ended (an ``I`` counts as the backward the previous stage waits for).

    Raises:
        RuntimeError: the orders deadlock; the message names each stuck rank's next action and what it waits for.
    """
    todo = {r: [parse(a) + (a,) for a in acts] for r, acts in per_rank.items()}
    last = max((s for acts in todo.values() for *_, s, _ in acts), default=0)
    ended: dict = {}
    where = {(k, m, s): r for r, acts in todo.items() for k, m, s, _ in acts}
    free = {r: 0.0 for r in todo}
    tl = Timeline()
    for r in todo:
        tl.add_lane(f"rank {r}")
    while any(todo.values()):
        moved = False
        for r, acts in todo.items():
            while acts:
                kind, mb, stage, label = acts[0]
                need = needs(kind, mb, stage, last, ended)
                if any(n not in ended for n in need):
                    break
                start = max([free[r]] + [ended[n] + (transfer if where.get(n) != r else 0.0) for n in need])
                free[r] = ended[kind, mb, stage] = start + durations.get((kind, stage), durations.get(kind, 0.0))
                tl.add(f"rank {r}", label, start, free[r])
                acts.pop(0)
                moved = True
        if not moved:
            stuck = {r: acts[0][3] for r, acts in todo.items() if acts}
            raise RuntimeError(f"the orders deadlock: each rank's next action waits for one that never comes: "
                               f"{stuck}")
    return tl


def formula(schedule: str, n_stages: int, n_micro: int, virtual: int = 1) -> float:
    """The closed forms for equal times: ``(p-1)/(m+p-1)``; interleaved ``(p-1)/(v*m+p-1)``."""
    v = virtual if schedule == "interleaved" else 1
    return (n_stages - 1) / (v * n_micro + n_stages - 1)
