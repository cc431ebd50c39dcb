"""Grading a class: N at a time in sandboxes of their own, kept grades, the progress line, the class summary."""
from __future__ import annotations

import io
import os
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from mgpu_lab.cli import main
from mgpu_lab.course import grade as grade_module
from mgpu_lab.course.batch import Progress, Store, check_jobs, default_jobs, run_batch
from mgpu_lab.course.grade import ExerciseGrade, NotebookGrade, grade
from mgpu_lab.course.isolation import protections, slot_user
from mgpu_lab.course.summary import plot, summarize, table

pytestmark = pytest.mark.timeout(300)

RIGHT = """
import os, torch
from mgpu_lab import check
def pick_device(index=None):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index is None:
        return torch.device("cuda", 0) if n else torch.device("cpu")
    if not 0 <= index < n:
        raise ValueError(f"{n} GPUs visible")
    return torch.device("cuda", index)
def visible_devices_env(ids):
    raise ValueError(f"uid {os.getuid()}")  # tells the test which user graded it
check('01.pick_device', pick_device)
check('01.visible_devices_env', visible_devices_env)
"""


def _nb(folder: Path, name: str, *sources: str) -> Path:
    path = folder / name
    nbformat.write(new_notebook(cells=[new_code_cell(s) for s in sources]), path)
    return path


def _uid(g: NotebookGrade) -> str:
    env = next(e for e in g.exercises if e.exercise == "01.visible_devices_env")
    return next(c["got"] for c in env.cases if "uid" in c["got"]).removeprefix("ValueError: ")


def test_two_at_once_grade_as_one_at_a_time_each_sandbox_its_own_user(tmp_path):
    paths = [_nb(tmp_path, f"01_{name}.ipynb", RIGHT) for name in ("ada", "bob")]
    one = grade(paths, timeout=240, jobs=1)
    two = grade(paths, timeout=240, jobs=2)
    points = [[(e.exercise, e.points, e.status) for e in g.exercises] for g in one]
    assert points == [[(e.exercise, e.points, e.status) for e in g.exercises] for g in two]
    assert [g.path for g in two] == [str(p) for p in paths]
    assert one[0].exercises[0].points == 6 and all(g.completed for g in one + two)
    if protections().uid is not None:  # root: a user per slot, so no two sandboxes share a process limit
        assert _uid(one[0]) == _uid(one[1]) == f"uid {protections().uid}"
        assert {_uid(g) for g in two} == {f"uid {protections().uid}", f"uid {slot_user(1)[1]}"}


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
    first = grade([sub], timeout=240, store=store)
    assert first[0].exercises[0].points == 6 and len(list(store.glob("*.json"))) == 1

    graded = []

    def fake(path, timeout, limits, *, slot, all_cells):
        graded.append(Path(path).name)
        return NotebookGrade(str(path), [ExerciseGrade("01.pick_device", 0, 6, "failed")])

    monkeypatch.setattr(grade_module, "grade_notebook", fake)
    again = grade([sub], timeout=240, store=store)
    assert graded == [] and again[0] == first[0]
    renamed = tmp_path / "01_ada_late.ipynb"
    renamed.write_bytes(sub.read_bytes())
    assert grade([renamed], timeout=240, store=store)[0].path == str(renamed) and graded == []
    other_lesson = tmp_path / "02_ada.ipynb"
    other_lesson.write_bytes(sub.read_bytes())
    grade([other_lesson], timeout=240, store=store)
    assert graded == ["02_ada.ipynb"]
    sub.write_text(sub.read_text().replace("return torch.device", "return  torch.device"))
    grade([sub], timeout=240, store=store)
    assert graded[-1] == "01_ada.ipynb"
    grade([renamed], timeout=240, store=store, force=True)
    assert graded[-1] == "01_ada_late.ipynb" and len(graded) == 3
    kept = grade([renamed], timeout=240, store=store)
    assert kept[0].exercises[0].points == 0 and len(graded) == 3, "the forced grade is the one kept"
    grade([renamed], timeout=120, store=store)
    assert len(graded) == 4, "another timeout is another way of grading: graded again"


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


def test_cli_prints_the_class_summary_and_draws_it(tmp_path, capsys):
    subs = [_nb(tmp_path, f"01_{n}.ipynb", RIGHT) for n in ("ada", "bob")]
    _nb(tmp_path, "01_cat.ipynb", "from mgpu_lab import check\ncheck('01.pick_device', lambda i=None: 'cpu')")
    subs.append(tmp_path / "01_cat.ipynb")
    png = tmp_path / "class.png"
    assert main(["grade", *map(str, subs), "--results", str(tmp_path / "kept"), "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    assert "class summary" in captured.out and "01.pick_device                    3      2   67%" in captured.out
    assert png.exists() and "grading: 3/3 done" in captured.err
    assert main(["grade", *map(str, subs), "--results", str(tmp_path / "kept")]) == 0
    assert "grading: 3/3 done (3 kept from an earlier run)" in capsys.readouterr().err
