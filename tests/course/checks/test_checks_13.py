"""Lesson 13's checkers against stubs, answers that call a reference, do-nothing answers, and the reference of
13.exposed_comm on a trace worked out by hand (tests/mutants/test_mutants_13.py has the named mutants)."""
from __future__ import annotations

import pytest

from checking import by_value, case_starting
from mgpu_lab.course.checks import check, exercises
from mgpu_lab.course.checks.l13 import judges
from mgpu_lab.course.checks.l13.ranks import CACHE_ENV

pytestmark = pytest.mark.timeout(300)
NAMES = ("exposed_comm", "saved_bytes", "checkpoint_under")


@pytest.fixture(scope="module", autouse=True)
def recorded_once(tmp_path_factory):
    """The ranks record lesson 13's traces once for this file and reuse them (the check's own cache)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("l13-traces")))
        yield


ANSWERS = {"stub": by_value("def stub(*args, **kwargs):\n    raise NotImplementedError('write this')\n", "stub")}


def test_lesson_13_registers_its_three_exercises_with_one_point_per_case():
    got = {e.id: e.points for e in exercises("13")}
    assert got == {"13.exposed_comm": 5, "13.saved_bytes": 5, "13.checkpoint_under": 4}


@pytest.mark.parametrize("name", NAMES)
def test_a_stub_is_not_attempted(name):
    assert check(f"13.{name}", ANSWERS["stub"]).status == "not attempted"


ANSWERS["library_exposed"] = by_value('''
def library_exposed(trace, rank_thread=None):
    from mgpu_lab.course.checks.l13.judges import reference_exposed_comm as theirs
    return theirs(trace, rank_thread)
''', "library_exposed")
ANSWERS["library_saved"] = by_value('''
def library_saved(model, x):
    from mgpu_lab.course.checks.l13 import ranks
    return ranks.reference_saved_bytes(model, x)
''', "library_saved")
ANSWERS["library_checkpoint"] = by_value('''
def library_checkpoint(model, x, budget_bytes):
    from mgpu_lab.course.checks.l13.ranks import reference_checkpoint_under
    return reference_checkpoint_under(model, x, budget_bytes)
''', "library_checkpoint")


@pytest.mark.parametrize("exercise, answer, says", [
    ("13.exposed_comm", "library_exposed", "judges.reference_exposed_comm"),
    ("13.saved_bytes", "library_saved", "ranks.reference_saved_bytes"),
    ("13.checkpoint_under", "library_checkpoint", "ranks.reference_checkpoint_under"),
])
def test_an_answer_that_calls_a_reference_fails_every_case_naming_it(exercise, answer, says):
    result = check(exercise, ANSWERS[answer])
    assert result.points == 0, result
    assert says in str(result), result


# -- do-nothing answers pass no case that names a behaviour they lack ---------------------------------------
ANSWERS["zero"] = by_value("def zero(trace, rank_thread=None):\n    return 0.0\n", "zero")
ANSWERS["zeros"] = by_value('''
def zeros(model, x):
    return {name: 0 for name, _ in model.named_children()}
''', "zeros")
ANSWERS["unchanged"] = by_value("def unchanged(model, x, budget_bytes):\n    return model\n", "unchanged")


def test_an_exposed_comm_of_zero_passes_no_case():
    result = check("13.exposed_comm", ANSWERS["zero"])
    assert result.points == 0, result


def test_saved_bytes_of_zero_passes_no_case():
    result = check("13.saved_bytes", ANSWERS["zeros"])
    assert result.points == 0, result
    assert "missing" in case_starting(result, "Linear, ReLU").hint


def test_a_checkpoint_under_that_changes_nothing_passes_no_case():
    result = check("13.checkpoint_under", ANSWERS["unchanged"])
    assert result.points == 0, result
    assert "none" in case_starting(result, "after checkpointing").got
    assert "returned a model" in case_starting(result, "a budget below").got


# -- the reference of exposed_comm, on a trace worked out by hand ---------------------------------------------
def _x(name, tid, ts, dur, cat="cpu_op"):
    return {"ph": "X", "name": name, "tid": tid, "ts": float(ts), "dur": float(dur), "cat": cat}


HAND = {"traceEvents": [
    _x("ProfilerStep#1", 1, 0, 50, "user_annotation"),               # a label: not computing
    _x("aten::mm", 1, 0, 10),
    _x("autograd::engine::evaluate_function: AccumulateGrad", 1, 20, 10),
    _x("c10d::allreduce_", 1, 22, 3),                                 # inside an operator: not computing
    _x("gloo:all_reduce", 2, 5, 35, "user_annotation"),
    _x("gloo:all_reduce", 3, 30, 5, "user_annotation"),               # concurrent with the one above
    _x("c10d::allreduce_", 1, 42, 4),                                 # a blocking call after backward
    _x("gloo:all_reduce", 3, 42, 3, "user_annotation"),
    _x("gloo:all_reduce", 2, 48, 4, "user_annotation"),               # ends after the step's label
    _x("aten::mm", 4, 10, 10),                                        # another thread's operator
    {"ph": "i", "name": "[memory]", "ts": 3.0, "tid": 1},
]}


def test_the_reference_reads_a_hand_made_trace_as_worked_out():
    # communication [5, 40], [42, 46], [48, 52]; thread 1 computes [0, 10], [20, 22], [25, 30]
    # exposed: [10, 20] + [22, 25] + [30, 40] + [42, 46] + [48, 52] = 31 us
    assert judges.reference_exposed_comm(HAND) == pytest.approx(0.031)
    assert judges.reference_exposed_comm(HAND, rank_thread=4) == pytest.approx(0.033)  # thread 4 computes [10, 20]
    assert judges.reference_exposed_comm({"traceEvents": [_x("aten::mm", 1, 0, 5)]}) == 0.0


@pytest.mark.parametrize("wrong, thread, value", [
    ("sum", None, 0.054), ("per event", None, 0.042), ("all threads", None, 0.021), ("annotations", None, 0.009),
    ("calls as compute", None, 0.028), ("c10d only", None, 0.007), ("microseconds", None, 31.0),
    ("ignores rank_thread", 4, 0.031)])
def test_each_known_wrong_reading_differs_and_is_named(wrong, thread, value):
    assert judges.reference_exposed_comm(HAND, thread, wrong=wrong) == pytest.approx(value)
    assert judges.diagnose(HAND, thread, value) == judges.WRONG[wrong]


class _Failed(Exception):
    pass


class _Case:
    """What exposed_case needs of a check's case: fail(hint, expected, got) ends it."""

    def fail(self, hint, expected=None, got=None):
        raise _Failed(hint, expected, got)


def test_a_hint_is_given_once_later_cases_with_the_same_reading_point_back_to_it():
    run = {"training": 1, "helper": None, "traces": {"one bucket": HAND, "no_sync": HAND},
           "answers": [("one bucket", None, ("ok", 0.054)), ("no_sync", None, ("ok", 0.054))]}
    said, hints = set(), []
    for name in ("one bucket", "no_sync"):
        with pytest.raises(_Failed) as failed:
            judges.exposed_case(_Case(), [run], {name}, said=said)
        hints.append(failed.value.args[0])
    assert hints[0] == judges.WRONG["sum"]
    assert "same reading as in a failed case above" in hints[1] and judges.WRONG["sum"] not in hints[1]
