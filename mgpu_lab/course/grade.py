"""Grade submitted notebooks: each runs in its own sandbox; the grader judges, trusting nothing it wrote.

For every notebook:

1. A fresh :class:`~mgpu_lab.course.sandbox.Sandbox` (its own user, directory,
   environment, limits and namespaces) runs the notebook in a Jupyter kernel
   started inside it, under the per-notebook timeout. Its check cells judge
   nothing there: they save the learner's objects in the sandbox's folder.
2. The grader runs each exercise's checker itself (:mod:`mgpu_lab.course.session`);
   the learner's code runs only in the sandbox, in ranks, and sends back plain
   data. Points come from the grader's registry: the exercises of the
   notebook's lesson (:func:`lesson_of`), each once, one point
   per passed case. Judging gets as long as the notebook had (at least 5
   minutes), and every call of learner code its own shorter limit.
3. The sandbox and everything started in it are killed, from the grader's own
   bookkeeping (its PID namespace; no process id is read from a file), and its
   folder deleted.

A notebook that hangs or kills its kernel keeps the points of the checks it
reached, with the reason. A batch always finishes: whatever goes wrong with one
notebook gives it 0 points for what could not be judged, with the reason, and
the next notebook is graded as if nothing happened.

Example:
    >>> from pathlib import Path
    >>> unanswered = Path(__file__).parents[2] / "notebooks" / "01_devices.ipynb"   # a student copy, as given out
    >>> grades = grade([unanswered], timeout=300)   # in a sandbox: a fresh kernel runs it, the grader judges
    >>> grades[0].points, grades[0].max_points, {e.status for e in grades[0].exercises}
    (0, 10, {'not attempted'})
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import selectors
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .batch import Store, check_jobs, fingerprint, run_batch
from .cells import reference_skips
from .checks import exercises
from .checks._answers import ANSWERS_ENV
from .session import ANSWERS, Session, clean, run_checkers
from .sandbox import Limits, Sandbox, protections

DEFAULT_TIMEOUT = 600.0
JUDGE_MIN = 300.0  # seconds judging may take at least (the sandbox's runner starts first), whatever the timeout
NOTEBOOK_LIMIT = 256 << 20  # bytes: larger files are not run
PROGRESS_LIMIT = 1 << 20
NAME = "submission.ipynb"
LEAN_ENV = "MGPU_LAB_GRADE_LEAN"  # "1": the judge starts once the notebook has ended (less memory at once, slower)
SKIPS = "skippable.json"


@dataclass
class ExerciseGrade:
    exercise: str
    points: int
    max_points: int
    status: str  # passed / failed / not attempted / not checked / not judged
    note: str = ""
    cases: list = field(default_factory=list)  # the judged cases (dicts), hidden ones included


@dataclass
class NotebookGrade:
    path: str
    exercises: list[ExerciseGrade] = field(default_factory=list)
    completed: bool = True
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    graded: bool = True  # False: nothing of it was judged (e.g. its SLURM task never ran): no points, not 0

    @property
    def points(self) -> int:
        return sum(e.points for e in self.exercises)

    @property
    def max_points(self) -> int:
        return sum(e.max_points for e in self.exercises)


def check_timeout(timeout) -> float:
    """``timeout`` as seconds; ValueError unless it is a positive finite number."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ValueError(f"timeout={timeout!r}: give the seconds a notebook may run, a positive finite "
                         "number, e.g. 600")
    return float(timeout)


_CHECKED = re.compile(r"""\bcheck\(\s*["'](\d\d)\.\w+["']""")


def lesson_of(path: Path) -> str | None:
    """The lesson a notebook answers: its file name's ``NN_`` prefix, else the one lesson its check cells name.

    A full solution saved as ``homework.ipynb`` is still lesson 04's when its
    cells call ``check("04. ...")`` for exercises of lesson 04 only.

    Returns:
        ``"04"`` ...; None when neither the name nor the check cells tell one lesson
        (no check cell, checks of several lessons, not a readable notebook).

    Example:
        >>> import json, tempfile
        >>> cell = {"cell_type": "code", "source": 'check("04.shard_indices", shard_indices)'}
        >>> path = Path(tempfile.mkdtemp()) / "homework.ipynb"
        >>> _ = path.write_text(json.dumps({"cells": [cell]}))
        >>> lesson_of(path), lesson_of(path.with_name("01_homework.ipynb"))
        ('04', '01')
    """
    m = re.match(r"(\d\d)_", path.name)
    if m:
        return m.group(1)
    try:
        cells = json.loads(path.read_bytes()[:NOTEBOOK_LIMIT])["cells"]
        sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
                   for c in cells if c.get("cell_type") == "code"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    known = {e.lesson for e in exercises()}
    named = {n for src in sources if isinstance(src, str) for n in _CHECKED.findall(src)} & known
    return named.pop() if len(named) == 1 else None


