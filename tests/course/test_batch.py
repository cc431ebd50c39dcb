"""Grading a class: N at a time in sandboxes of their own, kept grades, the progress line, the class summary.

A real class is graded once, in test_grade.py; these tests take its parts one by one.
"""
from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest
from submissions import PICK_DEVICE, notebook

from mgpu_lab.cli import main
from mgpu_lab.course import grade as grade_module
from mgpu_lab.course.batch import Progress, Store, check_jobs, default_jobs, run_batch
from mgpu_lab.course.grade import ExerciseGrade, NotebookGrade, grade
from mgpu_lab.course.isolation import protections, slot_user
from mgpu_lab.course.sandbox import Sandbox
from mgpu_lab.course.summary import plot, summarize, table

pytestmark = pytest.mark.timeout(300)

RIGHT = PICK_DEVICE
_nb = notebook


@pytest.mark.root
@pytest.mark.skipif(protections().uid is None, reason="a user per sandbox needs root (CI runs as root)")
def test_each_slot_runs_its_sandbox_as_its_own_user():
    import subprocess

    for slot in (0, 1, 2):
        with Sandbox(slot=slot) as box:
            proc = box.start(["/usr/bin/id", "-u"], stdout=subprocess.PIPE)
            assert int(proc.communicate(timeout=60)[0]) == slot_user(slot)[1]


def test_slot_users_are_distinct_and_belong_to_nobody_on_this_machine():
    import pwd

    users = [slot_user(k) for k in range(4)]
    assert users[0] == (protections().user, protections().uid, protections().gid)
    if protections().uid is not None:
        uids = [u[1] for u in users]
        assert len(set(uids)) == 4
        for uid in uids[1:]:
            with pytest.raises(KeyError):
                pwd.getpwuid(uid)


def test_kept_grades_are_reused_until_the_notebook_or_its_lesson_changes_and_force_regrades(tmp_path, monkeypatch):
    sub = _nb(tmp_path, "01_ada.ipynb", RIGHT)
    store = tmp_path / "kept"
    graded = []

    def fake(path, timeout, limits, *, slot, all_cells):
        graded.append(Path(path).name)
        return NotebookGrade(str(path), [ExerciseGrade("01.pick_device", len(graded), 6, "failed")])

    monkeypatch.setattr(grade_module, "grade_notebook", fake)
    first = grade([sub], timeout=240, store=store)
    assert graded == ["01_ada.ipynb"] and len(list(store.glob("*.json"))) == 1
    again = grade([sub], timeout=240, store=store)
    assert graded == ["01_ada.ipynb"] and again[0] == first[0]
    renamed = tmp_path / "01_ada_late.ipynb"
    renamed.write_bytes(sub.read_bytes())
    assert grade([renamed], timeout=240, store=store)[0].path == str(renamed) and len(graded) == 1
    other_lesson = tmp_path / "02_ada.ipynb"
    other_lesson.write_bytes(sub.read_bytes())
    grade([other_lesson], timeout=240, store=store)
    assert graded[-1] == "02_ada.ipynb" and len(graded) == 2
    sub.write_text(sub.read_text().replace("return torch.device", "return  torch.device"))
    grade([sub], timeout=240, store=store)
    assert graded[-1] == "01_ada.ipynb" and len(graded) == 3
    grade([renamed], timeout=240, store=store, force=True)
    assert graded[-1] == "01_ada_late.ipynb" and len(graded) == 4
    kept = grade([renamed], timeout=240, store=store)
    assert kept[0].exercises[0].points == 4 and len(graded) == 4, "the forced grade is the one kept"
    grade([renamed], timeout=120, store=store)
    assert len(graded) == 5, "another timeout is another way of grading: graded again"


def _dies_on_b(path, slot):
    if Path(path).name.startswith("b"):
        os._exit(3)
    return (Path(path).name, slot)


def test_a_worker_that_dies_costs_only_its_own_submission(tmp_path):
    paths = [tmp_path / n for n in ("a1", "b", "a2", "a3")]
    out = run_batch(paths, _dies_on_b, jobs=2, failed=lambda p, why: (Path(p).name, why),
                    complete=lambda r: True, progress=False)
    assert [r[0] for r in out] == ["a1", "b", "a2", "a3"]
    assert "worker died" in out[1][1]
    assert {r[1] for r in out if r[0] != "b"} <= {0, 1}


