"""Lesson 12's verdicts, in words: replayed 1F1B orders, bubbles against the replayed schedules, a pipeline run.

The references a value is judged against are :func:`reference_bubble` (every schedule's
order from :mod:`mgpu_lab.pipelining.orders`, replayed with the given times) and
:func:`.ranks.schedule_reference` (one process over the whole batch); each judge names the
known wrong answer a value matches when it recognises one. The orders a pipeline run is
judged on are the named schedules' (:func:`schedule_actions`) and random ones that respect
the dependencies (:func:`random_actions`).
"""
from __future__ import annotations

import torch

from mgpu_lab.pipelining.orders import orders as schedule_orders, simulate

from ..sim.outcome import in_words
from .ranks import order_problem


# -- one_f_one_b ---------------------------------------------------------------------
def replay_problem(per_rank: list, what: str) -> str:
    """Why a replayed scenario did not run to the end ('' when it did); ``per_rank``: each rank's evidence."""
    first = per_rank[0]
    if first.get("problem"):
        return first["problem"]
    stuck = first.get("stuck_all")
    if stuck:
        where = "; ".join(f"rank {r} {s}" for r, s in enumerate(stuck) if s)
        return f"{what}: deadlock, found in bounded time: {where}"
    return ""


def in_flight_problem(per_rank: list, n_stages: int, n_micro: int) -> str:
    """The first rank with more micro-batches alive at once than 1F1B allows ('' if none)."""
    for rank, ev in enumerate(per_rank):
        bound = min(n_stages - rank, n_micro)
        if ev.get("peak", 0) > bound:
            return (f"rank {rank} had {ev['peak']} micro-batches alive at once (forwarded, not yet backwarded) "
                    f"where 1F1B keeps at most {bound}")
    return ""


def bubble_problem_of_orders(orders: dict, n_stages: int, n_micro: int) -> str:
    """'' when the orders, replayed with equal times, idle as GPipe does ((p-1)/(m+p-1)); else what idles."""
    labelled = {r: [f"{a}/s{r}" for a in order] for r, order in orders.items()}
    try:
        idle = simulate(labelled, {"F": 1.0, "B": 1.0}).idle_fraction()
    except RuntimeError as exc:
        return f"{n_stages} stages, {n_micro} micro-batches: {exc}"
    want = (n_stages - 1) / (n_micro + n_stages - 1)
    if idle > want + 1e-9:
        return (f"{n_stages} stages, {n_micro} micro-batches, replayed with equal times: the ranks are idle "
                f"{idle:.1%} of the step, 1F1B's (and GPipe's) bubble is {want:.1%}")
    return ""


def orders_problem(orders: dict, n_stages: int, n_micro: int) -> str:
    """For orders judged without ranks: well formed, neighbours agree on message order, no deadlock, in-flight bound."""
    for rank, order in orders.items():
        problem = order_problem(order, rank, n_micro)
        if problem:
            return problem
    for rank in range(n_stages - 1):
        for kind in "FB":
            mine = [a for a in orders[rank] if a[0] == kind]
            theirs = [a for a in orders[rank + 1] if a[0] == kind]
            if mine != theirs:
                return (f"{n_stages} stages, {n_micro} micro-batches: rank {rank} and rank {rank + 1} pass the "
                        f"{'activations' if kind == 'F' else 'gradients'} in different orders ({mine} vs {theirs})")
    labelled = {r: [f"{a}/s{r}" for a in order] for r, order in orders.items()}
    try:
        simulate(labelled, {"F": 1.0, "B": 1.0})
    except RuntimeError as exc:
        return f"{n_stages} stages, {n_micro} micro-batches: {exc}"
    problem = bubble_problem_of_orders(orders, n_stages, n_micro)
    if problem:
        return problem
    for rank, order in orders.items():
        alive = peak = 0
        for a in order:
            alive += 1 if a[0] == "F" else -1
            peak = max(peak, alive)
        if peak > min(n_stages - rank, n_micro):
            return (f"{n_stages} stages, {n_micro} micro-batches: rank {rank} has {peak} micro-batches alive at "
                    f"once, more than {min(n_stages - rank, n_micro)}")
    return ""


ORDER_HINT = ("a deadlock: each rank above waits in a receive whose message the other rank sends only after an "
              "action it cannot reach yet; follow one micro-batch from the first rank to the last and back, and "
              "check that every rank's order lets its neighbours' sends happen before it needs them")