def _unknown_lesson(path: Path) -> NotebookGrade:
    return NotebookGrade(str(path), [], completed=False, reason=(
        "not graded: which lesson is this notebook? Its name has no NN_ prefix and its check cells do not name "
        "the exercises of one lesson; name it after its lesson (e.g. 04_ddp.ipynb) and grade it again"))


def _events(data: bytes) -> list[dict]:
    """The runner's progress lines that make sense; everything else (forged or cut short) is dropped."""
    out = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if not isinstance(e, dict):
            continue
        cell = e.get("cell")
        if cell is not None and not (isinstance(cell, int) and not isinstance(cell, bool) and 0 <= cell < 10**6):
            continue
        out.append({"cell": cell, "ended": e.get("ended") if e.get("ended") in ("ok", "died", "error") else None,
                    "why": clean(e.get("why", ""), 300), "syntax": _syntax(e.get("syntax"))})
    return out


def _syntax(found) -> str:
    """The runner's syntax errors in words ("" where there are none or they make no sense)."""
    if not isinstance(found, list):
        return ""
    said = []
    for f in found[:5]:
        if isinstance(f, dict) and isinstance(f.get("cell"), int) and not isinstance(f.get("cell"), bool):
            line = f.get("line") if isinstance(f.get("line"), int) else None
            said.append(f"cell {f['cell']} did not run: {clean(f.get('what', ''), 200)}"
                        + (f" at line {line}" if line else ""))
    return "; ".join(said)


