"""Grading as a SLURM job array (mgpu_lab.course.slurm_grade) on the project's local SLURM cluster.

Two compute nodes (network namespaces, real slurmctld and slurmd), a class of
three notebooks: the array's points equal a local run's and the Gradescope
bundle's, exercise by exercise; a cancelled task costs only its submission,
which a re-run (and only it) grades; an interrupted run reports "not graded"
(never 0) and a re-run picks up its array. Messages: no cluster, a silent node,
``--parallel`` and its old name ``--nodes``.
"""
from __future__ import annotations

import _thread
import csv
import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from mgpu_lab.cli import main
from mgpu_lab.cluster import slurm_local
from mgpu_lab.course.checks import exercises, get
from mgpu_lab.course.grade import grade, write_csv, write_json
from mgpu_lab.course.slurm_grade import Slurm, array_script, grade_on_slurm
from mgpu_lab.course.summary import summarize
from submissions import (CHECK_PICK_DEVICE, PICK_DEVICE, instructor_folder, notebook, peek_notebook,
                         readable_by_anyone)
from test_autograder import THIS_VENV, _layout, _run_autograder

ROOT = Path(__file__).resolve().parents[2]
LESSON_01 = sum(e.points for e in exercises("01"))  # what lesson 01's solution scores


def test_the_array_script_asks_for_one_node_per_task_and_runs_the_task_entry(tmp_path):
    text = array_script(tmp_path / "job", tasks=4, timeout=300, parallel=2)
    assert "#SBATCH --array=0-3%2" in text and "#SBATCH --nodes=1" in text and "--partition" not in text
    assert "#SBATCH --time=20" in text  # 2 x 300 s + 600 s, in minutes
    assert f"-m mgpu_lab.course.slurm_grade {tmp_path / 'job'} \"$SLURM_ARRAY_TASK_ID\"" in text
    with pytest.raises(ValueError, match="chunk=0"):
        grade_on_slurm([], chunk=0, slurm=object())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    problem = slurm_local.problem()
    if problem:
        pytest.skip(f"no local SLURM cluster here: {problem}")
    state = tmp_path_factory.mktemp("slurm") / "state"
    c = slurm_local.up(2, state=state, echo=False)
    yield c
    slurm_local.down(state, quiet=True)


