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
SOLUTION = solutions_from(NOTEBOOK, ("one_f_one_b", "bubble", "run_schedule"),
                          {"__name__": "__main__", "torch": torch, "nn": nn, "tdist": tdist})
IDS = ["12.one_f_one_b", "12.bubble", "12.run_schedule"]


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


def test_the_lesson_registers_three_exercises_and_the_executor_carries_half_the_points():
    points = {e.id: e.points for e in exercises("12")}
    assert points == {"12.one_f_one_b": 6, "12.bubble": 6, "12.run_schedule": 12}
    assert 2 * points["12.run_schedule"] >= sum(points.values())


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


def one_rank_runs_everything(stages, placement, actions, inputs, targets, loss_fn):
    """No pipeline: each rank runs its own stages' forwards on its own micro-batches or zeros, sends nothing."""
    for kind, s, i in actions:
        if kind == "F":
            module = stages[s]
            x = inputs[i] if inputs is not None and s == 0 else torch.zeros(2, module.inner[0].in_features)
            module(x).sum().backward()
    return None


def test_an_executor_without_messages_passes_no_case():
    result = check("12.run_schedule", one_rank_runs_everything)
    assert not any(c.passed for c in result.cases), str(result)


def test_the_random_orders_need_messages_out_of_the_order_they_were_sent():
    import random

    from mgpu_lab.course.checks.l12.checkers import NAMED, RANDOM, schedule_scenarios
    from mgpu_lab.course.checks.l12.judges import implied_peak, out_of_order

    for n_ranks in (2, 4):
        scenarios = schedule_scenarios(n_ranks, random.Random(n_ranks))
        for placement, actions, n_micro, _ in scenarios[len(NAMED):len(NAMED) + len(RANDOM)]:
            assert out_of_order(placement, actions), (placement, actions)
            assert sorted(a for acts in actions.values() for a in acts) == sorted(
                (k, s, i) for k in "FB" for s in range(len(placement)) for i in range(n_micro))
            assert all(placement[s] == r for r, acts in actions.items() for _, s, _ in acts)
        gpipe = scenarios[0][1]
        assert [implied_peak(gpipe[r]) for r in range(n_ranks)] == [4] * n_ranks


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
