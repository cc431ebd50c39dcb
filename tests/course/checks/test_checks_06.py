"""Checkers of lesson 06 against the solution, a stub, answers that are no mutant of it, and the virtual GPUs.

The wrong answers made by editing the solution (a forgotten ``.to``, a wrong
weight, ...) are in tests/mutants/test_mutants_06.py; here are the solution
itself (read from the notebook), the stubs, answers of another shape, and the
virtual devices (``sim.placement``) the checks rely on, tested in this process.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
from torch import nn

from checking import case_starting, solutions_from
from mgpu_lab.course.checks import check, exercises
from mgpu_lab.course.checks.sim.placement import Placed, PlacedLoss, Stage, place, reset, where

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


# -- the virtual GPUs the checks rely on (sim.placement), in this process -----------------------------
def test_placed_tensors_keep_their_device_through_chunks_and_arithmetic_and_log_every_move():
    reset()
    x = place(torch.arange(8.0).reshape(4, 2), "inputs", "cpu")
    parts = torch.chunk(x, 2)
    assert [p.device for p in parts] == [torch.device("cpu")] * 2 and parts[0].tag == "inputs"
    moved = parts[1].to("cuda:3", non_blocking=True)
    assert moved.device == torch.device("cuda", 3) and (moved * 2 + 1).device == torch.device("cuda", 3)
    assert x.cuda().device == torch.device("cuda", 0) and x.to(moved).device == torch.device("cuda", 3)
    assert Placed.moves == [("inputs", "cpu", "cuda:3"), ("inputs", "cpu", "cuda"), ("inputs", "cpu", "cuda:3")]
    assert torch.equal(moved.as_subclass(torch.Tensor), torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    assert where(torch.ones(1)) == torch.device("cpu") and x.log().device == torch.device("cpu")


def test_a_stage_is_placed_by_to_reports_it_in_its_parameters_and_records_its_inputs():
    reset()
    stage = Stage(nn.Linear(2, 3), "stage1", "activations")
    assert stage.to(torch.device("cuda", 2)) is stage and next(stage.parameters()).device == torch.device("cuda", 2)
    assert next(copy.deepcopy(stage).parameters()).device == torch.device("cuda", 2)
    out = stage(place(torch.ones(5, 2), "inputs", "cpu"))
    assert out.device == torch.device("cuda", 2) and out.tag == "activations"
    assert Stage.log == [("stage1", "to", "cuda:2"), ("stage1", "input", "inputs", "cpu", "cuda:2", 5)]
    loss = PlacedLoss(nn.CrossEntropyLoss())(out, place(torch.tensor([0, 1, 2, 0, 1]), "labels", "cpu"))
    assert PlacedLoss.log == [("cuda:2", "cpu", "labels")] and loss.device == torch.device("cuda", 2)
    loss.backward()
    assert stage.inner.weight.grad is not None and stage.inner.weight.grad.shape == (3, 2)
