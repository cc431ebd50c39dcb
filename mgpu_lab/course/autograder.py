"""A Gradescope autograder: the bundle an instructor uploads, and what it runs for every submission.

:func:`build` writes ``autograder.zip`` in Gradescope's layout: ``setup.sh``
and ``run_autograder`` at its root, beside this package's source, the
constraints it was tested with and the chosen lessons' student notebooks
(grading skips their tagged demo cells, as ``mgpu-lab grade`` does; the
solutions tag the same cells, and no solution notebook is shipped). Gradescope
unzips it into ``/autograder/source``, runs ``setup.sh`` once when it builds the
image, and ``run_autograder`` for every submission, which calls :func:`run`:

- every notebook in ``/autograder/submission`` is graded as ``mgpu-lab grade``
  grades it (a sandbox per notebook, the grader's own checks); a notebook is
  matched to a lesson by its ``NN_`` prefix, else by the lesson its check cells
  name, else to the assignment's one lesson;
- ``/autograder/results/results.json`` gets one test per judged case (hidden
  cases ``after_published``, with no output) and, for a lesson with no notebook,
  one test per exercise at 0 saying so; ``submission_metadata.json`` gives the
  student's name for the report;
- whatever goes wrong (no notebook, not a notebook, a crash, a hang, an error of
  the grader itself), a results file is written, with 0 and the reason.

Within Gradescope's limits (by default 768 MB of memory and 10 minutes), the
process Gradescope starts stays small (it imports neither torch nor the checks)
and never grades: each notebook is graded in a child process of its own, one
after the other (the judge starting once the notebook has ended), so that only
one notebook's kernel or judge holds memory at a time. The supervising process
writes a valid ``results.json`` before anything is graded and again after each
notebook, so that whatever kills the grading (memory, time) leaves results that
name what was not graded and why; it asks the kernel's OOM killer to take a
child before itself. The whole submission gets a time budget (:data:`BUDGET`,
below Gradescope's default limit; ``mgpu-lab autograder --budget``): a notebook
still grading when its share of it runs out is stopped and reported not graded.

Example:
    >>> import tempfile, zipfile
    >>> out = build(os.path.join(tempfile.mkdtemp(), "autograder.zip"), ["01"])
    >>> names = zipfile.ZipFile(out).namelist()
    >>> [n for n in ("setup.sh", "run_autograder", "lessons.txt", "notebooks/01_devices.ipynb") if n in names]
    ['setup.sh', 'run_autograder', 'lessons.txt', 'notebooks/01_devices.ipynb']
    >>> [n for n in names if n.startswith("solutions/")]   # the answers stay with the instructor
    []
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

__all__ = ["build", "run", "results_for"]

LESSONS_FILE = "lessons.txt"
BUDGET = 540.0  # seconds for a whole submission: below Gradescope's default limit of 10 minutes
RESERVE = 15.0  # seconds of the budget kept for writing the results
OOM_HINT = ("most likely out of memory: give the autograder more memory in Gradescope's settings (2 GB at "
            "least; see the course README)")
SOURCE_FILES = ("pyproject.toml", "constraints.txt", "README.md")

SETUP_SH = r"""#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image; the bundle is in
# /autograder/source. It makes a virtual environment with the pinned torch (CPU-only wheels where the
# platform has them) and installs mgpu-lab from the bundle.
# MGPU_LAB_VENV (default /autograder/venv), PYTHON (default python3) and MGPU_LAB_TORCH_INDEX (a wheel index
# for CPU-only torch; empty: PyPI's torch) change that.
set -euo pipefail
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${MGPU_LAB_VENV:-/autograder/venv}"
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y python3 python3-venv python3-pip
fi
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
INDEX="${MGPU_LAB_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
REACHABLE="import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)"
if [ -z "$INDEX" ]; then
    echo "setup.sh: torch from the default index (PyPI), as MGPU_LAB_TORCH_INDEX is empty: on x86_64 Linux" \
         "these are the CUDA wheels (about 5.8 GB)"
elif [ "$(uname -m)" != x86_64 ]; then
    echo "setup.sh: torch from the default index (PyPI): $(uname -m) has CPU-only wheels there"