# -- bubble ----------------------------------------------------------------------------
def reference_bubble(schedule: str, n_stages: int, n_micro: int, t_f: float, t_b: float, t_w: float = 0.0,
                     virtual: int = 1) -> float:
    """The idle fraction of ``schedule`` on ``n_stages`` ranks with these per-stage, per-micro-batch times.

    Schedules that do not split backward (all but ZBV) run ``t_b + t_w`` as one backward.

    Example:
        >>> round(reference_bubble("gpipe", 4, 8, 1.0, 2.0), 4), round(reference_bubble("interleaved", 4, 8, 1.0,
        ...                                                                              2.0, virtual=2), 4)
        (0.2727, 0.1579)
    """
    split = schedule == "zbv"
    times = {"F": t_f, "B": t_b + t_w, "I": t_b if split else t_b + t_w, "W": t_w}
    return simulate(schedule_orders(schedule, n_stages, n_micro, virtual), times).idle_fraction()


def _known_wrong(args: tuple) -> list[tuple[str, float]]:
    """Known wrong answers for ``args``, the schedule's own first (with equal times several coincide)."""
    schedule, p, m, t_f, t_b, t_w, v = args
    out = []
    if schedule == "interleaved":
        out.append(("interleaved's closed formula (p-1)/(v*m+p-1), which holds only when the micro-batches fill "
                    "whole rounds of p", (p - 1) / (v * m + p - 1)))
    if schedule == "zbv":
        out.append(("ZBV run as 1F1B: the weight gradients fill the bubble only where they run apart from the "
                    "input gradients, in ZBV's own order", reference_bubble("1f1b", p, m, t_f, t_b, t_w)))
        out.append(("ZBV with the weight gradient inside the input gradient (backward not split)",
                    reference_bubble("zbv", p, m, t_f, t_b + t_w, 0.0, 2)))
    return out + [("the closed formula (p-1)/(m+p-1), whatever the schedule", (p - 1) / (m + p - 1))]


def bubble_problem(args: tuple, got: tuple) -> tuple[str, str, str] | None:
    """``(hint, expected, got)`` when the learner's value for ``args`` is wrong, else None."""
    want = reference_bubble(*args)
    name = f"bubble{args[:3] + args[3:6] + (args[6],)}"
    expected = f"{name} = {want:.4f}"
    if got[0] == "raised":
        return f"{name} raised: the schedule exists and must give its idle fraction", expected, in_words(got, "")
    value = got[1]
    if not isinstance(value, float):
        return f"{name} must return a float, the idle fraction", expected, repr(value)
    if abs(value - want) <= 1e-6 + 1e-6 * abs(want):
        return None
    if abs(value - 100 * want) <= 1e-4:
        return f"{name}: a fraction between 0 and 1 is asked, not a percentage", expected, f"{value}"
    for words, wrong in _known_wrong(args):
        if abs(value - wrong) <= 1e-6:
            return (f"yours matches {words}: replay the schedule's actions in its order, each rank waiting for the "
                    f"action it needs", expected, f"{value:.4f}")
    return ("the idle time of every rank over (ranks x the step's length), with each rank running its actions in "
            "the schedule's order as soon as what they need has ended", expected, f"{value:.4f}")


# -- run_schedule ----------------------------------------------------------------------
def placements(n_ranks: int) -> dict[str, list[int]]:
    """Stage -> rank for one stage per rank, two in a loop (interleaved) and two in a V.

    Example:
        >>> placements(2)
        {'one': [0, 1], 'loop': [0, 1, 0, 1], 'v': [0, 1, 1, 0]}
    """
    return {"one": list(range(n_ranks)), "loop": [s % n_ranks for s in range(2 * n_ranks)],
            "v": [s if s < n_ranks else 2 * n_ranks - 1 - s for s in range(2 * n_ranks)]}


def schedule_actions(schedule: str, n_ranks: int, n_micro: int) -> dict[int, list[tuple]]:
    """Each rank's ``("F", stage, micro-batch)`` / ``("B", ...)`` under a named schedule (ZBV's input gradient as
    the backward, its weight gradient dropped)."""
    from mgpu_lab.pipelining.record import parse

    out = {}
    for rank, labels in schedule_orders(schedule, n_ranks, n_micro, 2 if schedule == "interleaved" else 1).items():
        acts = [parse(label) for label in labels]
        out[rank] = [("F" if kind == "F" else "B", stage, i) for kind, i, stage in acts if kind != "W"]
    return out


