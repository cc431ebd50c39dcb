"""Grade submitted notebooks: run each in a fresh kernel, collect its check results.

Every ``check(...)`` appends its result to the file named by
``MGPU_LAB_GRADE_LOG``; the grader runs each notebook in its own process
group under a per-notebook timeout, so a notebook that hangs or kills its
kernel still gets the points it earned before that, with the reason.

Example:
    >>> grades = grade(["notebooks/01_devices.ipynb"], timeout=300)   # doctest: +SKIP
    >>> grades[0].points, grades[0].max_points                          # doctest: +SKIP
    (0, 18)
"""
from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mgpu_lab.launcher.procs import kill_descendants

DEFAULT_TIMEOUT = 600.0


@dataclass
class ExerciseGrade:
    exercise: str
    points: int
    max_points: int
    status: str  # passed / failed / not attempted / not checked


@dataclass
class NotebookGrade:
    path: str
    exercises: list[ExerciseGrade] = field(default_factory=list)
    completed: bool = True
    reason: str = ""

    @property
    def points(self) -> int:
        return sum(e.points for e in self.exercises)

    @property
    def max_points(self) -> int:
        return sum(e.max_points for e in self.exercises)


def _lesson_of(path: Path) -> str | None:
    m = re.match(r"(\d\d)_", path.name)
    return m.group(1) if m else None


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a killed kernel
    return out


def grade_notebook(path: Path | str, timeout: float = DEFAULT_TIMEOUT) -> NotebookGrade:
    """Run one notebook in a fresh kernel and score its checks.

    Args:
        path: the notebook.
        timeout: seconds the whole notebook may take.

    Returns:
        Its grade: every exercise of its lesson (``NN_`` prefix of the file name),
        with 0 points and status "not checked" for those no check cell judged.

    Raises:
        FileNotFoundError: no such notebook.
    """
    from .checks import exercises

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no notebook at {path}")
    with tempfile.TemporaryDirectory(prefix="mgpu-grade-") as tmp:
        log, progress = Path(tmp) / "checks.jsonl", Path(tmp) / "progress.jsonl"
        env = {**os.environ, "MGPU_LAB_GRADE_LOG": str(log)}
        proc = subprocess.Popen([sys.executable, "-m", "mgpu_lab.course.grade", str(path), str(progress)],
                                env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        reason = ""
        try:
            _, err = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                reason = f"the grader's runner failed (exit {proc.returncode}): {err.decode()[-500:]}"
        except subprocess.TimeoutExpired:
            reason = f"stopped after {timeout:g} s: the notebook hangs or is too slow"
        finally:
            events = _read_jsonl(progress)
            for event in events:
                if "kernel_pid" in event:
                    kill_descendants(event["kernel_pid"], include_self=True, wait=5)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        cells = [e["cell"] for e in events if "cell" in e]
        ended = next((e["ended"] for e in events if "ended" in e), None)
        if reason and cells:
            reason += f" (it was running cell {cells[-1]})"
        if ended and ended != "ok":
            reason = ended
        results = {r["exercise"]: r for r in _read_jsonl(log)}  # the last check of an id counts
    lesson = _lesson_of(path)
    expected = [e for e in exercises() if lesson is None or e.lesson == lesson]
    grades = []
    for ex in expected:
        r = results.pop(ex.id, None)
        grades.append(ExerciseGrade(ex.id, r["points"] if r else 0, ex.points, r["status"] if r else "not checked"))
    for r in results.values():  # checks of other lessons' exercises run in this notebook
        grades.append(ExerciseGrade(r["exercise"], r["points"], r["max_points"], r["status"]))
    return NotebookGrade(str(path), grades, completed=not reason, reason=reason)


def grade(paths, timeout: float = DEFAULT_TIMEOUT) -> list[NotebookGrade]:
    """Grade several notebooks one after the other (see :func:`grade_notebook`)."""
    return [grade_notebook(p, timeout) for p in paths]


def report(grades: list[NotebookGrade]) -> str:
    """A plain-text table: a line per notebook, then per exercise."""
    lines = []
    for g in grades:
        lines.append(f"{g.path}: {g.points}/{g.max_points}" + ("" if g.completed else f"  [{g.reason}]"))
        for e in g.exercises:
            lines.append(f"  {e.exercise:32} {e.points:>3}/{e.max_points:<3} {e.status}")
    return "\n".join(lines)


def write_json(grades: list[NotebookGrade], path: Path | str) -> None:
    data = [dict(asdict(g), points=g.points, max_points=g.max_points) for g in grades]
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def write_csv(grades: list[NotebookGrade], path: Path | str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["notebook", "exercise", "points", "max_points", "status", "completed", "reason"])
        for g in grades:
            for e in g.exercises:
                w.writerow([g.path, e.exercise, e.points, e.max_points, e.status, g.completed, g.reason])
            w.writerow([g.path, "TOTAL", g.points, g.max_points, "", g.completed, g.reason])


def _run(path: str, progress: str) -> int:
    """The runner process: execute the notebook, logging progress (cell, kernel pid, end)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    def note(**event):
        with open(progress, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=None, allow_errors=True, kernel_name="python3",
                            resources={"metadata": {"path": str(Path(path).parent.resolve())}})
    client.on_cell_start = lambda cell, cell_index: note(cell=cell_index)
    client.on_notebook_start = lambda notebook: note(kernel_pid=client.km.provisioner.pid)
    try:
        client.execute()
    except DeadKernelError:
        cells = [e["cell"] for e in _read_jsonl(Path(progress)) if "cell" in e]
        note(ended=f"the kernel died while running cell {cells[-1] if cells else '?'}")
        return 0
    note(ended="ok")
    return 0


if __name__ == "__main__":
    sys.exit(_run(sys.argv[1], sys.argv[2]))