def _run_notebook(box: Sandbox, timeout: float, skips: set[str]) -> str:
    """Run the notebook in ``box`` for at most ``timeout`` s, skipping the demos ``skips`` allows
    (:mod:`~mgpu_lab.course.cells`); why it did not complete ("" if it did)."""
    box.put(SKIPS, json.dumps(sorted(skips)).encode())
    read, write = os.pipe()
    with tempfile.TemporaryFile() as err:
        try:
            proc = box.start([sys.executable, "-P", "-s", "-m", "mgpu_lab.course.runner", "notebook", NAME,
                              str(write), SKIPS], pass_fds=(write,), stderr=err,
                             env={ANSWERS_ENV: f"{box.inside}/{ANSWERS}"})
        finally:
            os.close(write)
        data, deadline, timed_out = b"", time.monotonic() + timeout, False
        with selectors.DefaultSelector() as sel, open(read, "rb", buffering=0) as pipe:
            sel.register(pipe, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                if not sel.select(min(left, 1.0)):
                    if proc.poll() is not None:
                        break  # ended, though something of it may still hold the pipe open
                    continue
                chunk = pipe.read(65536)
                if not chunk:
                    break
                data = (data + chunk)[:PROGRESS_LIMIT]
        try:
            code = proc.wait(max(0.1, min(30.0, deadline - time.monotonic())))
        except Exception:  # noqa: BLE001 - still running after its progress ended: it counts as hung
            code, timed_out = None, True
        box.kill(proc)  # the kernel, the ranks and anything they left, all of it
        err.seek(0)
        stderr = err.read(1 << 16).decode(errors="replace")
    events = _events(data)
    box.syntax = next((e["syntax"] for e in events if e["syntax"]), "")  # where the code did not compile
    cells = [e["cell"] for e in events if e["cell"] is not None]
    ended = next((e for e in events if e["ended"]), None)
    where = f" (it was running cell {cells[-1]})" if cells else ""
    if timed_out:
        return f"stopped after {timeout:g} s: the notebook hangs or is too slow{where}"
    if ended and ended["ended"] == "died":
        return f"the kernel died while running cell {cells[-1] if cells else '?'}"
    if ended and ended["ended"] == "error":
        return ended["why"] or "the notebook could not be run"
    if ended is None:
        what = "the sandbox could not start" if code == 97 else f"the grader's runner failed (exit {code})"
        return f"{what}: {clean(stderr.strip()[-500:])}"
    return ""


def grade_notebook(path: Path | str, timeout: float = DEFAULT_TIMEOUT, limits: Limits | None = None, *,
                   slot: int = 0, all_cells: bool = False) -> NotebookGrade:
    """Run one notebook in a sandbox and judge its checks.

    Args:
        path: the notebook.
        timeout: seconds the notebook may run (and again, at least 300, for judging its checks).
        limits: the sandbox's resource limits (default :class:`Limits`).
        slot: which of the sandboxes graded at once this is (each slot has its own user).
        all_cells: run the demo cells too (by default those tagged ``skip-in-grading``
            in the lesson's reference notebooks are skipped when no exercise needs them).

    Returns:
        Its grade: every exercise of its lesson (:func:`lesson_of`: the ``NN_``
        prefix of the file name, else its check cells), with 0 points and status
        "not checked" for those no check cell reached; no exercise and the reason,
        not run, when no lesson can be told.

    Raises:
        FileNotFoundError: no such notebook. ValueError: a bad timeout.
    """
    timeout = check_timeout(timeout)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no notebook at {path}")
    lesson = lesson_of(path)
    if lesson is None:
        return _unknown_lesson(path)
    expected = exercises(lesson)
    try:
        return _grade(path, timeout, limits, expected, slot, set() if all_cells else reference_skips(lesson))
    except Exception as exc:  # noqa: BLE001 - one notebook must never stop the batch
        return NotebookGrade(str(path), [ExerciseGrade(e.id, 0, e.points, "not judged") for e in expected],
                             completed=False, reason=f"the grader could not judge this notebook "
                             f"({type(exc).__name__}: {str(exc)[:300]}); 0 points for what it could not judge")


def _grade(path: Path, timeout: float, limits: Limits | None, expected, slot: int, skips: set[str]) -> NotebookGrade:
    size = path.stat().st_size
    if size > NOTEBOOK_LIMIT:
        raise ValueError(f"the file has {size} bytes, more than the {NOTEBOOK_LIMIT} a notebook may have")
    with Sandbox(limits, slot=slot) as box, Session(box, deadline=math.inf) as session:
        box.put(NAME, path.read_bytes())
        if os.environ.get(LEAN_ENV) != "1":  # else it starts at the first request, once the notebook has ended
            session.start()  # in its own namespaces, beside the notebook: it imports torch while the notebook runs
        reason = _run_notebook(box, timeout, skips)
        # Judging starts once nothing of the notebook runs any more, with a runner that still answers.
        session.deadline = time.monotonic() + max(timeout, JUDGE_MIN)
        session.ready()
        results, notes = run_checkers(box, expected, session)
    grades = []
    for ex in expected:
        r = results.get(ex.id)
        if r is None:
            grades.append(ExerciseGrade(ex.id, 0, ex.points, "not checked", _unchecked(getattr(box, "syntax", ""))))
        else:
            grades.append(ExerciseGrade(ex.id, r.points, ex.points, r.status, r.note,
                                        [asdict(c) for c in r.cases]))
    return NotebookGrade(str(path), grades, completed=not reason, reason=reason, notes=notes)


def _unchecked(syntax: str) -> str:
    """Why an exercise was not checked, where the notebook says: the cells that did not compile."""
    if not syntax:
        return ""
    return f"no check cell of it ran to the end; {syntax} (nothing that cell defines exists)"


def grade(paths, timeout: float = DEFAULT_TIMEOUT, limits: Limits | None = None, *, jobs: int = 1,
          store: Path | str | None = None, force: bool = False, all_cells: bool = False,
          progress: bool = False) -> list[NotebookGrade]:
    """Grade several notebooks (see :func:`grade_notebook`), ``jobs`` at once; never stops early.

    Args:
        paths, timeout, limits, all_cells: as :func:`grade_notebook` takes them.
        jobs: notebooks graded at once, each in its own sandbox
            (:func:`~mgpu_lab.course.batch.default_jobs` fits this machine). More
            than 1 starts worker processes with ``spawn``: in a script, call
            ``grade`` under ``if __name__ == "__main__":`` (the CLI does).
        store: a folder where each notebook's grade is kept, by its content
            and what grades it: a later run takes it from there instead of grading
            the same notebook again (None: keep nothing).
        force: grade again what ``store`` holds.
        progress: show a progress line on stderr.

    Returns:
        One grade per path, in their order.
    """
    timeout = check_timeout(timeout)
    check_jobs(jobs)
    kept = None
    if store is not None:
        kept = Store(store, fingerprint(timeout, limits, all_cells))
    work = functools.partial(_grade_or_missing, timeout=timeout, limits=limits, all_cells=all_cells)
    return run_batch(paths, work, jobs=jobs, store=kept, force=force, to_dict=_to_dict, from_dict=_from_dict,
                     failed=lambda p, why: _failed(p, why), complete=lambda g: g.completed, progress=progress)


def _grade_or_missing(path, *, timeout, limits, all_cells, slot) -> NotebookGrade:
    try:
        return grade_notebook(path, timeout, limits, slot=slot, all_cells=all_cells)
    except FileNotFoundError as exc:
        return NotebookGrade(str(path), [], completed=False, reason=str(exc))


def _failed(path, reason: str) -> NotebookGrade:
    lesson = lesson_of(Path(path))
    return NotebookGrade(str(path), [ExerciseGrade(e.id, 0, e.points, "not judged") for e in exercises(lesson)]
                         if lesson else [], completed=False, reason=reason)


def not_graded(path, reason: str) -> NotebookGrade:
    """The grade of a notebook that was not graded at all (``reason`` says why): no points, not 0.

    Example:
        >>> g = not_graded("01_ann.ipynb", "its SLURM task was cancelled")
        >>> g.graded, g.points, {e.status for e in g.exercises}
        (False, 0, {'not graded'})
    """
    g = _failed(path, reason)
    for e in g.exercises:
        e.status = "not graded"
    g.graded = False
    return g


def _to_dict(g: NotebookGrade) -> dict:
    return asdict(g)


def _from_dict(data: dict, path: Path) -> NotebookGrade:
    """A kept grade, for the notebook now at ``path`` (the same content may have had another name)."""
    return NotebookGrade(str(path), [ExerciseGrade(**e) for e in data["exercises"]], data["completed"],
                         data["reason"], data["notes"], data.get("graded", True))


def report(grades: list[NotebookGrade], limits: Limits | None = None) -> str:
    """A plain-text table: what the sandbox gave (once), then a line per notebook, then per exercise."""
    lines = [protections().describe(limits)]
    for g in grades:
        if not g.graded:
            lines.append(f"{g.path}: not graded (of {g.max_points})  [{g.reason}]")
            continue
        lines.append(f"{g.path}: {g.points}/{g.max_points}" + ("" if g.completed else f"  [{g.reason}]"))
        lines += [f"  note: {n}" for n in g.notes]
        for e in g.exercises:
            lines.append(f"  {e.exercise:32} {e.points:>3}/{e.max_points:<3} {e.status}"
                         + (f"  ({e.note})" if e.note and e.status != "not attempted" else ""))
    return "\n".join(lines)


def write_json(grades: list[NotebookGrade], path: Path | str) -> None:
    """Every grade as JSON; a notebook that was not graded has ``"points": null`` (not 0) and its reason."""
    data = [dict(asdict(g), points=g.points if g.graded else None, max_points=g.max_points) for g in grades]
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def write_csv(grades: list[NotebookGrade], path: Path | str) -> None:
    """A row per exercise and a TOTAL per notebook; one that was not graded has empty points, "not graded"."""
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["notebook", "exercise", "points", "max_points", "status", "completed", "reason"])
        for g in grades:
            for e in g.exercises:
                w.writerow([g.path, e.exercise, e.points if g.graded else "", e.max_points, e.status, g.completed,
                            g.reason])
            w.writerow([g.path, "TOTAL", g.points if g.graded else "", g.max_points, "" if g.graded else
                        "not graded", g.completed, g.reason])
