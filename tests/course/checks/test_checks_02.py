"""Checkers of lesson 02 against the solution, the library's reference answers, a stub, a crash.

The right answers are the ones in solutions/02_data_loading.ipynb, read from
the notebook itself. Every answer runs through ``check()`` for real: fresh
processes, real DataLoaders, real workers. The wrong answers each check exists
for are the named mutants of tests/mutants/test_mutants_02.py.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

from checking import solutions_from
from mgpu_lab.data import loaders
from mgpu_lab.course.checks import check, exercises

pytestmark = pytest.mark.timeout(300)
# The answers below travel to the check's processes by value, as notebook functions do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "02_data_loading.ipynb"
POINTS = {"02.best_num_workers": 5, "02.make_loader": 7, "02.seed_worker": 6}
NAMES = {"02.best_num_workers": "best_num_workers", "02.make_loader": "make_loader", "02.seed_worker": "seed_worker"}
SOLUTION = solutions_from(NOTEBOOK, tuple(NAMES.values()),
                          {"torch": torch, "np": np, "random": random, "time": time, "DataLoader": DataLoader,
                           "get_worker_info": get_worker_info})


def stub(*args, **kwargs):
    raise NotImplementedError("write this function")


def test_registered():
    assert [(e.id, e.points) for e in exercises("02")] == list(POINTS.items())


@pytest.mark.parametrize("exercise_id", list(POINTS))
def test_the_library_reference_gets_full_marks(exercise_id):
    """mgpu_lab.data.loaders is what the lesson's demos fall back on: it must be right too."""
    result = check(exercise_id, getattr(loaders, NAMES[exercise_id]))
    assert result.points == result.max_points, str(result)


@pytest.mark.parametrize("exercise_id", list(POINTS))
def test_stub_is_not_attempted(exercise_id):
    result = check(exercise_id, stub)
    assert (result.status, result.points) == ("not attempted", 0), str(result)


def seed_that_crashes_the_worker(worker_id):
    raise RuntimeError("boom in the worker")


def test_an_error_in_a_worker_fails_every_case_with_its_reason():
    result = check("02.seed_worker", seed_that_crashes_the_worker)
    assert result.points == 0
    assert "RuntimeError in a worker" in result.cases[0].got and "boom" in result.cases[0].got
    assert all(c.got == "skipped" for c in result.cases[1:]), str(result)
