"""Lesson 13's checkers against stubs, answers that call a reference, do-nothing answers, and the reference of
13.exposed_comm on a trace worked out by hand (tests/mutants/test_mutants_13.py has the named mutants)."""
from __future__ import annotations

import pytest

from checking import by_value, case_starting
from mgpu_lab.course.checks import check, exercises
from mgpu_lab.course.checks.l13 import judges
from mgpu_lab.course.checks.l13.ranks import CACHE_ENV

pytestmark = pytest.mark.timeout(300)
NAMES = ("exposed_comm", "saved_bytes", "checkpoint_under", "find_straggler")


@pytest.fixture(scope="module", autouse=True)
def recorded_once(tmp_path_factory):
    """The ranks record lesson 13's traces once for this session and reuse them (the check's own cache; the
    mutants of tests/mutants/test_mutants_13.py share it)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(CACHE_ENV, str(tmp_path_factory.getbasetemp() / "l13-traces"))
        yield


ANSWERS = {"stub": by_value("def stub(*args, **kwargs):\n    raise NotImplementedError('write this')\n", "stub")}


def test_lesson_13_registers_its_four_exercises_find_straggler_with_half_the_points():
    got = {e.id: e.points for e in exercises("13")}
    assert got == {"13.exposed_comm": 2, "13.saved_bytes": 2, "13.checkpoint_under": 4, "13.find_straggler": 8}
    assert 2 * got["13.find_straggler"] >= sum(got.values())


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
ANSWERS["library_straggler"] = by_value('''
def library_straggler(traces):
    from mgpu_lab.course.checks.l13 import judges
    return judges.reference_find_straggler(traces)
''', "library_straggler")
ANSWERS["library_checkpoint"] = by_value('''
def library_checkpoint(model, x, budget_bytes):
    from mgpu_lab.course.checks.l13.ranks import reference_checkpoint_under
    return reference_checkpoint_under(model, x, budget_bytes)
''', "library_checkpoint")


@pytest.mark.parametrize("exercise, answer, says", [
    ("13.exposed_comm", "library_exposed", "judges.reference_exposed_comm"),
    ("13.saved_bytes", "library_saved", "ranks.reference_saved_bytes"),
    ("13.checkpoint_under", "library_checkpoint", "ranks.reference_checkpoint_under"),
    ("13.find_straggler", "library_straggler", "judges.reference_find_straggler"),
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


ANSWERS["nobody"] = by_value("def nobody(traces):\n    return {'rank': None, 'cause': None}\n", "nobody")
ANSWERS["rank_zero"] = by_value("def rank_zero(traces):\n    return {'rank': 0, 'cause': 'data'}\n", "rank_zero")
ANSWERS["last_rank"] = by_value(
    "def last_rank(traces):\n    return {'rank': len(traces) - 1, 'cause': 'compute'}\n", "last_rank")


@pytest.mark.parametrize("answer", ["nobody", "rank_zero", "last_rank"])
def test_a_find_straggler_that_does_not_read_the_traces_passes_no_case(answer):
    """None is right for balanced ranks and a fixed rank is right wherever the draw put the straggler there: neither
    passes, since the same verdict for every recording is no evidence of reading them."""
    result = check("13.find_straggler", ANSWERS[answer])
    assert result.points == 0, result


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


#: Communication exposed, but by the same amount whichever of threads 1 and 4 is named.
SAME = {"traceEvents": [_x("aten::mm", 1, 0, 5), _x("gloo:all_reduce", 2, 10, 10, "user_annotation"),
                        _x("aten::mm", 4, 0, 5)]}


def test_a_helper_trace_is_evidence_only_where_some_communication_is_exposed_and_the_thread_named_matters():
    # HAND: thread 1 trains, thread 4 computes beside it; communication is exposed whichever is named, by different
    # amounts (0.031 and 0.033 ms)
    assert judges.helper_evidence(HAND, 1, 4) == [1, 1, 1, 1]
    assert judges.helper_evidence(HAND, 1, None) == [1, 0, 0, 0]  # no helper recorded: nothing about threads
    hidden = {"traceEvents": [_x("aten::mm", 1, 0, 50), _x("gloo:all_reduce", 2, 5, 10, "user_annotation"),
                              _x("aten::mm", 4, 0, 50)]}  # both threads compute through the whole all-reduce
    assert judges.helper_evidence(hidden, 1, 4) == [0, 0, 0, 0]
    assert judges.helper_evidence(SAME, 1, 4) == [1, 1, 1, 0]


def test_the_helper_case_has_evidence_only_on_a_run_where_the_thread_named_changes_the_reading():
    runs = [{"traces": {"helper": trace}, "training": 1, "helper": helper} for trace, helper in
            ((SAME, 4), (HAND, None))]
    with pytest.raises(_Failed, match="hid the same communication"):
        judges.threads_matter(_Case(), runs)
    judges.threads_matter(_Case(), runs + [{"traces": {"helper": HAND}, "training": 1, "helper": 4}])  # no failure


# -- find_straggler: the reading of a hand-made trace, and no case without its evidence --------------------------
def _rank(step_ms, load_ms, fb_ms, wait_ms, tid=1, steps=3):
    """A trace of ``steps`` steps: loading, then forward and backward (whose last ``wait_ms`` the training thread
    spends waiting for a gloo all-reduce on thread 9), then the optimizer."""
    events, t0 = [], 0.0
    for i in range(steps):
        us = lambda ms: ms * 1e3  # noqa: E731
        fwd = fb_ms / 3
        events += [_x(f"ProfilerStep#{i + 1}", tid, t0, us(step_ms), "user_annotation"),
                   _x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", tid, t0, us(load_ms),
                      "user_annotation"),
                   _x("forward", tid, t0 + us(load_ms), us(fwd), "user_annotation"),
                   _x("aten::addmm", tid, t0 + us(load_ms), us(fwd)),
                   _x("backward", tid, t0 + us(load_ms + fwd), us(fb_ms - fwd + wait_ms), "user_annotation"),
                   _x("aten::mm", tid, t0 + us(load_ms + fwd), us(fb_ms - fwd)),
                   _x("c10d::allreduce_", tid, t0 + us(load_ms + fwd + 1), 50.0),
                   _x("gloo:all_reduce", 9, t0 + us(load_ms + fwd + 1), us(fb_ms - fwd - 1 + wait_ms),
                      "user_annotation"),
                   _x("optimizer", tid, t0 + us(load_ms + fb_ms + wait_ms), us(1), "user_annotation")]
        t0 += us(step_ms)
    return {"traceEvents": events}


def test_the_reference_reads_hand_made_traces_as_worked_out():
    # rank 1 loads 60 ms longer; rank 0 waits for it at the end of backward. Steps of 100 ms.
    rows = judges.rank_rows([_rank(100, 10, 30, 59), _rank(100, 70, 29, 0)])
    # the 50 us inside the c10d:: call count as waiting too: the thread is in a communication call, not computing
    assert rows[0]["wait"] == pytest.approx(59.05) and rows[1]["wait"] == pytest.approx(0.05)
    assert rows[0]["compute"] == pytest.approx(29.95) and rows[1]["load"] == pytest.approx(70)
    # backward's time outside the training thread's operators: the same wait, read another way
    assert rows[0]["idle"] == pytest.approx(59) and rows[1]["idle"] == pytest.approx(0)
    reading = judges.straggler_reading(rows)
    assert (reading["rank"], reading["cause"]) == (1, "data") and reading["share"] == pytest.approx(0.59, abs=0.01)
    assert judges.straggler_reading(rows, wrong="waits longest")["rank"] == 0
    assert judges.straggler_reading(rows, wrong="longest step")["rank"] is None
    even = judges.rank_rows([_rank(100, 10, 30, 5), _rank(100, 10, 33, 2)])
    assert judges.straggler_reading(even)["rank"] is None


def test_a_recording_two_right_readings_part_on_is_not_evidence():
    from mgpu_lab.course.checks.l13.ranks import shows_design

    even = judges.rank_rows([_rank(100, 10, 30, 5), _rank(100, 10, 33, 2)])
    balanced = {"kind": "balanced", "rank": None, "ranks": {}}
    assert shows_design(judges.straggler_reading(even), balanced, even)
    # as a busy machine leaves it: rank 0's training thread was off its core between operators in backward (no
    # communication in flight), so reading the waiting as time outside operators finds rank 1 doing 40 ms more
    parted = [dict(even[0], idle=even[0]["idle"] + 40), even[1]]
    assert judges.straggler_reading(parted)["share"] <= 0.2  # the reference alone still reads it balanced
    assert judges.straggler_reading(parted, waiting="idle")["candidate"] == 1
    assert not shows_design(judges.straggler_reading(parted), balanced, parted)
    slow = judges.rank_rows([_rank(100, 10, 30, 59), _rank(100, 70, 29, 0)])
    loader = {"kind": "loader", "rank": 1, "ranks": {1: {"delay": 0.25}}}
    assert shows_design(judges.straggler_reading(slow), loader, slow)
    hidden = [slow[0], dict(slow[1], idle=slow[1]["idle"] + 80)]  # rank 1's own work, read the other way, vanishes
    assert shows_design(judges.straggler_reading(hidden), loader)
    assert not shows_design(judges.straggler_reading(hidden), loader, hidden)


def _evidence(kind, clear=True, answers=None):
    rows = judges.rank_rows([_rank(100, 10, 30, 59), _rank(100, 70, 29, 0)])
    even = judges.rank_rows([_rank(100, 10, 30, 5), _rank(100, 10, 33, 2)])
    recorded = [{"kind": "loader", "rank": 1, "rows": rows, "reading": judges.straggler_reading(rows),
                 "clear": clear, "tries": 3},
                {"kind": "balanced", "rank": None, "rows": even, "reading": judges.straggler_reading(even),
                 "clear": True, "tries": 1}]
    answers = answers or [("ok", {"rank": 1, "cause": "data"}), ("ok", {"rank": None, "cause": None})]
    return {2: {"recorded": recorded, "answers": answers}}


def test_a_right_answer_on_a_recording_that_does_not_show_its_design_fails_saying_so():
    judges.straggler_case(_Case(), _evidence("loader"), 2, "loader")  # clear: the right answer passes
    with pytest.raises(_Failed) as failed:
        judges.straggler_case(_Case(), _evidence("loader", clear=False), 2, "loader")
    assert "rerun the check" in failed.value.args[0]


def test_the_same_verdict_for_every_recording_passes_no_case_and_a_wrong_one_is_diagnosed():
    same = [("ok", {"rank": None, "cause": None})] * 2
    with pytest.raises(_Failed) as failed:
        judges.straggler_case(_Case(), _evidence("balanced", answers=same), 2, "balanced")
    assert "same verdict" in failed.value.args[0]
    waiting = [("ok", {"rank": 0, "cause": "compute"}), ("ok", {"rank": None, "cause": None})]
    with pytest.raises(_Failed) as failed:
        judges.straggler_case(_Case(), _evidence("loader", answers=waiting), 2, "loader")
    assert judges.WRONG_STRAGGLER["waits longest"] in failed.value.args[0]
