"""Judge many answers to one exercise through one warm launch per round instead of one launch per answer.

A checker calls the learner's code through its Tester's runner (``t.call``,
``t.ranks``) and judges what comes back. :func:`judge_many` runs every answer's
checker with a runner that replays the results already known and records the
first call it does not know; it then makes all recorded calls of a round in
ONE launch (the same ranks run each answer's call in turn, errors kept per
call) and goes round again, until every checker has finished. The verdicts are
those of ``check()``: the same checker, the same probes, in real processes or
ranks; only the launches are shared. A call that raised on some rank is made
again on its own (as ``check()`` makes it: its error, not another rank's echo
of it), and a shared launch that fails as a whole (a hang) call by call, so
one answer cannot decide for the others.

Example:
    >>> from mgpu_lab.course.checks import check
    >>> def pick_device(index=None):
    ...     raise NotImplementedError
    >>> [r.status for r in judge_many("01.pick_device", [(pick_device,)])]
    ['not attempted']
"""
from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
import traceback

import cloudpickle

from mgpu_lab.course.checks._core import Tester, run_checker
from mgpu_lab.course.checks._registry import get
from mgpu_lab.launcher.errors import LaunchError

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks get _many by value, not by import


class _Pending(Exception):
    """Raised by the recording runner at the first call whose result is not known yet."""


class _Tester(Tester):
    """A Tester whose scratch directories are the same in every round (the k-th one of an answer is made
    once), so that a replayed call and the checker's reading of its files meet; :func:`judge_many` removes
    them at the end."""

    def __init__(self, ex, runner, dirs: list):
        super().__init__(ex, runner=runner)
        self._dirs, self._made = dirs, 0

    def scratch(self, prefix: str) -> str:
        if self._made == len(self._dirs):
            self._dirs.append(tempfile.mkdtemp(prefix=prefix))
        self._made += 1
        return self._dirs[self._made - 1]


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
            break  # the other ranks may still wait for this one in that call: no later call is shared with them
    return out


def _replay(outcomes: list, world: int):
    """A thunk that returns the ranks' results (a call that every rank finished)."""
    return lambda: [got[1] for got in outcomes]


def _alone(call, run, raised: set, i):
    """A thunk with the outcome of ``call`` made on its own, as ``check()`` makes it; an answer whose own launch
    raised is added to ``raised`` (as ``i``)."""
    fn, nprocs, args, kwargs, options = call
    try:
        got = run(fn, nprocs, args, kwargs, quiet=True, echo=False, **options)
    except LaunchError as exc:
        raised.add(i)

        def fail(error=exc):
            raise error
        return fail
    return lambda: got


def _launch(calls: dict, run, raised: set) -> dict:
    """``{answer: thunk}`` for ``calls = {answer: (fn, nprocs, args, kwargs, options)}``: one launch per kind.

    The calls up to the first one that raised on some rank keep the shared launch's results; that call is
    made again on its own (its error may be another rank's echo), and the ones after it share a new launch.
    An answer in ``raised`` (its own launch raised in an earlier round: a deadlock, a device mix-up) is made on
    its own at once, as it would be after raising in the shared launch, which would then start again for the
    answers after it; an answer whose own launch raises now is added to ``raised``.
    """
    out = {i: _alone(calls[i], run, raised, i) for i in calls if i in raised}
    kinds: dict = {}
    for i, (fn, nprocs, args, kwargs, options) in calls.items():
        if i not in out:
            kinds.setdefault((nprocs, tuple(sorted((k, v) for k, v in options.items() if k != "timeout"))),
                             []).append(i)
    for (nprocs, options), answers in kinds.items():
        while answers:
            items = [calls[i][0:1] + calls[i][2:4] for i in answers]
            timeout = sum(calls[i][4].get("timeout", 60.0) for i in answers)
            try:
                per_rank = run(_many, nprocs, (items,), {}, quiet=True, echo=False, timeout=timeout, **dict(options))
            except LaunchError:  # the shared launch failed as a whole (a hang, a dead rank): each on its own
                out.update({i: _alone(calls[i], run, raised, i) for i in answers})
                break
            done = min(len(r) for r in per_rank)
            clean = next((j for j in range(done) if any(r[j][0] != "ok" for r in per_rank)), done)
            for j in range(clean):
                out[answers[j]] = _replay([r[j] for r in per_rank], nprocs)
            if clean < len(answers):
                out[answers[clean]] = _alone(calls[answers[clean]], run, raised, answers[clean])
            answers = answers[clean + 1:]
    return out


