"""mgpu-lab grade: a sandbox per notebook, per-notebook timeout, points kept when a notebook breaks.

Hostile submissions are in test_grade_hostile.py; the sandbox's parts in test_sandbox.py.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import nbformat
import psutil
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from mgpu_lab.cli import main
from mgpu_lab.course.grade import grade_notebook

pytestmark = pytest.mark.timeout(300)

RIGHT = """
import torch
from mgpu_lab import check
def pick_device(index=None):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index is None:
        return torch.device("cuda", 0) if n else torch.device("cpu")
    if not 0 <= index < n:
        raise ValueError(f"{n} GPUs visible")
    return torch.device("cuda", index)
"""
STUB = """
import torch
from mgpu_lab import check
def pick_device(index=None):
    raise NotImplementedError("write your solution here")
"""
CHECK = "check('01.pick_device', pick_device)"


def _nb(tmp_path, name, *sources):
    path = tmp_path / name
    nbformat.write(new_notebook(cells=[new_code_cell(s) for s in sources]), path)
    return path


def _by_id(grade):
    return {e.exercise: e for e in grade.exercises}


def test_a_hanging_notebook_keeps_earlier_points_and_says_where_it_stopped(tmp_path):
    path = _nb(tmp_path, "01_hang.ipynb", RIGHT, CHECK, "import time\ntime.sleep(1000)")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    g = grade_notebook(path, timeout=60)  # the kernel, torch and the sandbox start inside this budget
    assert _by_id(g)["01.pick_device"].points == 6
    assert not g.completed and "stopped after 60 s" in g.reason and "cell 2" in g.reason
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_a_notebook_that_kills_its_kernel_keeps_earlier_points(tmp_path):
    g = grade_notebook(_nb(tmp_path, "01_dies.ipynb", RIGHT, CHECK, "import os\nos._exit(1)", CHECK),
                       timeout=120)
    assert _by_id(g)["01.pick_device"].points == 6
    assert not g.completed and g.reason == "the kernel died while running cell 2"


def test_cli_scores_right_answers_stubs_and_unchecked_exercises_in_a_table_json_and_csv(tmp_path, capsys):
    right = _nb(tmp_path, "01_right.ipynb", RIGHT, CHECK)
    stub = _nb(tmp_path, "01_stub.ipynb", STUB, "pick_device()", CHECK)  # an error cell does not stop grading
    broken = tmp_path / "01_broken.ipynb"
    broken.write_bytes(b"\x89PNG not a notebook {")
    out_json, out_csv, out_gs = tmp_path / "g.json", tmp_path / "g.csv", tmp_path / "gradescope"
    assert main(["grade", str(right), str(stub), str(broken), "--json", str(out_json), "--csv", str(out_csv),
                 "--gradescope", str(out_gs), "--results", str(tmp_path / "kept"), "--jobs", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("sandbox: ") and f"{right}: 6/18" in text and f"{stub}: 0/18" in text
    data = json.loads(out_json.read_text())
    assert [(d["points"], d["max_points"], d["completed"], d["reason"]) for d in data[:2]] == [
        (6, 18, True, ""), (0, 18, True, "")]
    assert (data[2]["points"], data[2]["max_points"], data[2]["completed"]) == (0, 18, False)
    assert data[2]["reason"].startswith("the notebook could not be read: ")
    statuses = [{e["exercise"]: (e["points"], e["status"]) for e in d["exercises"]} for d in data]
    assert statuses[0] == {"01.pick_device": (6, "passed"), "01.train_step": (0, "not checked"),
                           "01.visible_devices_env": (0, "not checked")}
    assert statuses[1]["01.pick_device"] == (0, "not attempted")
    rows = list(csv.DictReader(out_csv.open()))
    assert {"notebook": str(stub), "exercise": "01.pick_device", "status": "not attempted"}.items() <= rows[4].items()
    assert rows[-1]["exercise"] == "TOTAL" and rows[-1]["points"] == "0" and rows[-1]["completed"] == "False"
    gs = {d.name: json.loads((d / "results.json").read_text()) for d in out_gs.iterdir()}
    assert set(gs) == {"01_right", "01_stub", "01_broken"}
    assert (gs["01_right"]["score"], gs["01_stub"]["score"], gs["01_broken"]["score"]) == (6, 0, 0)
    tests = gs["01_right"]["tests"]
    assert sum(t["max_score"] for t in tests) == 18 and sum(t["score"] for t in tests) == 6
    cases = [t for t in tests if t["name"].startswith("01.pick_device #")]
    assert len(cases) == 6 and all(t["score"] == t["max_score"] == 1 for t in cases)
    hidden = [t for t in cases if "hidden case" in t["name"]]
    assert len(hidden) == 2 and all(t["visibility"] == "after_published" and t["output"] == "" for t in hidden)
    assert all(t["visibility"] == "visible" for t in tests if t not in hidden)
    assert {t["name"]: t["output"] for t in gs["01_stub"]["tests"]}["01.pick_device: not attempted"].startswith(
        "not attempted")


def test_whatever_breaks_the_grader_on_one_notebook_gives_it_zero_with_the_reason_and_the_batch_goes_on(
        tmp_path, monkeypatch):
    import mgpu_lab.course.grade as grade_module
    from mgpu_lab.course.grade import NotebookGrade, grade

    first, second = _nb(tmp_path, "01_a.ipynb", "1"), _nb(tmp_path, "01_b.ipynb", "2")
    missing = tmp_path / "01_gone.ipynb"

    def fake(path, timeout, limits, expected, *_slot_and_skips):
        if path == first:
            raise KeyError("points")  # as a malformed record once broke the whole batch
        return NotebookGrade(str(path), [], reason="")

    monkeypatch.setattr(grade_module, "_grade", fake)
    a, b, gone = grade([first, second, missing], timeout=5)
    assert (a.points, a.max_points, a.completed) == (0, 18, False)
    assert {e.status for e in a.exercises} == {"not judged"}
    assert a.reason.startswith("the grader could not judge this notebook (KeyError: 'points')")
    assert b.completed and b.path == str(second)
    assert not gone.completed and "no notebook at" in gone.reason


def test_failed_visible_cases_tell_gradescope_what_came_and_why_hidden_ones_only_fail():
    from mgpu_lab.course.grade import ExerciseGrade, NotebookGrade
    from mgpu_lab.course.gradescope import results_json

    cases = [{"name": "shown", "passed": False, "hidden": False, "expected": "cpu", "got": "cuda:0", "hint": "no GPU"},
             {"name": "secret", "passed": False, "hidden": True, "expected": "cuda:3", "got": "cpu", "hint": "h"}]
    g = NotebookGrade("x/01_a.ipynb", [ExerciseGrade("01.pick_device", 0, 2, "failed", "", cases)],
                      completed=False, reason="stopped after 5 s")
    out = results_json(g)
    assert out["score"] == 0 and out["output"] == "0/2 (stopped after 5 s)"
    shown, secret = out["tests"]
    assert shown["output"] == "expected: cpu\ngot:      cuda:0\nhint: no GPU" and shown["visibility"] == "visible"
    assert secret == {"name": "01.pick_device #2: hidden case: secret", "score": 0, "max_score": 1, "output": "",
                      "visibility": "after_published"}


@pytest.mark.parametrize("bad", ["-5", "0", "nan", "inf", "soon"])
def test_the_timeout_must_be_a_positive_finite_number(tmp_path, capsys, bad):
    from mgpu_lab.course.grade import grade

    path = _nb(tmp_path, "01_x.ipynb", "1")
    with pytest.raises(SystemExit) as info:
        main(["grade", str(path), "--timeout", bad])
    assert info.value.code == 2 and "positive finite number of seconds" in capsys.readouterr().err
    with pytest.raises(ValueError, match="positive finite"):
        grade([path], timeout=float(bad) if bad != "soon" else "soon")


def test_cli_names_a_missing_notebook(tmp_path, capsys):
    assert main(["grade", str(tmp_path / "nope.ipynb"), "--results", str(tmp_path / "kept")]) == 2
    assert "no such notebook" in capsys.readouterr().err


def test_a_real_lesson_scores_full_marks_as_solution_and_zero_as_student_copy():
    root = Path(__file__).resolve().parents[2]
    solution = grade_notebook(root / "solutions" / "03_data_parallel.ipynb", timeout=240)
    student = grade_notebook(root / "notebooks" / "03_data_parallel.ipynb", timeout=240)
    assert solution.completed and student.completed, (solution.reason, student.reason)
    assert {e.exercise for e in solution.exercises} == {"03.split_batch", "03.data_parallel_forward"}
    assert solution.points == solution.max_points > 0
    assert all(e.status == "passed" for e in solution.exercises)
    assert student.points == 0 and student.max_points == solution.max_points
    assert all(e.status == "not attempted" for e in student.exercises)
