"""Judge many answers to one exercise through one warm launch per round instead of one launch per answer.

A checker calls the learner's code through its Tester's runner (``t.call``,
``t.ranks``) and judges what comes back. :func:`judge_many` runs every answer's
checker with a runner that replays the results already known and records the
first call it does not know; it then makes all recorded calls of a round in
ONE launch (the same ranks run each answer's call in turn, errors kept per
call) and goes round again, until every checker has finished. The verdicts are
those of ``check()``: the same checker, the same probes, in real processes or
ranks; only the launches are shared. A round whose shared launch fails as a
whole (a hang) is made again call by call, so one answer cannot decide for
the others.

Example:
    >>> from mgpu_lab.course.checks import check
    >>> def pick_device(index=None):
    ...     raise NotImplementedError
    >>> [r.status for r in judge_many("01.pick_device", [(pick_device,)])]
    ['not attempted']
"""
from __future__ import annotations

import sys
import traceback

import cloudpickle

from mgpu_lab.course.checks._core import Tester, run_checker
from mgpu_lab.course.checks._registry import get
from mgpu_lab.launcher.errors import LaunchError

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks get _many by value, not by import


class _Pending(Exception):
    """Raised by the recording runner at the first call whose result is not known yet."""


def _many(items) -> list:
    """In a rank: every ``(fn, args, kwargs)`` in turn, each one's outcome kept apart."""
    from mgpu_lab.course.checks import _references

    out = []
    for fn, args, kwargs in items:
        _references._CALLS.clear()  # a reference called by the previous answer is not this one's
        try:
            out.append(("ok", fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - handed back to that answer's checker as a LaunchError
            out.append(("raised", type(exc).__name__, str(exc), traceback.format_exc()))
    return out


def _replay(outcomes: list, world: int):
    """A thunk that returns the ranks' results or raises what :func:`mgpu_lab.launch` would have raised."""
    def thunk():
        for rank, got in enumerate(outcomes):
            if got[0] == "raised":
                raise LaunchError(f"rank {rank}/{world} raised {got[1]}: {got[2]}", rank=rank, world_size=world,
                                  exc_type=got[1], traceback=got[3])
        return [got[1] for got in outcomes]
    return thunk


def _launch(calls: dict, run) -> dict:
    """``{answer: thunk}`` for ``calls = {answer: (fn, nprocs, args, kwargs, options)}``: one launch per kind."""
    kinds: dict = {}
    for i, (fn, nprocs, args, kwargs, options) in calls.items():
        kinds.setdefault((nprocs, tuple(sorted((k, v) for k, v in options.items() if k != "timeout"))), []).append(i)
    out = {}
    for (nprocs, options), answers in kinds.items():
        items = [calls[i][0:1] + calls[i][2:4] for i in answers]
        timeout = sum(calls[i][4].get("timeout", 60.0) for i in answers)
        try:
            per_rank = run(_many, nprocs, (items,), {}, quiet=True, echo=False, timeout=timeout, **dict(options))
        except LaunchError:  # the shared launch failed as a whole: each call on its own, as check() makes it
            for i in answers:
                fn, n, args, kwargs, opts = calls[i]
                try:
                    got = run(fn, n, args, kwargs, quiet=True, echo=False, **opts)
                    out[i] = (lambda value: (lambda: value))(got)
                except LaunchError as exc:
                    out[i] = (lambda error: (lambda: (_ for _ in ()).throw(error)))(exc)
            continue
        for j, i in enumerate(answers):
            out[i] = _replay([rank_out[j] for rank_out in per_rank], nprocs)
    return out


def judge_many(exercise_id: str, answer_sets: list[tuple]) -> list:
    """The ``CheckResult`` of ``check(exercise_id, *answers)`` for every tuple of answers, launches shared."""
    from mgpu_lab.launcher.launch import run

    ex = get(exercise_id)
    known: list[list] = [[] for _ in answer_sets]
    results: list = [None] * len(answer_sets)
    while any(r is None for r in results):
        calls = {}
        for i, answers in enumerate(answer_sets):
            if results[i] is not None:
                continue
            replies, asked = iter(known[i]), []

            def runner(fn, nprocs, args, kwargs, replies=replies, asked=asked, **options):
                for thunk in replies:
                    return thunk()
                asked.append((fn, nprocs, args, kwargs, options))
                raise _Pending()

            result = run_checker(ex, Tester(ex, runner=runner), answers)
            if asked:
                calls[i] = asked[0]
            else:
                results[i] = result
        for i, thunk in _launch(calls, run).items():
            known[i].append(thunk)
    return results
