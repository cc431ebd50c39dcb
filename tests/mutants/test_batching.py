"""tests/mutants/batching.py's launches, with a stand-in for the launcher: which calls share a launch."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from batching import _launch, _many
from mutation import caught_saying

from mgpu_lab.launcher.errors import LaunchError


def _fake_run(log: list, raises: set):
    """A stand-in for ``launch.run``: records each launch's answers; an answer in ``raises`` raises on rank 0."""
    def run(fn, nprocs, args, kwargs, **options):
        if fn is _many:
            names = [item[1][0] for item in args[0]]
            log.append(("shared", names))
            out = []
            for name in names:
                if name in raises:
                    out.append(("raised", "Deadlock", name, ""))
                    break
                out.append(("ok", name))
            return [out] * nprocs
        log.append(("alone", args[0]))
        if args[0] in raises:
            raise LaunchError(f"{args[0]} raised")
        return [args[0]] * nprocs
    return run


def _calls(names):
    return {i: (lambda name: name, 2, (name,), {}, {}) for i, name in enumerate(names)}


def test_an_answer_whose_own_launch_raised_in_a_round_is_made_alone_at_once_in_the_next():
    names, log, raised = ["a", "b", "c", "d"], [], set()
    first = _launch(_calls(names), _fake_run(log, {"b"}), raised)
    # round 1: b raised in the shared launch, was made again alone (and raised), the answers after it shared anew
    assert log == [("shared", ["a", "b", "c", "d"]), ("alone", "b"), ("shared", ["c", "d"])] and raised == {1}
    assert first[0]() == ["a", "a"] and first[3]() == ["d", "d"]
    log.clear()
    second = _launch(_calls(names), _fake_run(log, {"b"}), raised)
    # round 2: b alone at once; the others in one shared launch
    assert log == [("alone", "b"), ("shared", ["a", "c", "d"])] and raised == {1}
    assert [second[i]() for i in (0, 2, 3)] == [["a", "a"], ["c", "c"], ["d", "d"]]
    with pytest.raises(LaunchError, match="b raised"):  # b's own launch raised: its thunk raises that error
        second[1]()


def test_an_answer_that_raised_only_beside_others_is_shared_again():
    # raised in the shared launch (another rank's echo, say) but not alone: not marked, shared in the next round
    log, raised = [], set()
    run = _fake_run(log, {"b"})

    def flaky(fn, nprocs, args, kwargs, **options):
        if fn is _many:
            return run(fn, nprocs, args, kwargs, **options)
        log.append(("alone", args[0]))
        return [args[0]] * nprocs
    got = _launch(_calls(["a", "b", "c"]), flaky, raised)
    assert log == [("shared", ["a", "b", "c"]), ("alone", "b"), ("shared", ["c"])] and raised == set()
    assert got[1]() == ["b", "b"]


def _two_launches():
    """A stand-in exercise of two cases, each judged on its own launch (2 ranks, then 3): the answer returns the
    words its case fails with, or "" to pass."""
    from mgpu_lab.course.checks._core import CaseFailed

    def checker(t, answer):
        for world in (2, 3):
            with t.case(f"{world} ranks"):
                said = t.ranks(answer, world, world)[0]
                if said:
                    raise CaseFailed(hint=said)
    return SimpleNamespace(id="00.two_launches", points=2, checker=checker, references=())


def test_a_mutant_caught_saying_its_words_is_settled_before_its_next_launch():
    import batching

    log = []

    def run(fn, nprocs, args, kwargs, **options):
        if fn is _many:
            log.append((nprocs, [item[1] for item in args[0]]))
            return [[("ok", item[0](*item[1])) for item in args[0]]] * nprocs
        log.append((nprocs, "alone"))
        return [fn(*args)] * nprocs

    early = lambda *a: "the early bug"  # noqa: E731 - fails both cases with its words
    late = lambda world: "the late bug" if world == 3 else "another thing"  # noqa: E731 - its words at 3 ranks only
    right = lambda world: ""  # noqa: E731
    answers = [(early,), (late,), (right,)]
    words = {0: ("early bug",), 1: ("late bug",)}
    results = [None] * 3
    batching._rounds(_two_launches(), answers, [[] for _ in answers], [[] for _ in answers], results, run, set(),
                     lambda i, cases: i in words and caught_saying(cases, words[i]))
    # round 1: all three on 2 ranks; round 2: only the mutant not yet caught saying its words, and the right answer
    assert [(n, len(items)) for n, items in log] == [(2, 3), (3, 2)]
    assert results[0].note == batching.SETTLED and [c.name for c in results[0].cases] == ["2 ranks", "(not reached)"]
    assert results[0].status == "failed" and "early bug" in results[0].cases[0].hint
    assert results[1].note != batching.SETTLED and "late bug" in results[1].cases[1].hint
    assert results[2].status == "passed"
    log.clear()
    results = [None] * 3  # without settled: every answer judged whole
    batching._rounds(_two_launches(), answers, [[] for _ in answers], [[] for _ in answers], results, run, set())
    assert [(n, len(items)) for n, items in log] == [(2, 3), (3, 3)]


