"""Graded exercises: ``check(exercise_id, *answers)`` and the registry of exercises.

One package per lesson (``lNN/``: ``checkers``, ``ranks``, ``judges``) registers
its checkers with :func:`exercise`; :func:`exercises` lists every id with its
points and description. ``sim/`` is the simulation every lesson shares (GPUs in
name on a machine without one, several scenarios per launch, a call's outcome).

Example:
    >>> from mgpu_lab.course.checks import exercises
    >>> exercises("01")[0].id
    '01.pick_device'
"""
from ._core import CaseFailed, Exercise, NotAttempted, Tester, check, exercise, exercises, get, run_checker
from ._result import Case, CheckResult

__all__ = ["check", "run_checker", "exercises", "exercise", "get", "Exercise", "Tester", "CaseFailed",
           "NotAttempted", "Case", "CheckResult"]
