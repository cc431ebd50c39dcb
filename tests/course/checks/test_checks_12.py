"""Checkers of lesson 12 against the solution, stubs, do-nothing answers and answers of another shape.

The wrong answers made by editing the solution are in tests/mutants/test_mutants_12.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed as tdist
from torch import nn

from checking import solutions_from
from mgpu_lab.course.checks import check, exercises

pytestmark = pytest.mark.timeout(300)
cloudpickle.register_pickle_by_value(sys.modules[__name__])
NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "12_pipeline_schedules.ipynb"
SOLUTION = solutions_from(NOTEBOOK, ("one_f_one_b", "bubble", "pipeline_train"),
                          {"__name__": "__main__", "torch": torch, "nn": nn, "tdist": tdist})
IDS = ["12.one_f_one_b", "12.bubble", "12.pipeline_train"]


def stub(*args, **kwargs):
    raise NotImplementedError("write this")


def does_nothing(*args, **kwargs):
    return None


def empty_order(rank, n_stages, n_micro):
    return []


def gpipe_order(rank, n_stages, n_micro):
    """Right but GPipe's: every forward, then every backward."""
    return [f"F{i}" for i in range(n_micro)] + [f"B{i}" for i in range(n_micro)]


def formula_everywhere(schedule, n_stages, n_micro, t_f, t_b, t_w=0.0, virtual=1):
    return (n_stages - 1) / (n_micro + n_stages - 1)


def test_the_lesson_registers_three_exercises_with_one_point_per_case():
    assert {e.id: e.points for e in exercises("12")} == {"12.one_f_one_b": 6, "12.bubble": 6,
                                                        "12.pipeline_train": 6}


@pytest.mark.parametrize("exercise_id", IDS)
def test_the_solution_gets_full_marks_and_a_stub_is_not_attempted(exercise_id):
    result = check(exercise_id, SOLUTION[exercise_id.split(".")[1]])
    assert result.points == result.max_points, str(result)
    result = check(exercise_id, stub)
    assert result.status == "not attempted" and result.points == 0, str(result)


@pytest.mark.parametrize("exercise_id", IDS)
def test_an_answer_that_does_nothing_passes_no_case(exercise_id):
    result = check(exercise_id, does_nothing)
    assert not any(c.passed for c in result.cases), str(result)


def test_an_empty_order_passes_no_case_and_gpipe_s_order_fails_only_the_memory_bound():
    result = check("12.one_f_one_b", empty_order)
    assert not any(c.passed for c in result.cases), str(result)
    result = check("12.one_f_one_b", gpipe_order)  # runs, right gradients, but holds every micro-batch
    assert [c.passed for c in result.cases] == [True, True, True, False, False, False], str(result)
    assert "rank 0 had 8 micro-batches alive at once" in result.cases[3].got, str(result)


def test_the_closed_formula_passes_only_where_it_holds():
    result = check("12.bubble", formula_everywhere)
    assert [c.passed for c in result.cases] == [True, False, False, False, False, False], str(result)
    assert "yours matches the closed formula" in result.cases[1].hint, str(result)
    assert result.cases[1].expected.startswith("bubble('interleaved', 4, 8, 1.0, 2.0, 0.0, 2) = 0.1579"), str(result)


def one_process_on_rank_0(model_fn, n_stages, schedule, n_micro, batches, lr):
    """The visible part without the pipeline: rank 0 trains the whole model alone; its weights are right."""
    if tdist.get_rank() != 0:
        return None
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def test_weights_right_without_a_pipeline_fail_the_case_that_the_schedule_ran():
    result = check("12.pipeline_train", one_process_on_rank_0)
    assert [c.passed for c in result.cases] == [True, True, True, True, True, False], str(result)
    ran = result.cases[-1]
    assert ran.name.startswith("the schedule really ran") and "rank 0 built no ScheduleGPipe" in ran.got, str(result)


def warmup_reversed(rank, n_stages, n_micro):
    """The warm-up counted from the wrong end: rank 0 waits for a gradient rank 1 cannot make yet."""
    warm = min(rank, n_micro)
    order = [f"F{i}" for i in range(warm)]
    for i in range(n_micro - warm):
        order += [f"F{warm + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(n_micro - warm, n_micro)]


def test_a_deadlocking_order_fails_in_bounded_time_saying_where_each_rank_waits():
    import time

    start = time.perf_counter()
    result = check("12.one_f_one_b", warmup_reversed)
    assert time.perf_counter() - start < 120, "a deadlock must end after the receive timeout, not the launch's"
    replay = result.cases[1]
    assert not replay.passed and "deadlock, found in bounded time" in replay.got, str(result)
    assert "rank 0 waits at B0 (the gradient of micro-batch 0) for rank 1" in replay.got, str(result)
    assert "rank 1 waits at F1 (the activations of micro-batch 1) for rank 0" in replay.got, str(result)
    said = [c for c in result.cases if not c.passed]
    assert sum(replay.hint == c.hint for c in said) == 1, f"the order's hint is said once:\n{result}"
    assert sum("4 stages, 8 micro-batches: deadlock" in c.got for c in said) == 1, f"the deadlock is told once:\n{result}"
    assert "micro-batches than stages a rank cannot" not in str(result), f"no hint about the shrink:\n{result}"


def short_warmup(rank, n_stages, n_micro):
    """One warm-up forward too few: it runs and keeps the memory bound, but leaves ranks idle."""
    warm = min(max(n_stages - rank - 2, 0), n_micro)
    order = [f"F{i}" for i in range(warm)]
    for i in range(n_micro - warm):
        order += [f"F{warm + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(n_micro - warm, n_micro)]


def test_a_warm_up_one_short_runs_but_fails_on_its_bubble():
    result = check("12.one_f_one_b", short_warmup)
    assert [c.passed for c in result.cases][:3] == [True, True, True], str(result)
    assert "idle" in result.cases[3].got and "gpipe's bubble" in result.cases[3].hint.lower(), str(result)
