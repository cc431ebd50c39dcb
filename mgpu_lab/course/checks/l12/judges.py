"""Lesson 12's verdicts, in words: replayed 1F1B orders, bubbles against the replayed schedules, pipeline training.

The references a value is judged against are :func:`reference_bubble` (every schedule's
order from :mod:`mgpu_lab.parallel.pp_orders`, replayed with the given times) and
:func:`.ranks.reference_state` (training in one process); each judge names the known
wrong answer a value matches when it recognises one.
"""
from __future__ import annotations

import torch

from mgpu_lab.parallel import pp_orders

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
        idle = pp_orders.simulate(labelled, {"F": 1.0, "B": 1.0}).idle_fraction()
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
        pp_orders.simulate(labelled, {"F": 1.0, "B": 1.0})
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


ORDER_HINT = ("each rank forwards a few micro-batches to fill the pipeline, then takes turns: one forward, one "
              "backward, and ends with the backwards left; the last rank runs each backward right after its "
              "forward, and each rank further from the end fills one more")


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
    return pp_orders.simulate(pp_orders.orders(schedule, n_stages, n_micro, virtual), times).idle_fraction()


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


# -- pipeline_train --------------------------------------------------------------------
def returns_problem(per_rank: list) -> str:
    """Rank 0 returns a state_dict of tensors, the others None ('' when so)."""
    first, *rest = per_rank
    if first[0] != "state":
        return f"rank 0 returned {first[1] if first[0] == 'other' else 'None'}, not the model's state_dict"
    for rank, got in enumerate(rest, 1):
        if got[0] != "none":
            return f"rank {rank} returned {got[1] if got[0] == 'other' else 'a state_dict'}, not None"
    return ""


TRAIN_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                 "zbv": "ScheduleZBVZeroBubble"}


def stages_of(schedule: str, rank: int, world: int) -> list[int]:
    """The stages ``rank`` holds: one, two in a loop (interleaved), two in a V (ZBV)."""
    if schedule == "interleaved":
        return [rank, rank + world]
    if schedule == "zbv":
        return [rank, 2 * world - 1 - rank]
    return [rank]


def ran_problem(ran: list, schedule: str, n_micro: int, steps: int) -> str:
    """'' when, on every rank, torch's schedule of that name was built with the rank's stages, each stage ran
    every micro-batch's forward and backward once per step, and the rank sent messages; else what is missing.

    ``ran``: each rank's record (:func:`.ranks.recording_pipelining`).

    Example:
        >>> seen = {"schedules": [("Schedule1F1B", [0])], "actions": {"F0": 8, "B0": 8}, "sends": 8}
        >>> ran_problem([seen, dict(seen, schedules=[("Schedule1F1B", [1])], actions={"F1": 8, "B1": 8})],
        ...             "1f1b", 4, 2)
        ''
        >>> ran_problem([seen, {"schedules": [], "actions": {}, "sends": 0}], "1f1b", 4, 2)
        'rank 1 built no Schedule1F1B (it built none)'
    """
    want = TRAIN_CLASSES[schedule]
    for rank, seen in enumerate(ran):
        built = [name for name, _ in seen["schedules"]]
        if want not in built:
            return f"rank {rank} built no {want} (it built {', '.join(built) or 'none'})"
        for stage in stages_of(schedule, rank, len(ran)):
            forwards = seen["actions"].get(f"F{stage}", 0)
            backwards = seen["actions"].get(f"B{stage}", 0) + seen["actions"].get(f"I{stage}", 0)
            if forwards < n_micro * steps or backwards < n_micro * steps:
                return (f"stage {stage} on rank {rank} ran {forwards} forwards and {backwards} backwards in torch's "
                        f"pipeline stage, where {steps} steps of {n_micro} micro-batches run {n_micro * steps} of each")
        if not seen["sends"]:
            return f"rank {rank}'s stages sent no message to the other rank"
    return ""


def state_problem(state: dict, ref: dict, n_micro: int, lr: float, scaled=None) -> tuple[str, str]:
    """How the gathered weights differ from one process's: ``(hint, got)``, ``("", "")`` when equal.

    ``scaled(c)``: one process's weights with every gradient multiplied by ``c`` (SGD: the learning rate times
    ``c``), to recognise the micro-batch losses summed (``c = n_micro``) or divided twice (``c = 1 / n_micro``).
    """
    hint, got = "", _state_difference(state, ref)
    if "differs from one process's" in got:
        hint = ("every tensor has the model's name and shape, with other values: the step must use the mean loss "
                f"over the whole batch (torch's schedules divide by n_micro={n_micro} when scale_grads=True), clear "
                f"the gradients every step, and step with SGD(lr={lr}) once per batch")
    if got and scaled is not None and "differs from one process's" in got:
        for c, words in ((n_micro, "the micro-batch losses summed, not averaged: the gradients are n_micro times "
                                   "one process's (torch's schedules already divide by n_micro when "
                                   "scale_grads=True, which a loss that is a mean over its micro-batch needs)"),
                         (1 / n_micro, "the loss divided by n_micro twice: the gradients are 1/n_micro of one "
                                       "process's (torch's schedules already divide by n_micro when "
                                       "scale_grads=True; a loss that is a mean over its micro-batch needs no more)")):
            if not _state_difference(state, scaled(c)):
                hint = f"the weights are those of {words}"
    return hint, got


def _state_difference(state: dict, ref: dict) -> str:
    """How the gathered weights differ from one process's ('' when equal)."""
    missing = [k for k in ref if k not in state]
    if missing:
        return (f"rank 0's state_dict lacks {missing[:4]}{' ...' if len(missing) > 4 else ''} (it holds "
                f"{sorted(state)[:6]}): gather every stage's weights on rank 0, named as in model_fn()'s state_dict")
    extra = [k for k in state if k not in ref]
    if extra:
        return f"rank 0's state_dict has keys the model lacks: {extra[:4]}; name them as in model_fn()'s state_dict"
    worst = max(ref, key=lambda k: float((state[k].float() - ref[k]).abs().max()) if state[k].shape == ref[k].shape
                else float("inf"))
    if state[worst].shape != ref[worst].shape:
        return f"{worst} has shape {tuple(state[worst].shape)}, the model's {tuple(ref[worst].shape)}"
    diff = float((state[worst].float() - ref[worst]).abs().max())
    if diff <= 1e-5:
        return ""
    return f"{worst} differs from one process's by {diff:.2e}"
