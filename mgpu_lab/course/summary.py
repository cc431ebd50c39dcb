"""What a class got: per exercise, how many passed, and the failures most of them share.

:func:`summarize` reads the grades of a batch (:class:`~mgpu_lab.course.grade.NotebookGrade`
objects); :func:`table` prints it, :func:`plot` draws the pass rates with the
most common failure beside each bar, so an instructor sees which idea the class
missed.

Example:
    >>> from mgpu_lab.course.grade import ExerciseGrade, NotebookGrade
    >>> def graded(path, points, failed=None):   # as grade() returns them
    ...     cases = [{"name": failed, "passed": False}] if failed else []
    ...     status = "passed" if points == 6 else "failed"
    ...     return NotebookGrade(path, [ExerciseGrade("01.pick_device", points, 6, status, "", cases)])
    >>> grades = [graded("ann.ipynb", 6), graded("bob.ipynb", 5, "an index past the last GPU raises")]
    >>> print(table(summarize(grades)))
    exercise                     graded passed  rate      mean  most common failures
    01.pick_device                    2      1   50%   5.5/6    1x an index past the last GPU raises
"""
from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ExerciseSummary", "summarize", "table", "plot"]

NOT_DONE = {"not attempted": "not attempted", "not checked": "no check cell ran",
            "not judged": "could not be judged"}


@dataclass
class ExerciseSummary:
    exercise: str
    max_points: int
    graded: int = 0  # submissions of its lesson
    passed: int = 0  # full marks
    points: int = 0  # summed over the submissions
    failures: collections.Counter = field(default_factory=collections.Counter)

    @property
    def rate(self) -> float:
        return self.passed / self.graded if self.graded else 0.0

    @property
    def mean(self) -> float:
        return self.points / self.graded if self.graded else 0.0

    def common(self, n: int = 3) -> list[tuple[str, int]]:
        """The ``n`` most common failures, most common first (ties by name)."""
        return sorted(self.failures.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


_NUMBERS = re.compile(r"\d+(\.\d+)?")


def _failure(e) -> str:
    """What an exercise that did not pass failed on, in words shared by the learners who made that mistake.

    The first failed case's name (what it checks) and hint, or the reason it was
    not judged; the learner's own values are left out, so the same bug counts once.
    """
    if e.status in NOT_DONE:
        return NOT_DONE[e.status]
    for case in e.cases:
        if not case.get("passed"):
            name = ("hidden: " if case.get("hidden") else "") + case.get("name", "")
            return name + (f" (hint: {case['hint']})" if case.get("hint") else "")
    return _NUMBERS.sub("N", e.note)[:200] if e.note else e.status


def summarize(grades) -> list[ExerciseSummary]:
    """One :class:`ExerciseSummary` per exercise the grades hold, in exercise order (a notebook that was
    not graded counts nowhere: it is not a submission that scored 0)."""
    rows: dict[str, ExerciseSummary] = {}
    for g in grades:
        if not getattr(g, "graded", True):
            continue
        for e in g.exercises:
            row = rows.setdefault(e.exercise, ExerciseSummary(e.exercise, e.max_points))
            row.graded += 1
            row.points += e.points
            if e.status == "passed" and e.points == e.max_points:
                row.passed += 1
            else:
                row.failures[_failure(e)] += 1
    return [rows[k] for k in sorted(rows)]


def table(rows: list[ExerciseSummary], width: int = 70) -> str:
    """The summary as a text table: one line per exercise, then its most common failures."""
    out = [f"{'exercise':28} {'graded':>6} {'passed':>6} {'rate':>5} {'mean':>9}  most common failures"]
    for r in rows:
        common = r.common()
        first = f"{common[0][1]}x {common[0][0]}"[:width] if common else "-"
        out.append(f"{r.exercise:28} {r.graded:6d} {r.passed:6d} {r.rate:5.0%} {r.mean:5.1f}/{r.max_points:<3d}"
                   f"  {first}")
        out += [f"{'':58}  {n}x {what}"[:58 + 2 + width] for what, n in common[1:]]
    return "\n".join(out)


def plot(rows: list[ExerciseSummary], path: Path | str) -> Path:
    """Draw the pass rate per exercise (bars) with its most common failure, and save it to ``path``."""
    import matplotlib

    matplotlib.use("agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.2), constrained_layout=True)
    names = [r.exercise for r in rows][::-1]
    rates = [100 * r.rate for r in rows][::-1]
    colors = ["#c0392b" if v < 50 else "#e67e22" if v < 80 else "#27ae60" for v in rates]
    ax.barh(names, rates, color=colors)
    for y, r in enumerate(rows[::-1]):
        common = r.common(1)
        label = f" {r.passed}/{r.graded}" + (f"  most failed: {common[0][0][:70]} ({common[0][1]})" if common else "")
        ax.text(1, y, label, va="center", fontsize=8)
    ax.set_xlim(0, 100)
    ax.set_xlabel("submissions with full marks (%)")
    ax.set_title(f"Pass rate per exercise ({max((r.graded for r in rows), default=0)} submissions per lesson at most)")
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
