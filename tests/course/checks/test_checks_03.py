"""Checkers of lesson 03 against the solution, a stub, and an answer that raises.

The right answers are the ones in solutions/03_data_parallel.ipynb, read from
the notebook itself. The wrong answers each check exists for are the named
mutants of tests/mutants/test_mutants_03.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
from torch import nn

from checking import solutions_from
from mgpu_lab.course.checks import check, exercises
from mgpu_lab.parallel.data_parallel import parallel_apply, replicate

pytestmark = pytest.mark.timeout(180)
cloudpickle.register_pickle_by_value(sys.modules[__name__])
NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "03_data_parallel.ipynb"
POINTS = {"03.data_parallel_forward": 7, "03.split_batch": 6}
NAMES = {"03.data_parallel_forward": "data_parallel_forward", "03.split_batch": "split_batch"}
SOLUTION = solutions_from(NOTEBOOK, ("split_batch", "data_parallel_forward"),
                          {"torch": torch, "nn": nn, "replicate": replicate, "parallel_apply": parallel_apply})


def stub(*args, **kwargs):
    raise NotImplementedError("write this function")


def dp_raises(model, batch, devices):
    raise RuntimeError("Expected all tensors to be on the same device")


def test_registered():
    assert [(e.id, e.points) for e in exercises("03")] == list(POINTS.items())


@pytest.mark.parametrize("exercise_id", list(POINTS))
def test_stub_is_not_attempted(exercise_id):
    result = check(exercise_id, stub)
    assert result.status == "not attempted" and result.points == 0, str(result)


def test_an_error_in_the_answer_is_named_in_every_visible_case():
    result = check("03.data_parallel_forward", dp_raises)
    assert result.points == 0
    visible = [c for c in result.cases if not c.hidden]
    assert all("RuntimeError: Expected all tensors" in c.got for c in visible), str(result)
