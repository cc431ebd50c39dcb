"""The registry of graded exercises: :func:`exercise` registers a checker, :func:`exercises` lists them.

Every lesson's ``lNN/checkers.py`` (beside this module) registers its checkers
when imported, which happens only when its lesson is asked for (``check("01...")``
imports lesson 01's checkers and no other); the grader takes an exercise's points
from here and nowhere else.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import re
from dataclasses import dataclass
from typing import Callable

_ID = re.compile(r"^\d\d\.[A-Za-z_][A-Za-z0-9_]*$")
_REGISTRY: dict[str, "Exercise"] = {}


@dataclass(frozen=True)
class Exercise:
    """A graded exercise: its id, points (one per case), description and checker, and the reference
    implementations (``"module:function"``) an answer must not call (:mod:`._references`)."""

    id: str
    points: int
    description: str
    checker: Callable
    references: tuple[str, ...] = ()

    @property
    def lesson(self) -> str:
        return self.id.split(".", 1)[0]


def exercise(exercise_id: str, points: int, description: str, references: tuple[str, ...] = ()):
    """Register the decorated function as the checker of ``exercise_id``.

    Args:
        references: the library's and torch's own versions of what the exercise
            builds, as ``"module:function"`` (a class: ``"module:Class"``, its
            ``__init__``); every check of the exercise fails an answer that calls one.

    Raises:
        ValueError: malformed id, non-positive points, a malformed reference, or an id registered twice.
    """
    if not _ID.match(exercise_id):
        raise ValueError(f"exercise id {exercise_id!r} must look like 'NN.name', e.g. '01.pick_device'")
    if points < 1:
        raise ValueError(f"exercise {exercise_id}: points={points} must be >= 1 (one per case)")
    bad = [r for r in references if not re.fullmatch(r"[\w.]+:[\w.]+", str(r))]
    if bad or isinstance(references, str):
        raise ValueError(f"exercise {exercise_id}: references={references!r} must be a tuple of "
                         "'package.module:function' names")

    def register(fn):
        if exercise_id in _REGISTRY and _REGISTRY[exercise_id].checker.__qualname__ != fn.__qualname__:
            raise ValueError(f"exercise {exercise_id} is registered twice")
        _REGISTRY[exercise_id] = Exercise(exercise_id, points, description, fn, tuple(references))
        return fn

    return register


def _load(lesson: str | None = None) -> None:
    """Import the checkers of ``lesson`` (e.g. ``"01"``), or of every lesson: nothing else."""
    # The lesson packages sit beside this module; found by path, not by importing
    # the package (which imports this module).
    for mod in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if mod.ispkg and re.fullmatch(r"l\d\d", mod.name) and (lesson is None or mod.name == f"l{lesson}"):
            importlib.import_module(f"{__package__}.{mod.name}.checkers")


def exercises(lesson: str | None = None) -> list[Exercise]:
    """Every registered exercise (of one lesson, e.g. ``"01"``), sorted by id.

    Example:
        >>> [e.id for e in exercises("01")]
        ['01.pick_device', '01.train_step', '01.visible_devices_env']
    """
    _load(lesson)
    return sorted((e for e in _REGISTRY.values() if lesson is None or e.lesson == lesson),
                  key=lambda e: e.id)


def get(exercise_id: str) -> Exercise:
    """The exercise with this id (only its lesson's checkers are imported); ValueError naming the known ids."""
    lesson = str(exercise_id).split(".", 1)[0]
    _load(lesson if re.fullmatch(r"\d\d", lesson) else None)
    if exercise_id not in _REGISTRY:
        known = [e.id for e in exercises(lesson)] or [e.id for e in exercises()]
        raise ValueError(f"no exercise {exercise_id!r}; known ids: {', '.join(known)}")
    return _REGISTRY[exercise_id]
