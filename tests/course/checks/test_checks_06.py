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
import torch.distributed as tdist
from torch import nn

from checking import case_starting, solutions_from
from mgpu_lab.course.checks import check, exercises

pytestmark = pytest.mark.timeout(300)
cloudpickle.register_pickle_by_value(sys.modules[__name__])
NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "06_model_parallel.ipynb"
SOLUTION = solutions_from(NOTEBOOK, ("stage_step", "pipelined_step", "bubble_fraction"),
                          {"__name__": "__main__", "torch": torch, "nn": nn, "tdist": tdist})


def stub(*args, **kwargs):
    # defined here, not imported from checking: shipped by value, the check's process need not import
    # checking (and nbformat with it, seconds on a busy machine)
    raise NotImplementedError("write this")


def returns_nothing(stage, x, target, loss_fn, optimizer, act_shape):
    return None


def forward_only(stage, x, target, loss_fn, optimizer, act_shape):
    """Activations forward, a loss, but no gradient back and no step: nothing trains."""
    if tdist.get_rank() == 0:
        tdist.send(stage(x).detach(), 1)
        return None
    h = torch.empty(act_shape)
    tdist.recv(h, 0)
    return loss_fn(stage(h), target).item()


def never_receives(stage, x, target, loss_fn, optimizer, act_shape):
    """Rank 1 waits for activations that rank 0 never sends: a hang."""
    if tdist.get_rank() == 1:
        h = torch.empty(act_shape)
        tdist.recv(h, 0)
    return None


def whole_batch(stage1, stage2, x, y, loss_fn, n_micro):  # no micro-batches at all
    d1, d2 = next(stage1.parameters()).device, next(stage2.parameters()).device
    loss = loss_fn(stage2(stage1(x.to(d1)).to(d2)), y.to(d2))
    loss.backward()
    return loss.item()


def test_the_lesson_registers_three_exercises_with_one_point_per_case():
    assert {e.id: e.points for e in exercises("06")} == {"06.stage_step": 4, "06.pipelined_step": 8,
                                                        "06.bubble_fraction": 6}


@pytest.mark.parametrize("exercise_id, answer", [("06.stage_step", stub), ("06.pipelined_step", stub),
                                                 ("06.bubble_fraction", stub)])
def test_a_stub_is_not_attempted(exercise_id, answer):
    result = check(exercise_id, answer)
    assert result.status == "not attempted" and result.points == 0, str(result)


@pytest.mark.parametrize("exercise_id", ["06.stage_step", "06.pipelined_step", "06.bubble_fraction"])
def test_the_solution_gets_full_marks(exercise_id):
    result = check(exercise_id, SOLUTION[exercise_id.split(".")[1]])
    assert result.points == result.max_points, str(result)


def test_trivial_stage_steps_pass_no_case_naming_a_behaviour_they_lack():
    result = check("06.stage_step", returns_nothing)  # completes, but sends nothing, returns no loss, trains nothing
    assert [c.passed for c in result.cases] == [False, False, False, False], str(result)
    assert "rank 0 sent 0 tensor(s) and rank 1 sent 0" in result.cases[0].hint, str(result)
    result = check("06.stage_step", forward_only)  # a loss on rank 1, but no gradient goes back and nothing trains
    assert [c.passed for c in result.cases] == [False, True, False, False], str(result)
    assert "rank 1 sent 0 tensor(s)" in result.cases[0].hint, str(result)
    assert "never changed" in case_starting(result, "two ranks train").hint, str(result)


def gpipe_formula(forward, backward, n_micro, transfer=0.0):
    """Section 3's formula, copied: right for equal stages and free transfers only."""
    p = len(forward)
    return (p - 1) / (n_micro + p - 1)


def test_the_formula_of_the_text_passes_only_the_case_of_equal_stages_and_free_transfers():
    result = check("06.bubble_fraction", gpipe_formula)
    assert [c.passed for c in result.cases] == [True, False, False, False, False, False], str(result)


def does_nothing(*args, **kwargs):
    return None


@pytest.mark.parametrize("exercise_id", ["06.pipelined_step", "06.bubble_fraction"])
def test_an_answer_that_does_nothing_passes_no_case(exercise_id):
    result = check(exercise_id, does_nothing)
    assert not any(c.passed for c in result.cases), str(result)


def test_a_stage_step_that_hangs_fails_in_bounded_time(monkeypatch):
    from mgpu_lab.course.checks.l06 import checkers

    monkeypatch.setattr(checkers, "STAGE_TIMEOUT", 6.0)
    result = check("06.stage_step", never_receives)
    got = result.cases[0].got
    # the recorder of the sends sees every rank waiting and names the receive that cannot match; else the limit
    assert result.points == 0 and ("rank 1 waits in recv from 0" in got or "no answer within 6 s" in got), str(result)
    assert "every send needs its receive" in result.cases[0].hint


def test_a_step_without_micro_batches_fails_only_the_micro_batch_case():
    result = check("06.pipelined_step", whole_batch)
    assert [c.name for c in result.cases if not c.passed] == [
        "batch 8, n_micro=4: both stages see 4 micro-batches of 2, and no pass over the whole batch"], str(result)