def _needs(kind: str, s: int, i: int, last: int) -> list[tuple]:
    if kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    return [("F", s, i)] + ([("B", s + 1, i)] if s < last else [])


def random_actions(placement: list, n_micro: int, rng) -> dict[int, list[tuple]]:
    """A random order of every forward and backward that respects their dependencies, each rank's part of it."""
    last = len(placement) - 1
    todo = {(k, s, i) for k in "FB" for s in range(last + 1) for i in range(n_micro)}
    done, out = set(), {r: [] for r in sorted(set(placement))}
    while todo:
        ready = sorted(a for a in todo if all(n in done for n in _needs(*a, last)))
        action = ready[rng.randrange(len(ready))]
        todo.discard(action)
        done.add(action)
        out[placement[action[1]]].append(action)
    return out


def channels(placement: list, actions: dict) -> tuple[dict, dict]:
    """Per ``(from rank, to rank)``: the messages in the order the sender sends them and in the order the
    receiver needs them (``(kind, receiving stage, micro-batch)``)."""
    last, sent, needed = len(placement) - 1, {}, {}
    for rank, acts in actions.items():
        for kind, s, i in acts:
            to = s + 1 if kind == "F" else s - 1
            if 0 <= to <= last and placement[to] != rank:
                sent.setdefault((rank, placement[to]), []).append((kind, to, i))
            frm = s - 1 if kind == "F" else s + 1
            if 0 <= frm <= last and placement[frm] != rank:
                needed.setdefault((placement[frm], rank), []).append((kind, s, i))
    return sent, needed


def out_of_order(placement: list, actions: dict) -> bool:
    """Whether some receiver needs two messages of one sender in another order than they were sent."""
    sent, needed = channels(placement, actions)
    return any(sent[c] != needed.get(c) for c in sent)


def implied_peak(actions: list) -> int:
    """The most micro-batches forwarded and not yet backwarded at once in one rank's order (per stage)."""
    alive = peak = 0
    for kind, _, _ in actions:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak


def ran_problem(per_rank: list, actions: dict) -> str:
    """'' when every rank's stages ran its actions in the given order (each forward on the micro-batch the action
    names); else the first difference, in words."""
    for rank, ev in enumerate(per_rank):
        want, got = [tuple(a) for a in actions[rank]], [tuple(a) for a in ev["ran"]]
        for k, (w, g) in enumerate(zip(want, got)):
            if w != g:
                if w[0] == g[0] == "F" and w[1] == g[1]:
                    said = (f"no micro-batch's activations (what stage {g[1]} received matches none)" if g[2] < 0
                            else f"the activations of micro-batch {g[2]}")
                    return (f"rank {rank}'s action {k}, {w}, ran stage {w[1]}'s forward on {said}: the message it "
                            f"received was not the one the action needs")
                return f"rank {rank}'s action {k} is {w}, but its stages ran {g} there"
        if ev.get("wrong_grads"):
            s, i, j = ev["wrong_grads"][0]
            return (f"rank {rank}'s backward of micro-batch {i} on stage {s} started from the gradient of micro-batch "
                    f"{j}: the message it received was not the one the action needs")
        if len(got) != len(want):
            more = got[len(want):] or want[len(got):]
            return (f"rank {rank}'s stages ran {len(got)} forwards and backwards for {len(want)} actions "
                    f"({'extra' if len(got) > len(want) else 'missing'}: {more[:3]})")
    return ""


def grads_problem(per_rank: list, n_micro: int) -> tuple[str, str]:
    """``(hint, got)`` when some stage's gradients are not one process's; ``("", "")`` when all are."""
    for rank, ev in enumerate(per_rank):
        for s, verdict in sorted(ev["grads"].items()):
            if verdict == "same":
                continue
            if verdict == "times":
                return (f"the gradients are n_micro={n_micro} times one process's: the losses of the micro-batches "
                        "summed, not averaged", f"stage {s} on rank {rank}: {n_micro} x one process's gradients")
            if verdict == "over":
                return (f"the gradients are 1/n_micro of one process's: the loss divided by n_micro={n_micro} twice",
                        f"stage {s} on rank {rank}: 1/{n_micro} of one process's gradients")
            if verdict == "none":
                return ("a stage's parameters got no gradient: every backward must reach every stage",
                        f"stage {s} on rank {rank}: no gradient")
            return ("", f"stage {s} on rank {rank}: gradients differ from one process's by {verdict}")
    return "", ""