# -- shared_mutant_tests' own assertions, with a stand-in for judge_many ------------------------------------------
def _case(name, passed, hint=""):
    return SimpleNamespace(name=name, passed=passed, hint=hint, got="", expected="", points=2)


def _result(*cases, max_points=4):
    points = 2 * sum(c.passed for c in cases)
    return SimpleNamespace(status="passed" if all(c.passed for c in cases) else "failed", note="", cases=list(cases),
                           points=points, max_points=max_points)


@pytest.fixture
def shared(monkeypatch):
    """shared_mutant_tests over one stand-in exercise of lesson 01 whose verdicts are ``verdicts[name]``."""
    import batching
    import mutation

    verdicts = {}
    monkeypatch.setattr(mutation, "cell_of", lambda spec: "def pick_device(index=None):\n    return 'cpu'\n")
    monkeypatch.setattr(batching, "judge_many", lambda exercise, answers, settled=None: [
        verdicts.get(a[0], _result(_case("the other answer's", True))) for a in answers])
    # define() -> (the answer's name,) so the stand-in judge_many can find its verdict
    monkeypatch.setattr(mutation, "define", lambda src, names, ns, where: (where.split(" ", 1)[1][:-1],))

    def make(after=None, unpaid=None):
        spec = mutation.ExerciseMutants("01.pick_device", "01_devices.ipynb", ("pick_device",),
                                        mutants=[mutation.Mutant("bug", lambda s: s + "#", "the bug's words")],
                                        variants=[mutation.Variant("other", "def pick_device(index=None): ...")],
                                        unpaid_here=unpaid)
        tests = batching.shared_mutant_tests([spec], "01", {}, after=after)
        return spec, tests
    return verdicts, make


def test_after_adds_its_assertions_to_a_caught_mutant(shared):
    verdicts, make = shared
    verdicts["bug"] = _result(_case("a case", False, "the bug's words"), _case("the right one", True))
    seen = []
    spec, (mutant_test, _, _) = make(after=lambda m, r: seen.append((m.name, r.status)))
    mutant_test(spec, spec.mutants[0])
    assert seen == [("bug", "failed")]

    def right_case_passes(m, r):
        assert r.cases[0].passed, "the right case should pass"
    spec, (mutant_test, _, _) = make(after=right_case_passes)
    with pytest.raises(AssertionError, match="the right case should pass"):
        mutant_test(spec, spec.mutants[0])


def test_a_variant_may_lose_only_the_cases_this_machine_cannot_pay(shared):
    verdicts, make = shared
    verdicts["other"] = _result(_case("paid", True), _case("across nodes", False, "needs namespaces: not here"))
    spec, (_, variant_test, _) = make(unpaid=lambda: "needs namespaces")
    variant_test(spec, spec.variants[0])  # excused: the case says why this machine cannot pay it
    verdicts["other"] = _result(_case("paid", False, "wrong"), _case("across nodes", True))
    spec, (_, variant_test, _) = make(unpaid=lambda: "needs namespaces")
    with pytest.raises(AssertionError, match="lost points"):
        variant_test(spec, spec.variants[0])
    verdicts["other"] = _result(_case("paid", True), _case("across nodes", False, "needs namespaces: not here"))
    spec, (_, variant_test, _) = make()  # no excuse named: the lost case counts
    with pytest.raises(AssertionError, match="lost points"):
        variant_test(spec, spec.variants[0])


def test_a_mutant_must_fail_and_say_its_words(shared):
    verdicts, make = shared
    spec, (mutant_test, _, _) = make()
    verdicts["bug"] = _result(_case("a case", True))
    with pytest.raises(AssertionError, match="was not caught"):
        mutant_test(spec, spec.mutants[0])
    verdicts["bug"] = _result(_case("a case", False, "something else"))
    spec, (mutant_test, _, _) = make()  # the verdicts are judged once per set of tests: a new set for a new one
    with pytest.raises(AssertionError, match="does not say"):
        mutant_test(spec, spec.mutants[0])