elif "$VENV/bin/python" -c "$REACHABLE" "$INDEX/torch/" 2>/dev/null; then
    echo "setup.sh: CPU-only torch from $INDEX"
    "$VENV/bin/python" -m pip install --quiet --extra-index-url "$INDEX" -c "$SRC/constraints.txt" torch torchvision
else
    echo "setup.sh: WARNING: the CPU-only torch index $INDEX is not reachable from here: torch comes from" \
         "the default index (PyPI) instead, with its CUDA wheels (about 5.8 GB, several minutes; the grader" \
         "needs none of it). Set MGPU_LAB_TORCH_INDEX to a CPU-only index this image reaches, or to nothing" \
         "to take PyPI's on purpose." | tee /dev/stderr
fi
"$VENV/bin/python" -m pip install --quiet -c "$SRC/constraints.txt" -e "$SRC"
cd / && "$VENV/bin/python" -c "import mgpu_lab, torch
wheels = f'CUDA {torch.version.cuda} wheels' if torch.version.cuda else 'CPU-only wheels'
print('setup.sh: mgpu_lab', mgpu_lab.__file__, 'torch', torch.__version__, f'({wheels})')"
"""

RUN_AUTOGRADER = r"""#!/usr/bin/env bash
# Gradescope runs this for every submission, as root: it grades /autograder/submission and writes
# /autograder/results/results.json (always: a failure gives 0 points and says why).
ROOT="${AUTOGRADER_ROOT:-/autograder}"
cd "$ROOT" || exit 1
exec "${MGPU_LAB_VENV:-$ROOT/venv}/bin/python" -m mgpu_lab.course.autograder run --root "$ROOT" --budget {budget}
"""


def _project_root() -> Path:
    import mgpu_lab

    return Path(mgpu_lab.__file__).resolve().parent.parent


def _lessons(lessons, root: Path) -> list[str]:
    have = sorted({p.name[:2] for p in (root / "solutions").glob("[0-9][0-9]_*.ipynb")})
    chosen = sorted({str(x).zfill(2) for x in lessons}) if lessons else have
    unknown = [x for x in chosen if x not in have]
    if unknown or not chosen:
        raise ValueError(f"lessons {unknown or chosen}: not lessons of this course; give some of {', '.join(have)}")
    return chosen


def _add(zf: zipfile.ZipFile, name: str, data: bytes, executable: bool = False) -> None:
    info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
    info.external_attr = ((0o755 if executable else 0o644) | stat.S_IFREG) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    zf.writestr(info, data)


def build(out: str | os.PathLike, lessons=None, budget: float = BUDGET) -> Path:
    """Write the autograder bundle for ``lessons`` (e.g. ``["04"]``; default every lesson) to ``out``.

    ``budget``: the seconds ``run_autograder`` may take for a submission (keep it
    a minute below the autograder timeout set on Gradescope; 10 minutes by default).

    Raises:
        ValueError: a lesson this course does not have, or a budget under a minute.
    """
    from .grade import check_timeout

    if check_timeout(budget) < 60:
        raise ValueError(f"budget={budget!r}: give at least 60 seconds (a notebook's kernel and torch start first)")
    root = _project_root()
    chosen = _lessons(lessons, root)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w") as zf:
        _add(zf, "setup.sh", SETUP_SH.encode(), executable=True)
        _add(zf, "run_autograder", RUN_AUTOGRADER.replace("{budget}", f"{budget:g}").encode(), executable=True)
        _add(zf, LESSONS_FILE, ("\n".join(chosen) + "\n").encode())
        for name in SOURCE_FILES:
            _add(zf, name, (root / name).read_bytes())
        for path in sorted((root / "mgpu_lab").rglob("*.py")):
            _add(zf, path.relative_to(root).as_posix(), path.read_bytes())
        for lesson in chosen:  # the student copies: they tag the cells grading skips, as the solutions do
            for path in sorted((root / "notebooks").glob(f"{lesson}_*.ipynb")):
                _add(zf, f"notebooks/{path.name}", path.read_bytes())
    return out


# -- inside Gradescope's container ------------------------------------------------------------
def _student(metadata: Path) -> str:
    try:
        users = json.loads(metadata.read_text(encoding="utf-8")).get("users") or []
        names = [str(u.get("name") or u.get("email") or "") for u in users if isinstance(u, dict)]
        return ", ".join(n for n in names if n)[:200]
    except (OSError, ValueError, AttributeError):
        return ""


def _match(notebooks: list[Path], lessons: list[str], work: Path) -> tuple[dict, list[str]]:
    """Each lesson's notebook (a copy named ``NN_...`` where the name had no prefix), and notes on the rest."""
    from .grade import lesson_of

    chosen: dict[str, Path] = {}
    notes = []
    # a notebook named after its lesson first: an unnamed one only stands in for a lesson that has none
    for path in sorted(notebooks, key=lambda p: (re.match(r"\d\d_", p.name) is None, str(p))):
        m = re.match(r"(\d\d)_", path.name)
        # the name's NN_, else the lesson its check cells name, else the assignment's one lesson
        lesson = lesson_of(path) or (lessons[0] if len(lessons) == 1 else None)
        if lesson not in lessons:
            notes.append(f"{path.name}: not a notebook of this assignment (lessons {', '.join(lessons)}); "
                         f"name it after its lesson, e.g. {lessons[0]}_....ipynb")
            continue
        if lesson in chosen:
            notes.append(f"{path.name}: lesson {lesson} has another notebook ({chosen[lesson].name}); graded that one")
            continue
        copy = work / (path.name if m else f"{lesson}_{path.name}")
        shutil.copyfile(path, copy)
        chosen[lesson] = copy
    return chosen, notes


