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
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
import zipfile
from pathlib import Path

__all__ = ["build", "run", "results_for"]

LESSONS_FILE = "lessons.txt"
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
if [ -n "$INDEX" ] && [ "$(uname -m)" = x86_64 ] && "$VENV/bin/python" -c "$REACHABLE" "$INDEX/torch/" 2>/dev/null
then
    echo "setup.sh: CPU-only torch from $INDEX"
    "$VENV/bin/python" -m pip install --quiet --extra-index-url "$INDEX" -c "$SRC/constraints.txt" torch torchvision
else
    echo "setup.sh: torch from the default index"
fi
"$VENV/bin/python" -m pip install --quiet -c "$SRC/constraints.txt" -e "$SRC"
cd / && "$VENV/bin/python" -c \
    "import mgpu_lab, torch; print('setup.sh: mgpu_lab', mgpu_lab.__file__, 'torch', torch.__version__)"
"""

RUN_AUTOGRADER = r"""#!/usr/bin/env bash
# Gradescope runs this for every submission, as root: it grades /autograder/submission and writes
# /autograder/results/results.json (always: a failure gives 0 points and says why).
ROOT="${AUTOGRADER_ROOT:-/autograder}"
cd "$ROOT" || exit 1
exec "${MGPU_LAB_VENV:-$ROOT/venv}/bin/python" -m mgpu_lab.course.autograder run --root "$ROOT"
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


def build(out: str | os.PathLike, lessons=None) -> Path:
    """Write the autograder bundle for ``lessons`` (e.g. ``["04"]``; default every lesson) to ``out``.

    Raises:
        ValueError: a lesson this course does not have.
    """
    root = _project_root()
    chosen = _lessons(lessons, root)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w") as zf:
        _add(zf, "setup.sh", SETUP_SH.encode(), executable=True)
        _add(zf, "run_autograder", RUN_AUTOGRADER.encode(), executable=True)
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


def run(root: str | os.PathLike = "/autograder", timeout: float = 600.0, jobs: int | None = None) -> dict:
    """Grade ``ROOT/submission`` with the lessons of ``ROOT/source``; write and return ``ROOT/results/results.json``."""
    root = Path(root)
    started = time.monotonic()
    lessons = (root / "source" / LESSONS_FILE).read_text().split()
    student = _student(root / "submission_metadata.json")
    try:
        results = _grade_submission(root / "submission", lessons, student, timeout, jobs)
    except Exception as exc:  # noqa: BLE001 - Gradescope must always get results
        results = _failed(lessons, f"the grader failed ({type(exc).__name__}: {str(exc)[:300]})", student)
    results["execution_time"] = round(time.monotonic() - started, 1)
    out = root / "results" / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    return results


def _grade_submission(folder: Path, lessons: list[str], student: str, timeout: float, jobs) -> dict:
    from .batch import default_jobs
    from .grade import grade

    notebooks = sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts) \
        if folder.is_dir() else []
    if not notebooks:
        return _failed(lessons, "the submission holds no notebook (.ipynb): upload your lesson's notebook, "
                       f"e.g. {lessons[0]}_....ipynb", student)
    with tempfile.TemporaryDirectory(prefix="mgpu-lab-autograder-") as work:
        chosen, notes = _match(notebooks, lessons, Path(work))
        paths = [chosen[lesson] for lesson in lessons if lesson in chosen]
        grades = grade(paths, timeout=timeout, jobs=jobs or min(default_jobs(), max(len(paths), 1))) if paths \
            else []
    by_lesson = {lesson: g for lesson, g in zip([x for x in lessons if x in chosen], grades)}
    return results_for(by_lesson, lessons, notes, student)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mgpu_lab.course.autograder",
                                     description="What Gradescope's run_autograder calls.")
    actions = parser.add_subparsers(dest="action", required=True)
    runner = actions.add_parser("run", help="grade ROOT/submission, write ROOT/results/results.json")
    runner.add_argument("--root", default="/autograder")
    runner.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    results = run(args.root, args.timeout)
    print(results["output"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
