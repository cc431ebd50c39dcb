"""Checkers of lesson 03 against right answers, a stub, and the wrong answers they exist for."""
from __future__ import annotations

import copy

import pytest
import torch

from mgpu_lab.course.checks import check, exercises
from mgpu_lab.data_parallel import parallel_apply, replicate

pytestmark = pytest.mark.timeout(180)


# -- right answers (as in solutions/03_data_parallel.ipynb) -------------------------------
def split_batch(batch, n):
    if n < 1:
        raise ValueError(f"n={n}: split_batch needs at least one device")
    return list(torch.chunk(batch, n, dim=0))


def data_parallel_forward(model, batch, devices):
    chunks = [c.to(d) for c, d in zip(split_batch(batch, len(devices)), devices)]
    replicas = replicate(model, devices[: len(chunks)])
    outputs = parallel_apply(replicas, chunks, devices[: len(chunks)])
    return torch.cat([out.to(devices[0]) for out in outputs])


def data_parallel_forward_loop(model, batch, devices):  # right too: replicas run one after the other
    chunks = split_batch(batch, len(devices))
    replicas = replicate(model, devices[: len(chunks)])
    return torch.cat([r(c.to(d)).to(devices[0]) for r, c, d in zip(replicas, chunks, devices)])


def stub(*args, **kwargs):
    raise NotImplementedError("write this function")


# -- wrong answers ------------------------------------------------------------------------
def split_tensor_split(batch, n):
    if n < 1:
        raise ValueError(f"n={n}")
    return list(torch.tensor_split(batch, n))


def split_last_dim(batch, n):
    if n < 1:
        raise ValueError(f"n={n}")
    return list(torch.chunk(batch, n, dim=-1))


def split_without_check(batch, n):
    return list(torch.chunk(batch, n))


def split_reversed(batch, n):
    if n < 1:
        raise ValueError(f"n={n}")
    return list(torch.chunk(batch, n))[::-1]


def dp_deepcopy(model, batch, devices):
    chunks = split_batch(batch, len(devices))
    outputs = [copy.deepcopy(model).to(d)(c.to(d)) for c, d in zip(chunks, devices)]
    return torch.cat([out.to(devices[0]) for out in outputs])


def dp_whole_batch(model, batch, devices):
    return model(batch)


def dp_original_model(model, batch, devices):
    return torch.cat([model(c).to(devices[0]) for c in split_batch(batch, len(devices))])


def dp_cat_then_move(model, batch, devices):
    chunks = split_batch(batch, len(devices))
    replicas = replicate(model, devices[: len(chunks)])
    return torch.cat([r(c) for r, c in zip(replicas, chunks)]).to(devices[0])


def dp_one_replica_per_device(model, batch, devices):
    chunks = split_batch(batch, len(devices))
    replicas = replicate(model, devices)
    return torch.cat([replicas[i](chunks[i]).to(devices[0]) for i in range(len(devices))])


def _case(result, text):
    return next(c for c in result.cases if text in c.name)


def test_registered():
    assert [e.id for e in exercises("03")] == ["03.data_parallel_forward", "03.split_batch"]


@pytest.mark.parametrize("exercise_id, answer", [
    ("03.split_batch", split_batch), ("03.data_parallel_forward", data_parallel_forward),
    ("03.data_parallel_forward", data_parallel_forward_loop)])
def test_right_answers_get_full_marks(exercise_id, answer):
    result = check(exercise_id, answer)
    assert result.passed and result.points == result.max_points, str(result)


@pytest.mark.parametrize("exercise_id", ["03.split_batch", "03.data_parallel_forward"])
def test_stub_is_not_attempted(exercise_id):
    result = check(exercise_id, stub)
    assert result.status == "not attempted" and result.points == 0, str(result)


@pytest.mark.parametrize("exercise_id, answer, failing, hint", [
    ("03.split_batch", split_tensor_split, ["3 samples on 5 devices", "10 samples on 3 devices"], "tensor_split"),
    ("03.split_batch", split_last_dim, ["splits the samples (dim 0)"], "dim 0"),
    ("03.split_batch", split_without_check, ["n=0 and n=-2 raise ValueError"], "ValueError"),
    ("03.split_batch", split_reversed, ["10 samples on 3 devices"], "batch order"),
    ("03.data_parallel_forward", dp_deepcopy, ["gradients reach the original"], "deepcopy"),
    ("03.data_parallel_forward", dp_whole_batch, ["chunks of 4, 4 and 2"], "never the whole batch"),
    ("03.data_parallel_forward", dp_original_model, ["its own replica"], "cuda:1 fails"),
    ("03.data_parallel_forward", dp_cat_then_move, ["moved to devices[0] before concatenating"],
     "torch.cat refuses"),
    ("03.data_parallel_forward", dp_one_replica_per_device, ["fewer chunks than devices"], ""),
])
def test_wrong_answers_fail_their_case(exercise_id, answer, failing, hint):
    result = check(exercise_id, answer)
    assert not result.passed, str(result)
    for name in failing:
        assert not _case(result, name).passed, str(result)
    assert hint in _case(result, failing[0]).hint, str(result)


def test_wrong_answers_fail_only_their_cases():
    result = check("03.data_parallel_forward", dp_deepcopy)
    assert [c.passed for c in result.cases] == [True, True, True, True, False, True], str(result)
