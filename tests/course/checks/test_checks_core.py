"""The checker framework itself, with a demo exercise registered only here."""
from __future__ import annotations

import json
import os
import time

import pytest

from mgpu_lab import check
from mgpu_lab.course.checks import _core, exercise, exercises

pytestmark = pytest.mark.timeout(180)


@exercise("99.double", points=3, description="double(x) returns 2 * x")
def _double(t, double):
    with t.case("double(2) is 4", hint="multiply by two"):
        t.equal(t.call(double, 2), 4)
    with t.case("double(-3) is -6", hint="negative numbers too"):
        t.equal(t.call(double, -3), -6)
    with t.case("double(0.5) is 1.0", hidden=True):
        t.close(t.call(double, 0.5), 1.0)


@exercise("99.weighted", points=5, description="double(x), the negative case worth 3 points")
def _weighted(t, double):
    with t.case("double(2) is 4"):
        t.equal(t.call(double, 2), 4)
    with t.case("double(-3) is -6", points=3):
        t.equal(t.call(double, -3), -6)
    # the last point's case is never reached: the check pads it as "(not reached)", worth one


@exercise("99.practice", points=1, description="double(x), the negative case practice only")
def _practice(t, double):
    with t.case("double(2) is 4"):
        t.equal(t.call(double, 2), 4)
    with t.case("double(-3) is -6", points=0):
        t.equal(t.call(double, -3), -6)


def right(x):
    return 2 * x


def wrong(x):
    return x + 2


def todo(x):
    raise NotImplementedError("write it")


def crashes(x):
    os._exit(7)


def hangs(x):
    time.sleep(1000)


def raises(x):
    raise KeyError("oops")


def test_right_answer_passes_with_full_points():
    r = check("99.double", right)
    assert (r.passed, r.points, r.max_points, r.status) == (True, 3, 3, "passed")
    assert r.summary() == "99.double: 3/3 points · passed"
    assert "PASS  hidden case: double(0.5) is 1.0" in r.messages


def test_wrong_answer_shows_expected_got_and_hint_but_not_hidden_details():
    r = check("99.double", wrong)
    assert (r.passed, r.points) == (False, 1)  # x + 2 equals 2 * x only for x = 2
    text = str(r)
    assert "FAIL  double(-3) is -6" in text and "expected: -6" in text and "got:      -1" in text
    assert "hint: negative numbers too" in text
    assert "FAIL  hidden case: double(0.5) is 1.0" in text
    assert "2.5" not in text  # the hidden case's values stay hidden
    html = r._repr_html_()
    assert "99.double: 1/3 points · not yet" in html and "negative numbers too" in html and "2.5" not in html


def test_a_case_worth_several_points_counts_them_and_says_so():
    r = check("99.weighted", wrong)  # x + 2: right for 2 only
    assert (r.points, r.max_points, [c.points for c in r.cases]) == (1, 5, [1, 3, 1]), r
    assert "FAIL  double(-3) is -6 (3 points)" in str(r) and "double(-3) is -6 (3 points)" in r._repr_html_()
    assert r.cases[2].name == "(not reached)" and "PASS  double(2) is 4\n" in str(r) + "\n"
    assert check("99.weighted", right).points == 4  # the unreached case is never earned


def test_a_practice_case_earns_nothing_but_a_failed_one_still_says_not_yet():
    r = check("99.practice", wrong)  # right for 2 only: the paid case passes, the practice case fails
    assert (r.points, r.max_points, r.status) == (1, 1, "failed"), r
    assert r.summary() == "99.practice: 1/1 points · not yet"
    assert "FAIL  double(-3) is -6 (practice, no points)" in str(r)
    assert "(practice, no points)" in r._repr_html_()
    assert (check("99.practice", right).status, check("99.practice", right).points) == ("passed", 1)


def test_not_implemented_is_not_attempted_without_traceback():
    r = check("99.double", todo)
    assert (r.status, r.points, r.max_points) == ("not attempted", 0, 3)
    assert "Traceback" not in str(r)


def test_a_crash_is_a_failed_case_and_the_caller_survives():
    r = check("99.double", crashes)
    assert r.points == 0 and r.status == "failed"
    assert "died without raising (exit code 7)" in r.cases[0].got


def test_an_exception_names_its_type_and_message():
    r = check("99.double", raises)
    assert r.cases[0].got.startswith("your code raised KeyError: 'oops'")


def test_a_hang_is_a_failed_case_within_bounded_time(monkeypatch):
    monkeypatch.setattr(_core, "CALL_TIMEOUT", 3.0)
    start = time.monotonic()
    r = check("99.double", hangs)
    assert time.monotonic() - start < 3 * (3 + 5)
    assert r.points == 0 and "no answer within 3 s" in r.cases[0].got and "hangs" in r.cases[0].hint