#: The note of a result whose checker was stopped by ``settled`` (see :func:`judge_many`).
SETTLED = "settled: the cases judged so far decide this test (a mutant caught naming its bug); the check's later " \
          "cases were not run"


def judge_many(exercise_id: str, answer_sets: list[tuple], settled=None) -> list:
    """The ``CheckResult`` of ``check(exercise_id, *answers)`` for every tuple of answers, launches shared.

    ``settled(i, cases)``, when given, is asked after each round whether answer ``i``'s cases judged so far
    decide what the caller wants to know (a mutant's failure naming its bug cannot be undone by a later case);
    when it says so, that checker stops before its next launch, and its result holds those cases, the rest
    ``(not reached)``, with the note :data:`SETTLED`."""
    from mgpu_lab.launcher.launch import run

    ex = get(exercise_id)
    known: list[list] = [[] for _ in answer_sets]
    dirs: list[list] = [[] for _ in answer_sets]
    results: list = [None] * len(answer_sets)
    try:
        _rounds(ex, answer_sets, known, dirs, results, run, set(), settled)
    finally:
        for path in (p for answer in dirs for p in answer):
            shutil.rmtree(path, ignore_errors=True)
    return results


def _rounds(ex, answer_sets, known, dirs, results, run, raised: set, settled=None) -> None:
    """Run the checkers round after round until each has a verdict (in ``results``); ``raised``: the answers
    whose own launch raised in a round so far (see :func:`_launch`); ``settled``: see :func:`judge_many`."""
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

            tester = _Tester(ex, runner, dirs[i])
            result = run_checker(ex, tester, answers)
            if asked and settled is not None and settled(i, list(tester.cases)):
                results[i] = dataclasses.replace(result, note=SETTLED)  # tester.cases: judged before the pending call
            elif asked:
                calls[i] = asked[0]
            else:
                results[i] = result
        for i, thunk in _launch(calls, run, raised).items():
            known[i].append(thunk)


def shared_mutant_tests(specs: list, lesson: str, namespace, *, after=None) -> tuple:
    """:func:`mutation.mutant_tests`'s three tests, with every answer of an exercise judged by
    :func:`judge_many` (once per exercise, on first use) instead of one ``check()`` each::

        test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \\
            shared_mutant_tests(SPECS, "04", NAMESPACE)

    As there, ``after(mutant, result)`` adds assertions on a mutant's failed result, and a variant may lose only
    the cases its spec's ``unpaid_here()`` names (a case this machine cannot pay, failing saying so).

    A mutant's checker stops at the first launch after its failed cases already say every word of its ``expect``
    (:func:`judge_many`'s ``settled``): the test's verdict cannot change, and the later launches (a third rank,
    another world size) are the costly ones. Not with ``after``, whose assertions may read any case; variants
    are always judged whole.
    """
    import functools

    import pytest
    from mutation import assert_caught, assert_full_marks, caught_saying, cell_of, define, mutant_tests, params

    _, _, counts = mutant_tests(specs, lesson, namespace)

    @functools.cache
    def verdicts(exercise: str) -> dict:
        spec = next(s for s in specs if s.exercise == exercise)
        ns = namespace() if callable(namespace) else namespace
        answers = {("mutant", m.name): define(m.apply(cell_of(spec)), spec.names, ns, f"<mutant {m.name}>")
                   for m in spec.mutants}
        answers.update({("variant", v.name): define(v.source, spec.names, ns, f"<variant {v.name}>")
                        for v in spec.variants})
        keys, words = list(answers), {m.name: m.words for m in spec.mutants}

        def settled(i: int, cases: list) -> bool:
            kind, name = keys[i]
            return kind == "mutant" and after is None and caught_saying(cases, words[name])
        return dict(zip(answers, judge_many(exercise, [tuple(a) for a in answers.values()], settled=settled)))

    @pytest.mark.parametrize("spec, mutant", params(specs, "mutants"))
    def test_mutant_fails_naming_its_bug(spec, mutant):
        result = verdicts(spec.exercise)[("mutant", mutant.name)]
        assert_caught(spec, mutant, result)
        if after is not None:
            after(mutant, result)

    @pytest.mark.parametrize("spec, variant", params(specs, "variants"))
    def test_correct_variant_passes(spec, variant):
        assert_full_marks(spec, variant, verdicts(spec.exercise)[("variant", variant.name)])

    test_mutant_fails_naming_its_bug.verdicts = verdicts
    return test_mutant_fails_naming_its_bug, test_correct_variant_passes, counts