def _cancel_when_running(slurm: Slurm, task: int, done: list) -> None:
    """Cancel array task ``task`` of the grading job while it is still pending."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        out = slurm.run(["squeue", "-h", "-r", "-n", "mgpu-lab-grade", "-o", "%F %K %T"], check=False).stdout
        rows = [line.split() for line in out.splitlines() if line.strip()]
        if any(r[2] == "RUNNING" for r in rows) and any(r[1] == str(task) and r[2] == "PENDING" for r in rows):
            slurm.run(["scancel", f"{rows[0][0]}_{task}"])
            done.append(task)
            return
        time.sleep(0.3)


@pytest.mark.root
@pytest.mark.slow
def test_a_class_scores_the_same_on_two_nodes_here_and_through_gradescope_and_a_re_run_grades_a_cancelled_task(
        cluster, tmp_path):
    paths = [tmp_path / "01_solution.ipynb", tmp_path / "01_student.ipynb"]
    shutil.copy(ROOT / "solutions" / "01_devices.ipynb", paths[0])
    shutil.copy(ROOT / "notebooks" / "01_devices.ipynb", paths[1])
    paths.append(notebook(tmp_path, "01_pick.ipynb", PICK_DEVICE, CHECK_PICK_DEVICE))
    slurm = Slurm(local=True, state=cluster.state)
    store = tmp_path / "grades"

    cancelled: list = []
    watcher = threading.Thread(target=_cancel_when_running, args=(slurm, 2, cancelled))
    watcher.start()
    first = grade_on_slurm(paths, timeout=300, store=store, parallel=1, slurm=slurm)
    watcher.join()
    assert cancelled == [2]
    assert [g.completed for g in first] == [True, True, False]
    assert "its SLURM task" in first[2].reason and "was cancelled before it started" in first[2].reason, first[2].reason
    assert [g.points for g in first[:2]] == [LESSON_01, 0]

    before = set((store / "slurm").iterdir())
    again = grade_on_slurm(paths, timeout=300, store=store, slurm=slurm)
    new_jobs = set((store / "slurm").iterdir()) - before
    assert len(new_jobs) == 1
    plan = (new_jobs.pop() / "plan.json").read_text()
    assert "01_pick.ipynb" in plan and "01_solution" not in plan  # only what was missing went out again

    local = grade(paths, timeout=300, jobs=2)
    assert [g.points for g in again] == [g.points for g in local] == [LESSON_01, 0, get("01.pick_device").points]
    assert [[e.status for e in g.exercises] for g in again] == [[e.status for e in g.exercises] for g in local]

    # The same class through the Gradescope bundle, one submission per run as Gradescope runs it: the same
    # points, exercise by exercise, as on the cluster and here.
    for path, on_slurm, here in zip(paths, again, local):
        root = _layout(tmp_path / f"gs-{path.stem}", ["01"], {path.name: path})
        results = _run_autograder(root, THIS_VENV)
        by_exercise: dict = {}
        for t in results["tests"]:
            exercise = t["name"].split(":")[0].split(" #")[0]
            by_exercise[exercise] = by_exercise.get(exercise, 0) + t["score"]
        want = {e.exercise: e.points for e in here.exercises}
        assert by_exercise == want == {e.exercise: e.points for e in on_slurm.exercises}, (path.name, results["output"])
        assert results["score"] == here.points, (path.name, results["output"])


def test_with_no_cluster_up_grading_says_so_instead_of_slurm_s_dns_errors(tmp_path, monkeypatch, capsys):
    if shutil.which("sbatch") is None:
        pytest.skip("no SLURM client commands here (slurm-wlm)")
    monkeypatch.setattr(slurm_local, "STATE", tmp_path / "no-cluster")  # no local cluster up, SLURM's on PATH
    path = notebook(tmp_path, "01_pick.ipynb", PICK_DEVICE, CHECK_PICK_DEVICE)
    assert main(["grade", "--slurm", str(path), "--results", str(tmp_path / "grades")]) == 1
    err = capsys.readouterr().err
    assert "no cluster: start one with `mgpu-lab slurm up`" in err, err
    assert "res_nsearch" not in err and "DNS" not in err, err
    assert not (tmp_path / "grades" / "slurm").exists()  # nothing was submitted


class _Queue:
    """A stand-in for SLURM's commands: one array task RUNNING on node1 for ``seconds``, then gone."""

    def __init__(self, seconds: float, beat: Path | None = None):
        self.until, self.beat = time.monotonic() + seconds, beat

    def run(self, argv, cwd=None, check=True):
        if self.beat is not None:
            self.beat.touch()  # a task alive on its node
        running = argv[0] == "squeue" and time.monotonic() < self.until
        return subprocess.CompletedProcess(argv, 0, "0 RUNNING node1\n" if running else "", "")


def test_a_running_task_whose_node_went_silent_is_named_within_a_bounded_time(tmp_path, monkeypatch, capsys):
    from mgpu_lab.course import slurm_grade

    monkeypatch.setattr(slurm_grade, "POLL", 0.02)
    monkeypatch.setattr(slurm_grade, "SILENT", 0.3)
    (tmp_path / "alive").mkdir()
    slurm_grade._wait(_Queue(1.0, beat=tmp_path / "alive" / "alive-0"), "7", 1, True, tmp_path / "alive")
    assert "no sign of life" not in capsys.readouterr().err  # a task that beats is not named
    start = time.monotonic()
    slurm_grade._wait(_Queue(1.0), "8", 1, True, tmp_path)
    err = capsys.readouterr().err
    assert "task 0 on node1 has given no sign of life" in err and "its node may have died" in err, err
    assert err.count("no sign of life") == 1 and time.monotonic() - start < 5


