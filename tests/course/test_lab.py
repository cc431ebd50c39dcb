"""`mgpu-lab lab`: the course's notebooks copied into a learner's folder once, never over an edited copy."""
from __future__ import annotations

from pathlib import Path

import pytest

from mgpu_lab import cli
from mgpu_lab.core import shipped
from mgpu_lab.course import lab

ROOT = Path(__file__).resolve().parents[2]
STUDENT = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_the_first_run_copies_every_student_notebook_as_it_is(tmp_path):
    report = lab.copy_notebooks(tmp_path / "mine")
    assert report.copied == STUDENT and len(STUDENT) >= 14 and report.kept == report.same == []
    for name in STUDENT:
        assert (tmp_path / "mine" / name).read_bytes() == (ROOT / "notebooks" / name).read_bytes(), name
    assert not list((tmp_path / "mine").glob("*solution*"))


def test_a_second_run_keeps_an_edited_copy_says_so_and_how_to_get_a_fresh_one(tmp_path):
    folder = tmp_path / "mine"
    lab.copy_notebooks(folder)
    edited, deleted = folder / STUDENT[0], folder / STUDENT[1]
    edited.write_text('{"cells": "my answers"}')
    deleted.unlink()
    report = lab.copy_notebooks(folder)
    assert edited.read_text() == '{"cells": "my answers"}'  # never overwritten
    assert report.kept == [STUDENT[0]] and report.copied == [STUDENT[1]] and len(report.same) == len(STUDENT) - 2
    said = "\n".join(report.lines())
    assert f"kept your copy of {STUDENT[0]}" in said and f"rename or delete {edited}" in said, said
    assert f"mgpu-lab lab {folder}` again" in said, said


def test_a_folder_that_is_a_file_or_a_source_without_notebooks_is_refused(tmp_path):
    (tmp_path / "taken").write_text("")
    with pytest.raises(ValueError, match="is not a folder"):
        lab.copy_notebooks(tmp_path / "taken")
    with pytest.raises(ValueError, match="holds no notebook"):
        lab.copy_notebooks(tmp_path / "new", source=tmp_path)


def test_the_installed_copy_comes_before_the_clone_s(tmp_path, monkeypatch):
    assert shipped.course_dir("notebooks") == ROOT / "notebooks"  # a clone: nothing packaged inside mgpu_lab/
    (tmp_path / "_course" / "notebooks").mkdir(parents=True)
    monkeypatch.setattr(shipped, "PACKAGED", tmp_path / "_course")
    assert shipped.course_dir("notebooks") == tmp_path / "_course" / "notebooks"
    assert shipped.course_dir("scripts") == ROOT / "scripts"
    monkeypatch.setattr(shipped, "CLONE", tmp_path)
    with pytest.raises(FileNotFoundError, match="reinstall mgpu-lab"):
        shipped.course_dir("scripts")
    with pytest.raises(ValueError, match="ships notebooks and scripts"):
        shipped.course_dir("solutions")


def test_the_command_copies_then_starts_jupyterlab_with_the_options_given(tmp_path, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(lab, "start_lab", lambda folder, options: started.append((folder, options)) or 0)
    folder = tmp_path / "nb"
    assert cli.main(["lab", str(folder), "--no-browser", "--port", "8899", "--", "--ServerApp.token=t"]) == 0
    assert started == [(folder, ["--port=8899", "--no-browser", "--ServerApp.token=t"])]
    assert f"copied {len(STUDENT)} notebook(s) into {folder}" in capsys.readouterr().out
    assert cli.main(["lab", str(folder), "--no-start"]) == 0 and len(started) == 1
    assert f"{len(STUDENT)} notebook(s) already in {folder}, as installed" in capsys.readouterr().out


def test_the_default_folder_and_options_after_dashes_only_for_lab(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["lab", "--no-start"]) == 0
    assert sorted(p.name for p in (tmp_path / "mgpu-lab-notebooks").iterdir()) == STUDENT
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--", "--foo"])


def test_jupyterlab_runs_with_this_python_on_the_folder_and_as_root_with_allow_root(monkeypatch):
    import sys

    monkeypatch.setattr(lab.os, "getuid", lambda: 1000)
    assert lab.lab_command("/tmp/nb", ["--no-browser"]) == [
        sys.executable, "-m", "jupyterlab", "--ServerApp.root_dir=/tmp/nb", "--no-browser"]
    monkeypatch.setattr(lab.os, "getuid", lambda: 0)
    assert "--allow-root" in lab.lab_command("/tmp/nb")