def test_wrong_arguments_and_unknown_ids_are_clear_errors():
    with pytest.raises(TypeError, match=r"check\('99.double', \.\.\.\) takes your double"):
        check("99.double")
    with pytest.raises(ValueError, match="no exercise '99.tripel'; known ids: 99.double"):
        check("99.tripel", right)


def test_exercises_lists_every_id_with_points_and_description():
    listed = {e.id: e for e in exercises()}
    assert listed["99.double"].points == 3 and listed["99.double"].description == "double(x) returns 2 * x"
    assert {"01.pick_device", "01.train_step", "01.visible_devices_env"} <= set(listed)
    assert all(e.points >= 1 and e.description for e in listed.values())


def test_bad_registrations_are_rejected():
    with pytest.raises(ValueError, match="must look like 'NN.name'"):
        exercise("1.bad", 1, "x")
    with pytest.raises(ValueError, match="points=0 must be >= 1"):
        exercise("98.bad", 0, "x")


def test_in_a_graded_notebook_check_saves_the_answers_by_value_and_judges_nothing(tmp_path, monkeypatch):
    import cloudpickle

    folder = tmp_path / "answers"
    monkeypatch.setenv("MGPU_LAB_GRADE_ANSWERS", str(folder))
    called = []
    scope = {"called": called}
    exec("def mine(x):\n    called.append(x)\n    return 2 * x\n", scope)  # as a notebook cell defines it
    result = check("99.double", scope["mine"])
    unpicklable = check("99.double", double=lambda x, lock=__import__("threading").Lock(): 2 * x)
    assert (result.status, result.points, str(result)) == (
        "recorded", 0, "99.double: recorded for grading\n  recorded for grading: the grader runs this check "
                      "after the notebook")
    assert called == [], "the answer ran in the kernel"
    rows = [json.loads(line) for line in (folder / "manifest.jsonl").read_text().splitlines()]
    assert rows[0] == {"exercise": "99.double", "file": "0.pkl"}
    assert rows[1]["exercise"] == "99.double" and "lock" in rows[1]["error"] and unpicklable.status == "recorded"
    del scope["mine"]  # by value: the saved function needs nothing of the notebook that made it
    saved = cloudpickle.loads((folder / "0.pkl").read_bytes())
    assert list(saved) == ["double"] and saved["double"](4) == 8 and called == []  # it has its own copy
    with pytest.raises(TypeError, match="takes your double"):
        check("99.double")  # wrong arguments are still the learner's error at once


def test_a_check_imports_only_its_own_lessons_checkers():
    # In a fresh interpreter, as in a fresh kernel: lesson 01's check must not pay for FSDP, DCP or elastic.
    import re
    import subprocess
    import sys
    from pathlib import Path

    import mgpu_lab.course.checks as checks_pkg

    code = (
        "import sys\n"
        "from mgpu_lab import check\n"
        "def pick_device(index=None):\n"
        "    raise NotImplementedError\n"
        "result = check('01.pick_device', pick_device)\n"
        "print(result.status)\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('mgpu_lab'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    status, modules = out.stdout.strip().splitlines()[-2:]
    assert "not attempted" in status
    loaded = set(modules.split())
    lessons = {m.split(".")[3] for m in loaded if re.match(r"mgpu_lab\.course\.checks\.l\d\d\b", m)}
    assert lessons == {"l01"}, lessons
    heavy = {"mgpu_lab.sharding.fsdp", "mgpu_lab.sharding.distcp", "mgpu_lab.launcher.elastic", "mgpu_lab.failures.hangs"}
    assert not loaded & heavy, loaded
    # and the listing of every exercise still finds every lesson that has checks (a folder lNN)
    listed = subprocess.run([sys.executable, "-c", "from mgpu_lab import exercises\n"
                             "print(sorted({e.lesson for e in exercises()}))"], capture_output=True, text=True,
                            timeout=300)
    folders = Path(checks_pkg.__file__).parent.glob("l[0-9][0-9]")
    assert listed.stdout.strip() == str(sorted(p.name[1:] for p in folders)), listed.stderr


def test_a_failure_s_message_to_the_learner_leaves_out_cpp_stack_traces_and_c10d_warnings():
    from mgpu_lab.launcher.errors import LaunchError

    output = "\n".join([
        "step 3 loss 0.52",
        "[W1127 16:01:02.123456 socket.cpp:767] [c10d] The hostname of the client socket cannot be retrieved. err=-3",
        "Exception raised from recvBytes at ../torch/csrc/distributed/c10d/Utils.hpp:670 (most recent call first):",
        "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9c (0x7f in libc10.so)",
        "frame #1: <unknown function> + 0x5e1c (0x7f in libtorch_cpu.so)",
        "resumed from step 4"])
    exc = LaunchError("rank 1/2 raised RuntimeError: the store went away", exc_type="RuntimeError", output=output)
    said = _core._error_text(exc)
    assert "step 3 loss 0.52 | resumed from step 4" in said, said
    assert "frame #" not in said and "c10d" not in said and "Exception raised from" not in said, said