def test_the_array_s_tasks_at_once_is_parallel_and_nodes_is_its_deprecated_alias(tmp_path, monkeypatch, capsys):
    from mgpu_lab.course import slurm_grade

    seen = []
    monkeypatch.setattr(slurm_grade, "grade_on_slurm", lambda paths, **kw: seen.append(kw["parallel"]) or [])
    path = notebook(tmp_path, "01_pick.ipynb", PICK_DEVICE, CHECK_PICK_DEVICE)
    assert main(["grade", "--slurm", str(path), "--parallel", "3"]) == 0
    assert "deprecated" not in capsys.readouterr().err
    assert main(["grade", "--slurm", str(path), "--nodes", "2"]) == 0
    assert seen == [3, 2]
    assert "--nodes is deprecated" in capsys.readouterr().err


def _interrupt_once_submitted(store: Path, done: list) -> None:
    """Ctrl-C the grading run (the main thread) as soon as its array is in SLURM's hands."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list((store / "slurm").glob("*/job_id")):
        time.sleep(0.1)
    done.append(time.monotonic() < deadline)
    _thread.interrupt_main()


@pytest.mark.root
@pytest.mark.slow
def test_an_interrupted_run_reports_not_graded_never_zero_and_a_re_run_resumes_its_array(cluster, tmp_path):
    paths = [notebook(tmp_path, "01_right.ipynb", PICK_DEVICE, CHECK_PICK_DEVICE),
             notebook(tmp_path, "01_blank.ipynb", "x = 1", CHECK_PICK_DEVICE)]
    slurm = Slurm(local=True, state=cluster.state)
    store = tmp_path / "grades"
    interrupted: list = []
    watcher = threading.Thread(target=_interrupt_once_submitted, args=(store, interrupted))
    watcher.start()
    try:
        first = grade_on_slurm(paths, timeout=300, store=store, parallel=1, slurm=slurm)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped grade --slurm: no report of what was graded and what was not")
    finally:
        watcher.join()
    assert interrupted == [True]
    assert [g.graded for g in first] == [False, False], [g.reason for g in first]
    assert all("was still queued or running when this run was interrupted" in g.reason for g in first), first[0].reason
    write_csv(first, tmp_path / "g.csv")
    write_json(first, tmp_path / "g.json")
    totals = [r for r in csv.DictReader(open(tmp_path / "g.csv")) if r["exercise"] == "TOTAL"]
    assert [(r["points"], r["status"]) for r in totals] == [("", "not graded")] * 2  # not 0
    assert [g["points"] for g in json.loads((tmp_path / "g.json").read_text())] == [None, None]
    assert summarize(first) == []  # no row counts them as submissions that scored 0

    jobs = set((store / "slurm").iterdir())
    again = grade_on_slurm(paths, timeout=300, store=store, slurm=slurm)
    assert set((store / "slurm").iterdir()) == jobs  # the first array's grades, no second array
    assert [(g.graded, g.points) for g in again] == [(True, get("01.pick_device").points), (True, 0)]


@pytest.mark.root
@pytest.mark.slow
def test_a_submission_graded_on_a_node_reads_no_classmate_no_kept_grade_and_nothing_of_the_project(cluster):
    # The class, a sibling section and the kept grades in a folder anyone may read, as an instructor keeps them.
    with instructor_folder() as home:
        classmate = notebook(home / "class", "01_classmate.ipynb", PICK_DEVICE, CHECK_PICK_DEVICE)
        sibling = notebook(home / "section-b", "01_devices.ipynb", PICK_DEVICE, CHECK_PICK_DEVICE)
        store = home / ".mgpu-lab-grades"
        store.mkdir()
        (store / "0123.json").write_text('{"exercises": []}')
        targets = [classmate, sibling, store / "0123.json", home / "notes.txt"]
        assert all(readable_by_anyone(t) for t in targets)
        targets += [p for p in (ROOT / "solutions" / "01_devices.ipynb", ROOT / ".git") if readable_by_anyone(p)]
        peek = peek_notebook(home / "class", "01_peek.ipynb", targets)
        [g] = grade_on_slurm([peek], timeout=300, store=store, slurm=Slurm(local=True, state=cluster.state))
    got = {e.exercise: e.points for e in g.exercises}
    assert g.completed and got["01.pick_device"] == get("01.pick_device").points, \
        [e.note for e in g.exercises if e.note] or g.reason  # e.g. "... Invalid device string: 'read /home/...'"
