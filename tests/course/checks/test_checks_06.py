"""Checkers of lesson 06 against the solution, a stub, and answers that are no mutant of it.

The wrong answers made by editing the solution (a forgotten ``.to``, a wrong
weight, ...) are in tests/mutants/test_mutants_06.py; here are the solution
itself (read from the notebook), the stubs and answers of another shape. The
virtual devices the checks rely on are tested in test_sim.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
from torch import nn

from checking import case_starting, solutions_from
from mgpu_lab.course.checks import check, exercises

pytestmark = pytest.mark.timeout(300)
cloudpickle.register_pickle_by_value(sys.modules[__name__])
NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "06_model_parallel.ipynb"
SOLUTION = solutions_from(NOTEBOOK, ("TwoStageNet", "pipelined_step", "bubble_fraction"), {"torch": torch, "nn": nn})


def stub(*args, **kwargs):
    # defined here, not imported from checking: shipped by value, the check's process need not import
    # checking (and nbformat with it, seconds on a busy machine)
    raise NotImplementedError("write this")


class StubNet(nn.Module):
    def __init__(self, stage1, stage2, dev1, dev2):
        raise NotImplementedError("write this")


class PlainList:  # not a Module
    def __init__(self, stage1, stage2, dev1, dev2):
        self.stages = [stage1, stage2]

    def __call__(self, x):
        return self.stages[1](self.stages[0](x))


class CrashesInForward(nn.Module):
    def __init__(self, stage1, stage2, dev1, dev2):
        super().__init__()
        self.stage1, self.stage2 = stage1.to(dev1), stage2.to(dev2)

    def forward(self, x):
        raise RuntimeError("boom in forward")


def whole_batch(stage1, stage2, x, y, loss_fn, n_micro):  # no micro-batches at all
    d1, d2 = next(stage1.parameters()).device, next(stage2.parameters()).device
    loss = loss_fn(stage2(stage1(x.to(d1)).to(d2)), y.to(d2))
    loss.backward()
    return loss.item()


def test_the_lesson_registers_three_exercises_with_one_point_per_case():
    assert {e.id: e.points for e in exercises("06")} == {"06.TwoStageNet": 8, "06.pipelined_step": 8,
                                                        "06.bubble_fraction": 7}


@pytest.mark.parametrize("exercise_id, answer", [("06.TwoStageNet", StubNet), ("06.pipelined_step", stub),
                                                 ("06.bubble_fraction", stub)])
def test_a_stub_is_not_attempted(exercise_id, answer):
    result = check(exercise_id, answer)
    assert result.status == "not attempted" and result.points == 0, str(result)


def test_an_object_that_is_no_module_fails_the_first_case_and_the_rest_say_why():
    result = check("06.TwoStageNet", PlainList)
    first = case_starting(result, "is an nn.Module")
    assert not first.passed and first.got == "a PlainList" and "subclass nn.Module" in first.hint
    assert result.points == 0 and "the first case did not finish" in case_starting(result, "moves the input").hint


def test_an_error_in_forward_is_reported_with_the_line_that_raised():
    result = check("06.TwoStageNet", CrashesInForward)
    assert case_starting(result, "is an nn.Module").passed, str(result)
    out = case_starting(result, "forward gives the same output")
    assert not out.passed and "RuntimeError: boom in forward" in out.got and "in forward" in out.got, str(result)


def test_a_step_without_micro_batches_fails_only_the_micro_batch_case():
    result = check("06.pipelined_step", whole_batch)
    assert [c.name for c in result.cases if not c.passed] == [
        "batch 8, n_micro=4: both stages see 4 micro-batches of 2, and no pass over the whole batch"], str(result)
