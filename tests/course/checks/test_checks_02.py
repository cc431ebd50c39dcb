"""Checkers of lesson 02 against right answers, a stub, and the wrong answers they exist for.

Every answer runs through ``check()`` for real: fresh processes, real DataLoaders, real workers.
"""
from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from mgpu_lab.course.checks import check, exercises

pytestmark = pytest.mark.timeout(300)


# -- right answers (as in solutions/02_data_loading.ipynb) -------------------------------
def make_loader(dataset, batch_size, device, num_workers=0, train=True):
    return DataLoader(dataset, batch_size=batch_size, shuffle=train, drop_last=train, num_workers=num_workers,
                      pin_memory=torch.device(device).type == "cuda", persistent_workers=num_workers > 0)


def seed_worker(worker_id):
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def seed_worker_info(worker_id):  # another right answer: the seed from get_worker_info()
    seed = torch.utils.data.get_worker_info().seed % 2**32
    random.seed(seed)
    np.random.seed(seed)


def _timed(dataset, k, batch_size, n_batches, warmup):
    it = iter(DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=k))
    for _ in range(warmup):
        next(it)
    start = time.perf_counter()
    for _ in range(n_batches):
        next(it)
    return time.perf_counter() - start


def best_num_workers(dataset, candidates, batch_size, n_batches):
    times = {k: _timed(dataset, k, batch_size, n_batches, max(1, k)) for k in candidates}
    return min(times, key=times.get)


def stub(*args, **kwargs):
    raise NotImplementedError("write this function")


# -- wrong answers ----------------------------------------------------------------------
def loader_always_shuffles(dataset, batch_size, device, num_workers=0, train=True):
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=num_workers,
                      pin_memory=torch.device(device).type == "cuda", persistent_workers=num_workers > 0)


def loader_keeps_last(dataset, batch_size, device, num_workers=0, train=True):
    return DataLoader(dataset, batch_size=batch_size, shuffle=train, num_workers=num_workers,
                      pin_memory=torch.device(device).type == "cuda", persistent_workers=num_workers > 0)


def loader_pins_if_available(dataset, batch_size, device, num_workers=0, train=True):
    return DataLoader(dataset, batch_size=batch_size, shuffle=train, drop_last=train, num_workers=num_workers,
                      pin_memory=torch.cuda.is_available(), persistent_workers=num_workers > 0)


def loader_never_persistent(dataset, batch_size, device, num_workers=0, train=True):
    return DataLoader(dataset, batch_size=batch_size, shuffle=train, drop_last=train, num_workers=num_workers,
                      pin_memory=torch.device(device).type == "cuda")


def loader_always_persistent(dataset, batch_size, device, num_workers=0, train=True):
    return DataLoader(dataset, batch_size=batch_size, shuffle=train, drop_last=train, num_workers=num_workers,
                      pin_memory=torch.device(device).type == "cuda", persistent_workers=True)


def seed_nothing(worker_id):
    pass


def seed_unreduced(worker_id):
    np.random.seed(torch.initial_seed())
    random.seed(torch.initial_seed())


def seed_constant(worker_id):
    np.random.seed(0)
    random.seed(0)


def seed_worker_id(worker_id):
    np.random.seed(worker_id)
    random.seed(worker_id)


def seed_numpy_only(worker_id):
    np.random.seed(torch.initial_seed() % 2**32)


def seed_from_os(worker_id):
    seed = int.from_bytes(os.urandom(4), "little")
    np.random.seed(seed)
    random.seed(seed)


def best_largest(dataset, candidates, batch_size, n_batches):
    return max(candidates)


def best_without_warmup(dataset, candidates, batch_size, n_batches):
    times = {k: _timed(dataset, k, batch_size, n_batches, 0) for k in candidates}
    return min(times, key=times.get)


def best_whole_epochs(dataset, candidates, batch_size, n_batches):
    times = {}
    for k in candidates:
        start = time.perf_counter()
        for _ in DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=k):
            pass
        times[k] = time.perf_counter() - start
    return min(times, key=times.get)


def _failed(result) -> list[str]:
    return [c.name for c in result.cases if not c.passed]


def _case(result, text):
    return next(c for c in result.cases if text in c.name)


def test_registered():
    ids = [e.id for e in exercises("02")]
    assert ids == ["02.best_num_workers", "02.make_loader", "02.seed_worker"]


@pytest.mark.parametrize("exercise_id, answer", [
    ("02.make_loader", make_loader), ("02.seed_worker", seed_worker),
    ("02.seed_worker", seed_worker_info), ("02.best_num_workers", best_num_workers)])
def test_right_answers_get_full_marks(exercise_id, answer):
    result = check(exercise_id, answer)
    assert result.passed, str(result)
    assert result.points == result.max_points


@pytest.mark.parametrize("exercise_id", ["02.make_loader", "02.seed_worker", "02.best_num_workers"])
def test_stub_is_not_attempted(exercise_id):
    result = check(exercise_id, stub)
    assert result.status == "not attempted", str(result)
    assert result.points == 0


@pytest.mark.parametrize("answer, failing, hint, specific", [
    (loader_always_shuffles, ["train=False"], "shuffle=False", True),
    (loader_keeps_last, ["train=True: shuffles"], "drop_last=True", True),
    (loader_pins_if_available, ["device=torch.device('cuda')", "device=cpu on a machine with 2 GPUs"],
     "not from torch.cuda.is_available()", True),
    (loader_never_persistent, ["num_workers=2"], "persistent_workers=(num_workers > 0)", True),
    # DataLoader itself refuses persistent_workers=True without workers: every such case fails
    (loader_always_persistent, ["num_workers=0"], "persistent_workers=(num_workers > 0)", False),
])
def test_make_loader_wrong_answers(answer, failing, hint, specific):
    result = check("02.make_loader", answer)
    for name in failing:
        case = _case(result, name)
        assert not case.passed, str(result)
        assert hint in case.hint, str(result)
    if specific:  # only the cases of this bug fail (and the hidden one, where it shares the bug)
        assert len(_failed(result)) <= len(failing) + 1, str(result)


@pytest.mark.parametrize("answer, failing, hint", [
    (seed_nothing, ["NumPy: two workers", "Python's random: two workers"], "the classic bug"),
    (seed_unreduced, ["runs in real workers"], "% 2**32"),
    (seed_constant, ["NumPy: two workers", "another generator seed"], "the classic bug"),
    (seed_worker_id, ["another generator seed"], "worker_id"),
    (seed_numpy_only, ["Python's random: two workers"], "random.seed(s)"),
    (seed_from_os, ["the same generator seed"], "not from time or os.urandom"),
])
def test_seed_worker_wrong_answers(answer, failing, hint):
    result = check("02.seed_worker", answer)
    assert not result.passed
    for name in failing:
        assert not _case(result, name).passed, str(result)
    assert hint in _case(result, failing[0]).hint, str(result)


@pytest.mark.parametrize("answer, failing, hint", [
    (best_largest, ["workers make samples slower", "draws a warm-up batch"], "more workers is not always faster"),
    (best_without_warmup, ["draws a warm-up batch"], "warm-up"),
    (best_whole_epochs, ["draws only what it measures"], "over whole epochs"),
])
def test_best_num_workers_wrong_answers(answer, failing, hint):
    result = check("02.best_num_workers", answer)
    assert not result.passed
    for name in failing:
        case = _case(result, name)
        assert not case.passed, str(result)
    assert hint in _case(result, failing[0]).hint, str(result)
