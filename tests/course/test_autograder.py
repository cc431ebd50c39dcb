"""The Gradescope autograder (mgpu_lab.course.autograder): the bundle, and run_autograder in Gradescope's layout.

Gradescope unzips the bundle into ``/autograder/source``, runs ``setup.sh`` once and
``run_autograder`` per submission, with the submission in ``/autograder/submission``
and ``submission_metadata.json`` beside it; it reads ``/autograder/results/results.json``.
These tests lay a folder out the same way (``AUTOGRADER_ROOT``), run the bundle's
own scripts, and validate every results file against Gradescope's specification.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import jsonschema
import pytest

from mgpu_lab.course.autograder import build, results_for
from mgpu_lab.course.checks import exercises
from mgpu_lab.course.grade import ExerciseGrade, NotebookGrade
from mgpu_lab.course.checks import get
from mgpu_lab.course.sandbox import protections
from submissions import CHECK_PICK_DEVICE, PEEK, PEEK_ANSWER, PICK_DEVICE, instructor_folder, notebook, readable_by_anyone

ROOT = Path(__file__).resolve().parents[2]
LESSON_01 = sum(e.points for e in exercises("01"))  # what lesson 01's solution scores
VISIBILITY = {"enum": ["hidden", "after_due_date", "after_published", "visible"]}
# Gradescope's "Autograder Specifications": the fields of results.json this course writes, and their types.
RESULTS_SCHEMA = {
    "type": "object",
    "required": ["score", "tests"],
    "properties": {
        "score": {"type": "number"}, "execution_time": {"type": "number"}, "output": {"type": "string"},
        "visibility": VISIBILITY, "stdout_visibility": VISIBILITY,
        "tests": {"type": "array", "items": {
            "type": "object", "required": ["score", "max_score", "name"], "additionalProperties": False,
            "properties": {"score": {"type": "number"}, "max_score": {"type": "number"}, "name": {"type": "string"},
                           "output": {"type": "string"}, "visibility": VISIBILITY,
                           "status": {"enum": ["passed", "failed"]}, "number": {"type": "string"},
                           "tags": {"type": "array", "items": {"type": "string"}}}}},
    },
}


def test_the_bundle_has_gradescope_s_layout_for_the_chosen_lessons_only(tmp_path):
    out = build(tmp_path / "autograder.zip", ["4", "01"])
    with zipfile.ZipFile(out) as zf:
        names = set(zf.namelist())
        modes = {i.filename: i.external_attr >> 16 for i in zf.infolist()}
        assert zf.read("lessons.txt").decode().split() == ["01", "04"]
    for script in ("setup.sh", "run_autograder"):  # at the root, executable
        assert script in names and modes[script] & stat.S_IXUSR, script
    assert {"pyproject.toml", "constraints.txt", "README.md", "mgpu_lab/__init__.py",
            "mgpu_lab/course/autograder.py", "mgpu_lab/course/checks/l04/checkers.py"} <= names
    lessons = {n.split("/")[1][:2] for n in names if n.startswith("notebooks/")}
    assert lessons == {"01", "04"}
    assert not [n for n in names if n.startswith("solutions/") or "solution" in n.lower()]  # no answers shipped
    with pytest.raises(ValueError, match=r"\['42'\]: not lessons of this course; give some of 01, 02"):
        build(tmp_path / "x.zip", ["42"])


def _grade(path: str, points: list[tuple[int, int]], hidden_last: bool = False) -> NotebookGrade:
    exercises = []
    for k, (got, of) in enumerate(points):
        cases = [{"name": f"case {i}", "passed": i < got, "hidden": hidden_last and i == of - 1,
                  "expected": "4", "got": "5", "hint": "the likely bug"} for i in range(of)]
        exercises.append(ExerciseGrade(f"01.ex{k}", got, of, "passed" if got == of else "failed", "", cases))
    return NotebookGrade(path, exercises)


def test_results_follow_gradescope_s_specification_and_a_missing_lesson_scores_zero_with_the_reason():
    results = results_for({"01": _grade("01_x.ipynb", [(2, 2), (1, 3)], hidden_last=True)}, ["01", "02"], [],
                          "Ada Lovelace")
    jsonschema.validate(results, RESULTS_SCHEMA)
    assert results["score"] == 3 and results["output"].startswith("Ada Lovelace: 3/")
    hidden = [t for t in results["tests"] if "hidden case" in t["name"]]
    assert hidden and all(t["visibility"] == "after_published" and t["output"] == "" for t in hidden)
    missing = [t for t in results["tests"] if t["name"].startswith("02.")]
    assert missing and all(t["score"] == 0 and "no notebook of lesson 02" in t["output"] for t in missing)
    assert {t["status"] for t in results["tests"]} == {"passed", "failed"}


# -- run_autograder, as Gradescope runs it -------------------------------------------------------------------
def _layout(tmp_path: Path, lessons: list[str], files: dict[str, bytes | Path], name: str = "Ada Lovelace",
            **bundle) -> Path:
    """``tmp_path/autograder`` as Gradescope lays it out: source/ (the unzipped bundle), run_autograder,
    submission/ and submission_metadata.json."""
    root = tmp_path / "autograder"
    (root / "source").mkdir(parents=True)
    with zipfile.ZipFile(build(tmp_path / "autograder.zip", lessons, **bundle)) as zf:
        zf.extractall(root / "source")
    for script in ("setup.sh", "run_autograder"):
        (root / "source" / script).chmod(0o755)
    shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
    (root / "submission").mkdir()
    for rel, data in files.items():
        target = root / "submission" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.read_bytes() if isinstance(data, Path) else data)
    (root / "submission_metadata.json").write_text(json.dumps({"users": [{"name": name, "email": "a@b.c"}]}))
    return root


def _run_autograder(root: Path, venv: str, timeout: float = 600) -> dict:
    env = {**os.environ, "AUTOGRADER_ROOT": str(root), "MGPU_LAB_VENV": venv}
    proc = subprocess.run([str(root / "run_autograder")], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((root / "results" / "results.json").read_text())
    jsonschema.validate(results, RESULTS_SCHEMA)
    return results


THIS_VENV = str(Path(sys.executable).parent.parent)  # the quick path: the test environment's own


@pytest.fixture
def instructor():
    with instructor_folder() as top:
        yield top


@pytest.mark.slow
def test_a_student_copy_scores_zero_and_a_hostile_or_broken_submission_is_contained_with_the_reason(tmp_path,
                                                                                                   instructor):
    # The autograder's folder where anyone may read it, as /autograder is: the sandbox, not its permissions,
    # keeps the submission from the bundle's source, the project the grader was installed from, the instructor's.
    root = instructor / "autograder"
    forged = root / "results" / "results.json"
    targets = [root / "source" / "solutions" / "01_devices.ipynb", instructor / "notes.txt"]
    targets += [p for p in (ROOT / "solutions" / "01_devices.ipynb", ROOT / ".git") if readable_by_anyone(p)]
    hostile = notebook(tmp_path, "01_devices.ipynb",
                       f"import json, os\ntry:\n    os.makedirs({str(forged.parent)!r}, exist_ok=True)\n"
                       f"    json.dump({{'score': 1000, 'tests': []}}, open({str(forged)!r}, 'w'))\n"
                       "except OSError:\n    pass",
                       PEEK.format(targets=[str(t) for t in targets] if protections().namespaces else []),
                       PEEK_ANSWER, CHECK_PICK_DEVICE)
    assert _layout(instructor, ["01"], {"01_devices.ipynb": hostile}) == root
    assert readable_by_anyone(root / "source" / "mgpu_lab" / "__init__.py")
    results = _run_autograder(root, THIS_VENV)
    points = get("01.pick_device").points  # its own answer, right only if it read none of the targets
    assert results["score"] == points, [t["output"] for t in results["tests"] if t["score"] < t["max_score"]]
    assert results["output"].startswith(f"Ada Lovelace: {points}/{LESSON_01}"), results["output"]

    copy = _layout(tmp_path / "copy", ["01"], {"work/01_devices.ipynb": ROOT / "notebooks" / "01_devices.ipynb",
                                              "notes.ipynb": b"this is not a notebook"})
    results = _run_autograder(copy, THIS_VENV)
    assert results["score"] == 0 and all(t["name"].endswith("not attempted") for t in results["tests"]), results
    assert "notes.ipynb: not a notebook of this assignment" not in results["output"]  # the one lesson takes it...
    assert "lesson 01 has another notebook" in results["output"]  # ...unless the lesson has one already

    broken = _layout(tmp_path / "broken", ["01", "02"], {"02_data_loading.ipynb": b"{not json"})
    results = _run_autograder(broken, THIS_VENV)
    assert results["score"] == 0 and "lesson 01: no notebook submitted" in results["output"], results["output"]
    assert "could not be read" in results["output"], results["output"]
    assert {t["name"].split(".")[0] for t in results["tests"]} == {"01", "02"}


def test_a_submission_without_a_notebook_gets_results_that_say_so(tmp_path):
    from mgpu_lab.course import autograder

    root = _layout(tmp_path, ["01", "02"], {"README.txt": b"I forgot"})
    results = autograder.run(root)
    assert json.loads((root / "results" / "results.json").read_text()) == results
    jsonschema.validate(results, RESULTS_SCHEMA)
    assert results["score"] == 0 and "holds no notebook" in results["output"]
    assert {t["name"].split(".")[0] for t in results["tests"]} == {"01", "02"}


@pytest.mark.slow
@pytest.mark.timeout(1800)  # setup.sh unpacks torch's 6 GB of CUDA wheels: past 900 s once on a loaded CI machine
def test_setup_sh_makes_a_fresh_environment_in_which_run_autograder_gives_a_solution_full_marks(tmp_path):
    # The real setup.sh, into a fresh virtual environment: pip takes the pinned wheels from its cache where
    # it has them. The CPU-only index is skipped (MGPU_LAB_TORCH_INDEX=""): this machine reaches PyPI only.
    root = _layout(tmp_path, ["01"], {"my notebook.ipynb": ROOT / "solutions" / "01_devices.ipynb"})
    venv = tmp_path / "venv"
    env = {**os.environ, "MGPU_LAB_VENV": str(venv), "MGPU_LAB_TORCH_INDEX": "", "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", str(root / "source" / "setup.sh")], env=env, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"mgpu_lab {root / 'source' / 'mgpu_lab' / '__init__.py'}" in proc.stdout, proc.stdout[-2000:]
    results = _run_autograder(root, str(venv))
    assert results["score"] == LESSON_01, results["output"]
    assert results["output"].startswith(f"Ada Lovelace: {LESSON_01}/{LESSON_01}"), results["output"]
    assert all(t["status"] == "passed" for t in results["tests"])


# -- Gradescope's defaults: 768 MB of memory, a 10-minute limit ------------------------------------------------
def _memory_cgroup(limit: int) -> tuple[Path, str]:
    """A fresh memory cgroup limited to ``limit`` bytes, swap included (v2's memory.max where this machine
    has the v2 memory controller, else v1's limit_in_bytes): its folder and the file a process joins by."""
    v2 = Path("/sys/fs/cgroup")
    if "memory" in (v2 / "cgroup.controllers").read_text().split() if (v2 / "cgroup.controllers").exists() else ():
        group = v2 / f"mgpu-lab-test-{os.getpid()}"
        group.mkdir()
        (group / "memory.max").write_text(str(limit))
        if (group / "memory.swap.max").exists():
            (group / "memory.swap.max").write_text("0")
        return group, "cgroup.procs"
    group = Path("/sys/fs/cgroup/memory") / f"mgpu-lab-test-{os.getpid()}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(limit))
    if (group / "memory.memsw.limit_in_bytes").exists():
        (group / "memory.memsw.limit_in_bytes").write_text(str(limit))
    return group, "cgroup.procs"


def _not_graded_named(results: dict) -> None:
    """Every exercise short of full marks says why in its own test; 'not graded' ones say what stopped them."""
    jsonschema.validate(results, RESULTS_SCHEMA)
    for t in results["tests"]:
        if t["score"] < t["max_score"] and t["name"].endswith("not graded"):
            assert "not graded:" in t["output"] and len(t["output"]) > 40, t


@pytest.mark.root
@pytest.mark.slow
def test_under_gradescope_s_default_768_mb_the_bundle_still_writes_results_naming_what_was_not_graded(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a memory cgroup needs root")
    root = _layout(tmp_path, ["01"], {"01_devices.ipynb": ROOT / "solutions" / "01_devices.ipynb"})
    group, procs = _memory_cgroup(768 << 20)
    try:
        env = {**os.environ, "AUTOGRADER_ROOT": str(root), "MGPU_LAB_VENV": THIS_VENV}
        proc = subprocess.run(["sh", "-c", f'echo $$ > {group / procs} && exec "$0"', str(root / "run_autograder")],
                              cwd=root, env=env, capture_output=True, text=True, timeout=600)
    finally:
        for _ in range(50):  # its processes are gone once run_autograder has returned; the folder follows
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.2)
    assert (root / "results" / "results.json").is_file(), f"no results.json: {proc.returncode} {proc.stderr[-2000:]}"
    assert proc.returncode == 0, proc.stderr[-2000:]  # the process Gradescope started was not the one killed
    results = json.loads((root / "results" / "results.json").read_text())
    _not_graded_named(results)
    if results["score"] < LESSON_01:  # what did not fit says so, and what to set on Gradescope
        assert "out of memory" in results["output"] or "kernel died" in results["output"], results["output"]


@pytest.mark.slow
def test_a_hanging_notebook_ends_within_the_time_budget_with_results_naming_what_was_not_graded(tmp_path):
    hang = notebook(tmp_path, "01_devices.ipynb", PICK_DEVICE, CHECK_PICK_DEVICE, "while True:\n    pass")
    # 90 s, not the least budget (60): on CI's loaded 2-core machine the grader's own start took over 35 s once,
    # and a share under 10 s grades nothing ("ran out before this notebook"): the hang would never have started.
    root = _layout(tmp_path, ["01"], {"01_devices.ipynb": hang}, budget=90)
    assert "--budget 90" in (root / "run_autograder").read_text()
    results = _run_autograder(root, THIS_VENV, timeout=90 + 60)
    assert results["execution_time"] <= 90 + 10, results["execution_time"]
    _not_graded_named(results)
    assert results["score"] < LESSON_01 and "stopped" in results["output"], results["output"]
    with pytest.raises(ValueError, match="budget=10: give at least 60 seconds"):
        build(tmp_path / "x.zip", ["01"], budget=10)


def test_setup_sh_says_which_torch_it_installed_and_that_the_cpu_index_was_unreachable(tmp_path):
    # A stand-in python: `-m venv` makes a venv whose python is itself, `-m pip` only says what it would install,
    # everything else is the test environment's python (torch included).
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && ln -sf {fake} "$3/bin/python"; exit 0; fi
if [ "$1 $2" = "-m pip" ]; then echo "pip $*" >> {tmp_path / 'pip.log'}; exit 0; fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    source = tmp_path / "source"
    with zipfile.ZipFile(build(tmp_path / "autograder.zip", ["01"])) as zf:
        zf.extractall(source)
    env = {**os.environ, "MGPU_LAB_VENV": str(tmp_path / "venv"), "PYTHON": str(fake),
           "MGPU_LAB_TORCH_INDEX": "http://127.0.0.1:9/unreachable"}
    proc = subprocess.run(["bash", str(source / "setup.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the CPU-only torch index http://127.0.0.1:9/unreachable is not reachable" in proc.stdout
    assert "CUDA wheels (about 5.8 GB" in proc.stderr  # plainly, on both streams
    import torch

    wheels = f"CUDA {torch.version.cuda} wheels" if torch.version.cuda else "CPU-only wheels"
    assert f"torch {torch.__version__} ({wheels})" in proc.stdout, proc.stdout
    assert "--extra-index-url" not in (tmp_path / "pip.log").read_text()


@pytest.mark.slow
def test_a_grader_killed_as_the_oom_killer_kills_leaves_results_saying_not_graded_and_why(tmp_path):
    import psutil

    root = _layout(tmp_path, ["01", "02"], {"01_devices.ipynb": ROOT / "solutions" / "01_devices.ipynb"})
    env = {**os.environ, "AUTOGRADER_ROOT": str(root), "MGPU_LAB_VENV": THIS_VENV}
    proc = subprocess.Popen([str(root / "run_autograder")], cwd=root, env=env, stdout=subprocess.PIPE, text=True)
    killed, deadline = [], time.monotonic() + 60
    while not killed and time.monotonic() < deadline and proc.poll() is None:
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                if "grade-one" in child.cmdline():
                    child.kill()  # what the OOM killer does to the biggest process of a full cgroup
                    killed.append(child.pid)
            except psutil.Error:
                pass
        time.sleep(0.05)
    proc.communicate(timeout=120)
    assert killed, "the notebook was not graded in a child process of its own"
    results = json.loads((root / "results" / "results.json").read_text())
    _not_graded_named(results)
    ungraded = [t for t in results["tests"] if t["name"].startswith("01.")]
    assert ungraded and all(t["name"].endswith("not graded") and "killed (SIGKILL), most likely out of memory"
                            in t["output"] for t in ungraded), ungraded
    assert "lesson 02: no notebook submitted" in results["output"]


def test_a_notebook_named_without_its_lesson_goes_to_the_lesson_its_check_cells_name(tmp_path):
    from mgpu_lab.course.autograder import _match

    (tmp_path / "in").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    homework = notebook(tmp_path / "in", "homework.ipynb", "check('02.make_loader', make_loader)")
    notes = notebook(tmp_path / "in", "notes.ipynb", "x = 1")
    chosen, notes_out = _match([homework, notes], ["01", "02"], work)
    assert chosen == {"02": work / "02_homework.ipynb"}
    assert notes_out == ["notes.ipynb: not a notebook of this assignment (lessons 01, 02); name it after its "
                         "lesson, e.g. 01_....ipynb"]
