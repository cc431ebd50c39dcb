"""Checkers of lesson 02 against the solution, a call of the library's sweep, a stub, nothing, a crash.

The right answers are the ones in solutions/02_data_loading.ipynb, read from
the notebook itself; mgpu_lab.data.throughput's sweep is the reference an answer to
best_num_workers must not call. Every answer runs through ``check()`` for real: fresh
processes, real DataLoaders, real workers. The wrong answers each check exists
for are the named mutants of tests/mutants/test_mutants_02.py.
"""
from __future__ import annotations

import os
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
from mgpu_lab.course.checks import check, exercises

pytestmark = pytest.mark.timeout(300)
# The answers below travel to the check's processes by value, as notebook functions do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "02_data_loading.ipynb"
POINTS = {"02.best_num_workers": 5, "02.make_loader": 2, "02.seed_worker": 7}
NAMES = {"02.best_num_workers": "best_num_workers", "02.make_loader": "make_loader", "02.seed_worker": "seed_worker"}
SOLUTION = solutions_from(NOTEBOOK, tuple(NAMES.values()),
                          {"torch": torch, "np": np, "random": random, "time": time, "os": os, "DataLoader": DataLoader,
                           "get_worker_info": get_worker_info})


def stub(*args, **kwargs):
    raise NotImplementedError("write this function")


def test_registered():
    assert [(e.id, e.points) for e in exercises("02")] == list(POINTS.items())


@pytest.mark.parametrize("exercise_id", list(POINTS))
def test_the_solution_gets_full_marks(exercise_id):
    result = check(exercise_id, SOLUTION[NAMES[exercise_id]])
    assert result.points == result.max_points, str(result)


@pytest.mark.parametrize("exercise_id", list(POINTS))
def test_an_answer_that_does_nothing_passes_no_case(exercise_id):
    """A function that returns None (and seeds, builds, measures nothing) passes no case but those it truly
    meets: a seed_worker that does nothing runs in the workers, and repeats (the DataLoader seeds torch)."""
    result = check(exercise_id, lambda *args, **kwargs: None)
    passed = [c.name for c in result.cases if c.passed]
    assert passed == [], str(result)


# Trivially wrong answers a learner would try: DataLoader with its defaults, torch seeded from worker_id,
# a candidate picked without measuring, and the notebook's own sweep (its demo's measurement).
def plain_loader(dataset, batch_size, device, num_workers=0, train=True):
    return DataLoader(dataset, batch_size)


def seed_from_worker_id(worker_id):
    torch.manual_seed(worker_id)


def first_candidate(dataset, candidates, batch_size, n_batches):
    return candidates[0]


def last_candidate(dataset, candidates, batch_size, n_batches):
    return candidates[-1]


def most_workers(dataset, candidates, batch_size, n_batches):
    return max(candidates)


def fewest_workers(dataset, candidates, batch_size, n_batches):
    return min(candidates)


@pytest.mark.parametrize("exercise_id, answer", [
    ("02.make_loader", plain_loader), ("02.seed_worker", seed_from_worker_id),
    ("02.best_num_workers", first_candidate), ("02.best_num_workers", last_candidate),
    ("02.best_num_workers", most_workers), ("02.best_num_workers", fewest_workers)])
def test_a_trivially_wrong_answer_passes_no_case(exercise_id, answer):
    result = check(exercise_id, answer)
    assert [c.name for c in result.cases if c.passed] == [], str(result)


def sweep_of_the_demo(dataset, candidates, batch_size, n_batches):
    from mgpu_lab.data.rates import sweep_workers  # the measurement behind the demo's show_sweep

    rows = sweep_workers(dataset, candidates, batch_size=batch_size, n_batches=n_batches, progress=False)
    return max(rows, key=lambda r: r["samples_per_s"])["num_workers"]


def test_the_demo_s_sweep_is_a_reference():
    result = check("02.best_num_workers", sweep_of_the_demo)
    assert result.points == 0, str(result)
    assert "your code calls mgpu_lab.data.rates.sweep_workers" in result.cases[0].got, str(result)


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
    assert all(c.got == "skipped" for c in result.cases[1:-1]), str(result)
    assert "boom" in result.cases[-1].got, str(result)  # the one-process case runs it again, on its own


# -- a case passes only with its evidence: the warm-up, for workers too ---------------------------------------
def warms_up_without_workers_only(dataset, candidates, batch_size, n_batches):
    """Draws the warm-up batch the count asks of num_workers=0, and none with workers: their start-up is timed
    (with workers the count cannot tell, as they prefetch)."""
    best, best_rate = None, -1.0
    for k in candidates:
        it = iter(DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=k))
        if k == 0:
            next(it)
        start = time.perf_counter()
        for _ in range(n_batches):
            next(it)
        rate = n_batches * batch_size / (time.perf_counter() - start)
        del it
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def test_the_warm_up_case_needs_the_workers_start_up_left_out():
    result = check("02.best_num_workers", warms_up_without_workers_only)
    warm = next(c for c in result.cases if c.name.startswith("warm-up"))
    assert not warm.passed and "start-up" in warm.hint and "returned 0" in warm.got, str(result)
