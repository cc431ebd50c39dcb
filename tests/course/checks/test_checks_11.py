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


def test_lesson_11_registers_its_five_exercises_and_sp_mlp_carries_half_the_points():
    got = {e.id: e.points for e in exercises("11")}
    assert got == {"11.tp_mlp": 6, "11.sp_mlp": 14, "11.tp_plan": 4, "11.parallelize_2d": 2, "11.tp_bytes": 2}
    assert 2 * got["11.sp_mlp"] >= sum(got.values())


@pytest.mark.parametrize("exercise, answer", [
    ("11.tp_mlp", (STUB, STUB_FN, STUB_FN)), ("11.sp_mlp", (STUB,)), ("11.tp_plan", (STUB,)),
    ("11.parallelize_2d", (STUB,)), ("11.tp_bytes", (STUB,))], ids=lambda v: v if isinstance(v, str) else "")
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


def test_zero_bytes_passes_no_case():
    result = check("11.tp_bytes", NOTHING_BYTES)
    assert result.points == 0, result
    assert "(the recorder's count)" in result.cases[0].expected, result


# -- sp_mlp: no case passes without its evidence ------------------------------------------------------------
LOCAL_SP = by_value('''
import torch.nn.functional as F


def on_my_slice(x_shard, norm, w1_shard, b1_shard, w2_shard, b2):
    """The block on this rank's slice and weights alone: a norm on the slice, and no communication at all."""
    return x_shard + F.linear(F.gelu(F.linear(norm(x_shard), w1_shard, b1_shard)), w2_shard, b2)
''', "on_my_slice")
AUTOGRAD_COLLECTIVES = by_value('''
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_gather, all_reduce


def with_torch_collectives(x_shard, norm, w1_shard, b1_shard, w2_shard, b2):
    """torch's collectives that carry their own backward: the conjugates are not the learner's."""
    whole = torch.cat(all_gather(norm(x_shard)), dim=1)
    partial = F.linear(F.gelu(F.linear(whole, w1_shard, b1_shard)), w2_shard)
    return x_shard + all_reduce(partial).chunk(dist.get_world_size(), dim=1)[dist.get_rank()] + b2
''', "with_torch_collectives")


def test_an_sp_mlp_that_never_communicates_passes_no_case():
    """Its norm does work on the slice: that case still fails, since the block it is part of is wrong."""
    result = check("11.sp_mlp", LOCAL_SP)
    assert result.points == 0, result
    assert "not judged" in case_starting(result, "every tensor it communicates").hint, result
    assert "no collective in forward" in case_starting(result, "forward:").hint, result


def test_an_sp_mlp_built_on_torch_s_autograd_collectives_fails_every_case_naming_them():
    result = check("11.sp_mlp", AUTOGRAD_COLLECTIVES)
    assert result.points == 0, result
    assert "torch.distributed.nn.functional.all_gather" in str(result), result