def test_the_progress_line_counts_done_incomplete_kept_and_time_left():
    stream = io.StringIO()
    bar = Progress(4, jobs=2, stream=stream)
    bar.running = 2
    bar.finished(None, True)
    bar.finished(30.0, False)
    bar.finished(10.0, True)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "grading: 1/4 done (1 kept from an earlier run), 2 running"
    assert lines[1] == ("grading: 2/4 done (1 kept from an earlier run), 1 incomplete, 2 running, 30 s each, "
                        "about 30 s left")
    assert lines[2].endswith("20 s each, about 20 s left")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_jobs_must_be_a_whole_number_from_one(bad, tmp_path, capsys):
    with pytest.raises(ValueError, match=f"jobs={bad!r}: .* whole number >= 1 .*default is {default_jobs()}"):
        check_jobs(bad)
    if isinstance(bad, int) and not isinstance(bad, bool):
        with pytest.raises(SystemExit):
            main(["grade", str(tmp_path / "01_x.ipynb"), "--jobs", str(bad)])
        assert "whole number >= 1" in capsys.readouterr().err


def test_default_jobs_fit_the_cores_and_the_memory():
    import psutil

    jobs = default_jobs()
    assert 1 <= jobs <= len(os.sched_getaffinity(0))
    assert jobs <= max(1, psutil.virtual_memory().available // (3 << 30))


def test_store_writes_whole_files_only(tmp_path):
    store = Store(tmp_path / "kept", "salt")
    store.put("k", {"a": 1})
    assert store.get("k") == {"a": 1} and store.get("missing") is None
    (tmp_path / "kept" / "torn.json").write_text("{")
    assert store.get("torn") is None
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["k.json", "torn.json"]


# -- the class summary ----------------------------------------------------------------------
def _case(name, passed, hint="", hidden=False):
    return {"name": name, "passed": passed, "hidden": hidden, "expected": "", "got": "", "hint": hint}


def _class() -> list[NotebookGrade]:
    wrong_index = [_case("default is cuda:0", True), _case("index past the last GPU raises", False, "check n")]
    right = [_case("default is cuda:0", True), _case("index past the last GPU raises", True)]
    hidden = [_case("default is cuda:0", True), _case("x", False, hidden=True)]
    return [NotebookGrade(f"s{i}/01_devices.ipynb", [
        ExerciseGrade("01.pick_device", *(
            (2, 2, "passed", "", right) if i < 2 else (1, 2, "failed", "", wrong_index) if i < 5
            else (1, 2, "failed", "", hidden) if i < 6 else (0, 2, "not attempted", "", []))),
        ExerciseGrade("01.train_step", 0, 6, "not checked")]) for i in range(7)]


def test_the_summary_counts_pass_rates_and_the_most_common_failures():
    rows = {r.exercise: r for r in summarize(_class())}
    pick = rows["01.pick_device"]
    assert (pick.graded, pick.passed, pick.points) == (7, 2, 2 * 2 + 3 * 1 + 1)
    assert pick.common() == [("index past the last GPU raises (hint: check n)", 3), ("hidden: x", 1),
                             ("not attempted", 1)]
    assert rows["01.train_step"].common() == [("no check cell ran", 7)]
    text = table(list(rows.values()))
    assert "01.pick_device                    7      2   29%   1.1/2" in text
    assert "3x index past the last GPU raises (hint: check n)" in text and "1x hidden: x" in text


def test_the_summary_plot_is_a_png(tmp_path):
    path = plot(summarize(_class()), tmp_path / "class.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def _naps(path, slot=0):
    import time

    time.sleep(3.0 if "slow" in Path(path).name else 0.3)
    return Path(path).name


def test_the_progress_line_keeps_counting_what_runs_and_names_a_notebook_that_runs_long(monkeypatch, capsys):
    monkeypatch.setattr(Progress, "LONG", 1.0)
    monkeypatch.setattr(Progress, "TICK", 0.2)
    paths = [Path(n) for n in ("01_slow.ipynb", "01_a.ipynb", "01_b.ipynb", "01_c.ipynb")]
    out = run_batch(paths, _naps, jobs=2, failed=lambda p, why: why, complete=lambda r: True)
    assert out == [p.name for p in paths]
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("grading: ")]
    # (done, running) of each line; a line the ticker adds (something runs long) repeats the line before it,
    # and on a loaded machine every line may end "; running long: 01_slow.ipynb": both are set aside here
    counts = []
    for ln in lines:
        m = re.match(r"grading: (\d+)/4 done(?:, (\d+) running)?", ln)
        assert m, ln
        pair = (int(m[1]), int(m[2] or 0))
        if not counts or counts[-1] != pair:
            counts.append(pair)
    # two workers stay busy while four wait: 2 running after the 1st and the 2nd are done, 1 after the 3rd
    assert counts == [(0, 2), (1, 2), (2, 2), (3, 1), (4, 0)], lines
    assert any("running long: 01_slow.ipynb" in ln for ln in lines), lines