def results_for(grades: dict, lessons: list[str], notes: list[str], student: str = "") -> dict:
    """Gradescope's ``results.json`` for one submission: ``grades`` maps a lesson to its NotebookGrade."""
    from .checks import exercises
    from .gradescope import results_json

    tests, score, lines = [], 0, []
    for lesson in lessons:
        g = grades.get(lesson)
        if g is None:
            for e in exercises(lesson):
                tests.append({"name": f"{e.id}: not submitted", "score": 0, "max_score": e.points,
                              "output": f"no notebook of lesson {lesson} was submitted", "visibility": "visible"})
            lines.append(f"lesson {lesson}: no notebook submitted")
            continue
        if not g.graded:
            tests += [{"name": f"{e.exercise}: not graded", "score": 0, "max_score": e.max_points,
                       "output": g.reason, "visibility": "visible"} for e in g.exercises]
            lines.append(f"lesson {lesson} ({Path(g.path).name}): {g.reason}")
            continue
        result = results_json(g)
        tests += result["tests"]
        score += result["score"]
        lines.append(f"lesson {lesson} ({Path(g.path).name}): {result['output']}")
    for test in tests:  # Gradescope shows each test as passed or failed
        test["status"] = "passed" if test["score"] >= test["max_score"] else "failed"
    total = sum(t["max_score"] for t in tests)
    head = f"{student}: {score}/{total}" if student else f"{score}/{total}"
    return {"score": score, "output": "\n".join([head, *lines, *notes]), "tests": tests,
            "visibility": "visible", "stdout_visibility": "hidden"}


def _failed(lessons: list[str], why: str, student: str) -> dict:
    out = results_for({}, lessons, [why], student)
    out["output"] = f"0 points: {why}\n" + out["output"]
    return out


def run(root: str | os.PathLike = "/autograder", timeout: float = 600.0, budget: float = BUDGET) -> dict:
    """Grade ``ROOT/submission`` with the lessons of ``ROOT/source`` within ``budget`` seconds; write and return
    ``ROOT/results/results.json`` (written first as "not graded", then after each notebook)."""
    root = Path(root)
    deadline = time.monotonic() + budget
    _oom_score(-1000)  # the OOM killer takes a grading child, never the process that writes the results
    lessons = (root / "source" / LESSONS_FILE).read_text().split()
    student = _student(root / "submission_metadata.json")
    out = root / "results" / "results.json"
    save = functools.partial(_save, out, deadline - budget)
    save(_failed(lessons, "not graded: the grading was stopped before it ended (killed: out of memory, or past "
                          "the platform's time limit)", student))
    try:
        results = _grade_submission(root / "submission", lessons, student, timeout, deadline, save)
    except Exception as exc:  # noqa: BLE001 - Gradescope must always get results
        results = _failed(lessons, f"the grader failed ({type(exc).__name__}: {str(exc)[:300]})", student)
    return save(results)


