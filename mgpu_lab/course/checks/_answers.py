"""``check(...)`` while a notebook is being graded: save the learner's objects, judge nothing.

When the grader runs a submission (in its sandbox) it sets
``MGPU_LAB_GRADE_ANSWERS`` to a folder. Every check cell then pickles its
arguments *by value* (cloudpickle: functions and classes defined in the
notebook travel with their code, as they are at that cell) into
``<folder>/<n>.pkl`` and appends ``{"exercise": id, "file": "<n>.pkl"}`` to
``<folder>/manifest.jsonl`` (or ``{"exercise": id, "error": why}`` when they
cannot be pickled). The grader later runs the exercise's checker itself, with
references to these files that only the sandbox resolves: it never unpickles
them, and it believes nothing in the manifest but which exercise a file answers.
"""
from __future__ import annotations

import json
import os

from ._result import CheckResult

ANSWERS_ENV = "MGPU_LAB_GRADE_ANSWERS"


def grading_folder() -> str | None:
    """The folder to save answers in, when a grader runs this notebook; else None."""
    return os.environ.get(ANSWERS_ENV) or None


def save(folder: str, exercise_id: str, points: int, answers: dict) -> CheckResult:
    """Save ``answers`` (parameter name -> object) for ``exercise_id``; a result that says so."""
    from ...launcher import pickling

    os.makedirs(folder, exist_ok=True)
    manifest = os.path.join(folder, "manifest.jsonl")
    n = sum(1 for _ in open(manifest)) if os.path.exists(manifest) else 0
    entry = {"exercise": exercise_id, "file": f"{n}.pkl"}
    try:
        data = pickling.dumps(answers)
        with open(os.path.join(folder, entry["file"]), "wb") as f:
            f.write(data)
        note = "recorded for grading: the grader runs this check after the notebook"
    except Exception as exc:  # noqa: BLE001 - the grader reports it as the reason for 0 points
        entry = {"exercise": exercise_id, "error": f"{type(exc).__name__}: {exc}"[:500]}
        note = f"could not be recorded for grading: {entry['error']}"
    with open(manifest, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
    return CheckResult(exercise_id, 0, points, "recorded", [], note)
