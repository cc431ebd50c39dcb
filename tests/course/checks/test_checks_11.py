"""Lesson 11's checkers against stubs, answers that call a reference and answers that do nothing
(tests/mutants/test_mutants_11.py has the named mutants and the correct variants)."""
from __future__ import annotations

import pytest

from checking import by_value, case_starting
from mgpu_lab.course.checks import check, exercises

pytestmark = pytest.mark.timeout(300)


STUB = by_value("def stub(*args, **kwargs):\n    raise NotImplementedError('write this')\n", "stub")
STUB_FN = by_value('''
import torch


class StubFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        raise NotImplementedError("write this")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("write this")
''', "StubFn")


def test_lesson_11_registers_its_four_exercises_with_one_point_per_case():
    got = {e.id: e.points for e in exercises("11")}
    assert got == {"11.tp_mlp": 6, "11.tp_plan": 8, "11.parallelize_2d": 5, "11.tp_bytes": 4}


@pytest.mark.parametrize("exercise, answer", [
    ("11.tp_mlp", (STUB, STUB_FN, STUB_FN)), ("11.tp_plan", (STUB,)), ("11.parallelize_2d", (STUB,)),
    ("11.tp_bytes", (STUB,))], ids=lambda v: v if isinstance(v, str) else "")
def test_a_stub_is_not_attempted(exercise, answer):
    assert check(exercise, *answer).status == "not attempted"


LIBRARY_PLAN = by_value('''
def library_plan(block, sequence_parallel):
    from mgpu_lab.tensor_parallel.plans import block_plan as mine   # the reference, under another name
    return mine(block, sequence_parallel)
''', "library_plan")


def test_an_answer_that_calls_a_reference_fails_every_case_naming_it():
    result = check("11.tp_plan", LIBRARY_PLAN)
    assert result.points == 0, result
    assert "mgpu_lab.tensor_parallel.plans.block_plan" in str(result), result


# -- answers that do nothing pass no case that names a behaviour they lack ---------------------------------
NOTHING_MLP = by_value('''
import torch
import torch.nn.functional as F


class Same(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def local_mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
''', "local_mlp", "Same")
NOTHING_PLAN = by_value("def no_plan(block, sequence_parallel):\n    return {}\n", "no_plan")
NOTHING_2D = by_value("def unchanged(model, mesh):\n    return model\n", "unchanged")
NOTHING_BYTES = by_value("def zero(batch, seq, hidden, tp, sequence_parallel):\n    return 0\n", "zero")


def test_an_mlp_that_never_communicates_passes_no_case():
    local_mlp, same = NOTHING_MLP
    result = check("11.tp_mlp", local_mlp, same, same)
    assert result.points == 0, result
    assert "own gradient" in case_starting(result, "CopyToTP").hint


def test_an_empty_plan_passes_no_case():
    result = check("11.tp_plan", NOTHING_PLAN)
    assert result.points == 0, result
    assert "whole" in case_starting(result, "without SP, 2 ranks").got


def test_a_2d_wrap_that_does_nothing_passes_no_case():
    result = check("11.parallelize_2d", NOTHING_2D)
    assert result.points == 0, result
    assert "neither" in case_starting(result, "TP first").got


def test_zero_bytes_passes_only_the_case_of_one_rank():
    result = check("11.tp_bytes", NOTHING_BYTES)
    assert [c.name for c in result.cases if c.passed] == [
        "tp=1, with and without SP: a block on one rank hands nothing to collectives"], result