def _save(out: Path, started: float, results: dict) -> dict:
    results["execution_time"] = round(time.monotonic() - started, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, out)  # whole, whenever the process is killed
    return results


def _oom_score(value: int) -> None:
    """Set this process's OOM score adjustment (lowering it needs root: elsewhere it stays as it is)."""
    try:
        Path("/proc/self/oom_score_adj").write_text(str(value))
    except OSError:
        pass


def _grade_submission(folder: Path, lessons: list[str], student: str, timeout: float, deadline: float,
                      save) -> dict:
    from .grade import not_graded

    notebooks = sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts) \
        if folder.is_dir() else []
    if not notebooks:
        return _failed(lessons, "the submission holds no notebook (.ipynb): upload your lesson's notebook, "
                       f"e.g. {lessons[0]}_....ipynb", student)
    with tempfile.TemporaryDirectory(prefix="mgpu-lab-autograder-") as work:
        chosen, notes = _match(notebooks, lessons, Path(work))
        todo = [lesson for lesson in lessons if lesson in chosen]
        grades = {x: not_graded(chosen[x], "not graded: the grading was stopped before it reached this notebook "
                                           "(killed: out of memory, or past the platform's time limit)")
                  for x in todo}
        for n, lesson in enumerate(todo):
            grades[lesson] = not_graded(chosen[lesson], "not graded: the grading was stopped while it graded this "
                                        "notebook (killed: out of memory, or past the platform's time limit)")
            save(results_for(grades, lessons, notes, student))
            share = (deadline - RESERVE - time.monotonic()) / (len(todo) - n)
            grades[lesson] = _grade_in_child(chosen[lesson], min(timeout, max(10.0, 0.6 * share)), share,
                                             Path(work) / f"{lesson}.json")
    return results_for(grades, lessons, notes, student)


def _grade_in_child(path: Path, timeout: float, seconds: float, out: Path):
    """Grade one notebook in a child process, for at most ``seconds``; its grade, or "not graded" and why."""
    from .grade import _from_dict, not_graded

    if seconds < 10:
        return not_graded(path, "not graded: the time budget of this submission ran out before this notebook")
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "mgpu_lab.course.autograder", "grade-one", str(path),
                                 str(out), f"{timeout:g}"], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its sandboxes die with it (parent-death signal)
            proc.wait()
            return not_graded(path, f"not graded: its grading was stopped when its share of the time budget "
                                    f"ran out ({seconds:.0f} s; the notebook may run {timeout:.0f} s)")
        log.seek(0)
        tail = log.read()[-400:].decode(errors="replace").strip()
    try:
        return _from_dict(json.loads(out.read_text()), path)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if code == -signal.SIGKILL:
        return not_graded(path, f"not graded: its grader was killed (SIGKILL), {OOM_HINT}")
    return not_graded(path, f"not graded: its grader failed (exit {code}): {tail[-300:]}")


def _grade_one(path: str, out: str, timeout: float) -> int:
    """What the child of :func:`_grade_in_child` runs: grade one notebook, write its grade as JSON."""
    _oom_score(1000)  # taken before the process that writes the results
    from .grade import LEAN_ENV, _to_dict, grade

    os.environ[LEAN_ENV] = "1"  # the judge starts once the notebook has ended

    (g,) = grade([path], timeout=timeout)
    Path(out).write_text(json.dumps(_to_dict(g)))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mgpu_lab.course.autograder",
                                     description="What Gradescope's run_autograder calls.")
    actions = parser.add_subparsers(dest="action", required=True)
    runner = actions.add_parser("run", help="grade ROOT/submission, write ROOT/results/results.json")
    runner.add_argument("--root", default="/autograder")
    runner.add_argument("--timeout", type=float, default=600.0, help="seconds a notebook may run at most")
    runner.add_argument("--budget", type=float, default=BUDGET, help="seconds for the whole submission")
    one = actions.add_parser("grade-one", help="grade one notebook, write its grade as JSON (what run starts)")
    one.add_argument("notebook")
    one.add_argument("out")
    one.add_argument("timeout", type=float)
    args = parser.parse_args(argv)
    if args.action == "grade-one":
        return _grade_one(args.notebook, args.out, args.timeout)
    results = run(args.root, args.timeout, args.budget)
    print(results["output"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
