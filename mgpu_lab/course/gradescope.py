"""Grades in Gradescope's autograder format: one ``results.json`` per submission.

Gradescope reads ``/autograder/results/results.json`` (its "Autograder
Specifications"): a top-level ``score``, ``output`` and ``tests``, each test
with ``name``, ``score``, ``max_score``, ``output`` and ``visibility``.
Here every judged case is a test worth one point; a hidden case is
``"after_published"`` (students see it only once the grades are published) with
no output, so its details never reach them, as in the notebook. An exercise
that was not judged (not attempted, not checked, could not be judged) is one
test worth its points, with the reason.

Example:
    >>> import json, tempfile
    >>> from mgpu_lab.course.grade import ExerciseGrade, NotebookGrade
    >>> grades = [NotebookGrade("class/ann/01_devices.ipynb", [ExerciseGrade("01.pick_device", 0, 6, "not attempted")])]
    >>> out = tempfile.mkdtemp()
    >>> [p.relative_to(out) for p in write_gradescope(grades, out)]   # a grade(...) result, in practice
    [PosixPath('01_devices/results.json')]
    >>> results = json.loads((Path(out) / "01_devices" / "results.json").read_text())
    >>> results["score"], [(t["name"], t["max_score"]) for t in results["tests"]]
    (0, [('01.pick_device: not attempted', 6)])
"""
from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["results_json", "write_gradescope"]

HIDDEN = "after_published"


def _case_output(case: dict) -> str:
    if case["passed"]:
        return ""
    lines = []
    if case.get("expected") or case.get("got"):
        lines += [f"expected: {case.get('expected', '')}", f"got:      {case.get('got', '')}"]
    if case.get("hint"):
        lines.append(f"hint: {case['hint']}")
    return "\n".join(lines)


def results_json(g) -> dict:
    """The Gradescope results of one :class:`~mgpu_lab.course.grade.NotebookGrade`."""
    tests = []
    for e in g.exercises:
        if not e.cases:
            reason = e.note or {"not checked": "no check cell of this exercise ran",
                                "not attempted": "not attempted: the code still raises NotImplementedError"}.get(
                                    e.status, e.status)
            tests.append({"name": f"{e.exercise}: {e.status}", "score": e.points, "max_score": e.max_points,
                          "output": reason, "visibility": "visible"})
            continue
        for i, case in enumerate(e.cases, 1):
            hidden = bool(case.get("hidden"))
            worth = case.get("points", 1)  # grades kept before cases had weights: one point each
            out = "" if hidden else _case_output(case)
            if i == 1 and e.note and not hidden:
                out = f"{e.note}\n{out}".strip()
            tests.append({"name": f"{e.exercise} #{i}: " + ("hidden case: " if hidden else "") + case["name"],
                          "score": worth if case["passed"] else 0, "max_score": worth, "output": out,
                          "visibility": HIDDEN if hidden else "visible"})
    output = f"{g.points}/{g.max_points}" + ("" if g.completed else f" ({g.reason})")
    return {"score": g.points, "output": output, "tests": tests}


def _names(grades) -> list[str]:
    """A folder name per submission: its path below their common folder, '/' -> '__', no suffix."""
    paths = [Path(os.path.abspath(g.path)) for g in grades]
    common = Path(os.path.commonpath([p.parent for p in paths])) if paths else Path("/")
    names, seen = [], set()
    for p in paths:
        name = "__".join(p.relative_to(common).with_suffix("").parts) or p.stem
        base, k = name, 2
        while name in seen:
            name, k = f"{base}-{k}", k + 1
        seen.add(name)
        names.append(name)
    return names


def write_gradescope(grades, out: Path | str) -> list[Path]:
    """Write ``OUT/<submission>/results.json`` for every graded notebook (one that was not graded gets
    none: it has no score yet); the files written."""
    out = Path(out)
    written = []
    for g, name in zip(grades, _names(grades)):
        if not getattr(g, "graded", True):
            continue
        target = out / name / "results.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(results_json(g), indent=1) + "\n", encoding="utf-8")
        written.append(target)
    return written