def loss_problem(per_rank: list, placement: list, n_micro: int) -> str:
    """'' when the last stage's rank returned the mean loss (a float) and every other rank None."""
    last = placement[-1]
    for rank, ev in enumerate(per_rank):
        got = ev["returned"]
        if rank != last and got[0] != "none":
            return f"rank {rank} (not the last stage's) returned {got[1] if got[0] != 'none' else None}, not None"
    got, want = per_rank[last]["returned"], per_rank[last]["ref_loss"]
    if got[0] != "float":
        return f"rank {last} (the last stage's) returned {got[1] if got[0] == 'other' else None}, not a float"
    if abs(got[1] - want) <= 1e-5 * max(1.0, abs(want)):
        return ""
    if abs(got[1] - n_micro * want) <= 1e-5 * max(1.0, abs(n_micro * want)):
        return f"rank {last} returned {got[1]:.5f}, the sum of the micro-batches' losses; their mean is {want:.5f}"
    return f"rank {last} returned {got[1]:.5f}; the mean loss over the micro-batches is {want:.5f}"


def held_problem(per_rank: list, actions: dict) -> str:
    """'' when every rank held at most as many micro-batches' activations at once as its order implies, and that
    many at its peak."""
    for rank, ev in enumerate(per_rank):
        want = implied_peak(actions[rank])
        if ev["peak"] != want:
            return (f"rank {rank} held the activations of {ev['peak']} micro-batches at once (counted at each "
                    f"forward: {ev['counts']}), where its order holds at most {want}")
    return ""


def messages_problem(per_rank: list, placement: list, actions: dict) -> str:
    """'' when each rank sent one message per activation and per gradient that crosses ranks (and at most one
    more per boundary whose activations it sends: the shape); else the first rank that did not.

    ``per_rank[r]["sends"]``: the rank each message went to, None for an object sent (``send_object_list``,
    recorded without its peer), which counts as a shape message.

    Example:
        >>> acts = {0: [("F", 0, 0), ("B", 0, 0)], 1: [("F", 1, 0), ("B", 1, 0)]}
        >>> messages_problem([{"sends": [1, 1]}, {"sends": [0]}], [0, 1], acts)
        ''
        >>> messages_problem([{"sends": [1, 1, 1]}, {"sends": [0]}], [0, 1], acts)
        'rank 0 sent 3 message(s) to rank 1, where its actions send 1 activations and gradients (and at most 1 shape message(s))'
    """
    sent, _ = channels(placement, actions)
    spare = {}
    for s in range(len(placement) - 1):
        if placement[s] != placement[s + 1]:
            spare[placement[s], placement[s + 1]] = spare.get((placement[s], placement[s + 1]), 0) + 1
    for rank, ev in enumerate(per_rank):
        if rank in ev["sends"]:
            return f"rank {rank} sent a message to itself"
        for peer in sorted(set(placement) - {rank}):
            got, want = ev["sends"].count(peer), len(sent.get((rank, peer), []))
            more = spare.get((rank, peer), 0)
            if not want <= got <= want + more:
                return (f"rank {rank} sent {got} message(s) to rank {peer}, where its actions send {want} activations "
                        f"and gradients" + (f" (and at most {more} shape message(s))" if more else ""))
        allowed = sum(len(v) for (a, _), v in sent.items() if a == rank) + sum(
            n for (a, _), n in spare.items() if a == rank)
        if len(ev["sends"]) > allowed:
            return (f"rank {rank} sent {len(ev['sends'])} messages ({ev['sends'].count(None)} of them objects), where "
                    f"its actions send at most {allowed} with the shapes")
    return ""


def finished_problem(per_rank: list, placement: list, actions: dict) -> str:
    """'' when every rank's stages ran as many forwards and backwards as it has actions and the rank sent at least
    the messages its actions send; else the first rank that did not (a scenario that "ran to the end" doing
    nothing is no run)."""
    sent, _ = channels(placement, actions)
    for rank, ev in enumerate(per_rank):
        if len(ev["ran"]) < len(actions[rank]):
            return f"rank {rank}'s stages ran {len(ev['ran'])} forwards and backwards for its {len(actions[rank])} actions"
        want = sum(len(v) for (a, _), v in sent.items() if a == rank)
        got = sum(1 for p in ev["sends"] if p is not None)
        if got < want:
            return f"rank {rank} sent {got} message(s) where its actions send {want}"
    return ""
