"""Checkers of lesson 01 against the solution, a stub, and the wrong answers they exist for.

The right answers are the ones in solutions/01_devices.ipynb, read from the
notebook itself. Every answer runs through ``check()`` for real: fresh
processes, simulated GPU counts, recorded tensor moves, real child processes.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import torch

from checking import case_starting, solutions_from, stub
from mgpu_lab.course.checks import _core, check, exercises

pytestmark = pytest.mark.timeout(300)
# The answers below travel to the check's processes by value, as notebook
# functions do: by reference, every call would re-import this test module there.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "01_devices.ipynb"
IDS = ["01.pick_device", "01.train_step", "01.visible_devices_env"]


SOLUTION = solutions_from(NOTEBOOK, ("pick_device", "train_step", "visible_devices_env"), {"torch": torch})
_case = case_starting



def _fails_only(result, start: str, hint_words: str):
    """The case named ``start...`` fails with a hint containing ``hint_words``; every other visible case passes."""
    case = _case(result, start)
    assert not case.passed, str(result)
    assert hint_words in case.hint, str(result)
    others = [c for c in result.cases if c is not case and not c.hidden]
    assert all(c.passed for c in others), str(result)
    assert result.status == "failed" and result.points < result.max_points


# -- registry ---------------------------------------------------------------------------
def test_lesson_01_has_exactly_the_issue_s_exercises():
    assert [(e.id, e.points) for e in exercises("01")] == [(i, 6) for i in IDS]


@pytest.mark.parametrize("exercise_id, name", list(zip(IDS, SOLUTION)))
def test_the_solution_gets_full_marks(exercise_id, name):
    result = check(exercise_id, SOLUTION[name])
    assert result.summary() == f"{exercise_id}: 6/6 passed", str(result)


@pytest.mark.parametrize("exercise_id", IDS)
def test_a_stub_is_not_attempted(exercise_id):
    result = check(exercise_id, stub)
    assert (result.status, result.points) == ("not attempted", 0)
    assert result.summary() == f"{exercise_id}: not attempted (0/6)"


# -- 01.pick_device -----------------------------------------------------------------------
def pick_ignores_index(index=None):
    if torch.cuda.is_available():
        if index is not None and not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"{torch.cuda.device_count()} GPUs visible")
        return torch.device("cuda", 0)
    if index is not None:
        raise ValueError("0 GPUs visible")
    return torch.device("cpu")


def pick_no_fallback(index=None):
    count = torch.cuda.device_count()
    if index is not None and not 0 <= index < count:
        raise ValueError(f"{count} GPUs visible")
    return torch.device("cuda", index or 0)


def pick_returns_strings(index=None):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index is not None and not 0 <= index < count:
        raise ValueError(f"{count} GPUs visible")
    return f"cuda:{index or 0}" if count else "cpu"


def pick_off_by_one(index=None):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index is None:
        return torch.device("cuda", 0) if count else torch.device("cpu")
    if not 0 <= index <= count:  # <= lets index == count through
        raise ValueError(f"{count} GPUs visible")
    return torch.device("cuda", index) if count else torch.device("cpu")


def pick_forgets_negative(index=None):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index is None:
        return torch.device("cuda", 0) if count else torch.device("cpu")
    if index >= count:
        raise ValueError(f"{count} GPUs visible")
    return torch.device("cuda", index)


def pick_silent_message(index=None):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index is None:
        return torch.device("cuda", 0) if count else torch.device("cpu")
    if not 0 <= index < count:
        raise ValueError(f"bad GPU index {index}")
    return torch.device("cuda", index)


def pick_cpu_for_any_index_without_gpu(index=None):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        return torch.device("cpu")
    index = 0 if index is None else index
    if not 0 <= index < count:
        raise ValueError(f"{count} GPUs visible")
    return torch.device("cuda", index)


def test_pick_device_that_ignores_the_index():
    _fails_only(check("01.pick_device", pick_ignores_index), "2 GPUs visible: pick_device(1)", "use the index")


def test_pick_device_without_the_cpu_fallback():
    result = check("01.pick_device", pick_no_fallback)
    case = _case(result, "no GPU visible: pick_device() is cpu")
    assert not case.passed and "torch.device('cpu')" in case.hint


def test_pick_device_that_returns_strings():
    result = check("01.pick_device", pick_returns_strings)
    case = _case(result, "2 GPUs visible: pick_device(1)")
    assert not case.passed and "return a torch.device, not a str" in case.hint
    assert case.got == "'cuda:1'"


@pytest.mark.parametrize("answer", [pick_off_by_one, pick_forgets_negative, pick_silent_message],
                         ids=["index == count allowed", "negative index allowed", "count not named"])
def test_pick_device_with_a_bad_range_check(answer):
    _fails_only(check("01.pick_device", answer), "2 GPUs visible: pick_device(2) and pick_device(-1)",
                "raise ValueError")


def test_pick_device_that_accepts_an_index_without_gpus():
    result = check("01.pick_device", pick_cpu_for_any_index_without_gpu)
    case = _case(result, "no GPU visible: pick_device(0)")
    assert not case.passed and case.hidden
    assert "no GPU visible: pick_device(0)" in str(result) and "returned" not in str(result)  # hidden: no details
    assert result.points == 5


# -- 01.train_step ---------------------------------------------------------------------------
def step_forgets_labels(model, batch, optimizer, loss_fn, device):
    inputs, labels = batch
    optimizer.zero_grad()
    loss = loss_fn(model(inputs.to(device)), labels)
    loss.backward()
    optimizer.step()
    return loss.item()


def step_forgets_inputs(model, batch, optimizer, loss_fn, device):
    inputs, labels = batch
    optimizer.zero_grad()
    loss = loss_fn(model(inputs), labels.to(device))
    loss.backward()
    optimizer.step()
    return loss.item()


def step_discards_the_moved_labels(model, batch, optimizer, loss_fn, device):
    inputs, labels = batch
    inputs = inputs.to(device)
    labels.to(device)  # not in place: the moved copy is thrown away
    optimizer.zero_grad()
    loss = loss_fn(model(inputs), labels)
    loss.backward()
    optimizer.step()
    return loss.item()


def step_returns_tensor(model, batch, optimizer, loss_fn, device):
    inputs, labels = (t.to(device) for t in batch)
    optimizer.zero_grad()
    loss = loss_fn(model(inputs), labels)
    loss.backward()
    optimizer.step()
    return loss


def step_forgets_zero_grad(model, batch, optimizer, loss_fn, device):
    inputs, labels = (t.to(device) for t in batch)
    loss = loss_fn(model(inputs), labels)
    loss.backward()
    optimizer.step()
    return loss.item()


def step_forgets_step(model, batch, optimizer, loss_fn, device):
    inputs, labels = (t.to(device) for t in batch)
    optimizer.zero_grad()
    loss = loss_fn(model(inputs), labels)
    loss.backward()
    return loss.item()


def test_train_step_that_forgets_the_labels():
    result = check("01.train_step", step_forgets_labels)
    _fails_only(result, "moves the labels", "call .to(device) on the labels")
    assert "moves recorded: [('inputs', 'cpu')]" in _case(result, "moves the labels").got


def test_train_step_that_forgets_the_inputs():
    _fails_only(check("01.train_step", step_forgets_inputs), "moves the inputs", "call .to(device) on the inputs")


def test_train_step_that_moves_the_labels_but_uses_the_originals():
    _fails_only(check("01.train_step", step_discards_the_moved_labels), "moves the labels",
                "returns a new tensor")


def test_train_step_that_returns_a_tensor():
    result = check("01.train_step", step_returns_tensor)
    case = _case(result, "returns the loss as a Python float")
    assert not case.passed and "loss.item()" in case.hint and case.got == "Tensor"
    assert [c.passed for c in result.cases] == [False, True, True, True, True, False]  # hidden case checks types


def test_train_step_that_forgets_zero_grad():
    result = check("01.train_step", step_forgets_zero_grad)
    case = _case(result, "three steps in a row")
    assert not case.passed and "zero_grad" in case.hint
    assert _case(result, "updates the weights exactly").passed  # one step from zero gradients looks right


def test_train_step_that_forgets_the_optimizer_step():
    result = check("01.train_step", step_forgets_step)
    case = _case(result, "updates the weights exactly")
    assert not case.passed and "optimizer.step()" in case.hint


# -- 01.visible_devices_env --------------------------------------------------------------------
def env_sorted(ids):
    if len(set(ids)) != len(ids) or any(not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"bad ids {ids}")
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, sorted(ids)))}


def env_accepts_duplicates(ids):
    if any(not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"bad ids {ids}")
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}


def env_accepts_negatives(ids):
    if len(set(ids)) != len(ids) or any(not isinstance(i, int) for i in ids):
        raise ValueError(f"bad ids {ids}")
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}


def env_int_values(ids):
    if len(set(ids)) != len(ids) or any(not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"bad ids {ids}")
    return {"CUDA_VISIBLE_DEVICES": ids[0] if len(ids) == 1 else ",".join(map(str, ids)), "CUDA_DEVICE_ORDER": 0}


def env_with_spaces(ids):
    if len(set(ids)) != len(ids) or any(not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"bad ids {ids}")
    return {"CUDA_VISIBLE_DEVICES": ", ".join(map(str, ids))}


def test_visible_devices_env_that_sorts_the_ids():
    _fails_only(check("01.visible_devices_env", env_sorted), "visible_devices_env([3, 1]) makes", "keep the order")


def test_visible_devices_env_that_accepts_duplicates():
    _fails_only(check("01.visible_devices_env", env_accepts_duplicates), "visible_devices_env([1, 1]) raises",
                "no id twice")


def test_visible_devices_env_that_accepts_negative_ids():
    _fails_only(check("01.visible_devices_env", env_accepts_negatives), "visible_devices_env([-1]) raises",
                "every id an int >= 0")


def test_visible_devices_env_with_values_that_are_not_strings():
    result = check("01.visible_devices_env", env_int_values)
    case = _case(result, "visible_devices_env([2, 3]) makes")
    assert not case.passed and "dict of str to str" in case.hint


def test_visible_devices_env_with_spaces_is_not_what_the_child_sees():
    result = check("01.visible_devices_env", env_with_spaces)
    case = _case(result, "visible_devices_env([2, 3]) makes")
    assert not case.passed and case.got == "'2, 3'"


# -- hangs and crashes: failed cases in bounded time; this process lives on ---------------------
def pick_hangs(index=None):
    time.sleep(1000)


def step_kills_its_process(model, batch, optimizer, loss_fn, device):
    os._exit(3)


def test_a_hanging_answer_fails_in_bounded_time(monkeypatch):
    check("01.pick_device", SOLUTION["pick_device"])  # the process server is up: time only the hang
    monkeypatch.setattr(_core, "CALL_TIMEOUT", 3.0)
    began = time.perf_counter()
    result = check("01.pick_device", pick_hangs)
    assert time.perf_counter() - began < 60
    assert result.points == 0 and result.status == "failed"
    first = result.cases[0]
    assert "no answer within 3 s" in first.got and "hangs" in first.hint
    assert all(c.got == "skipped" for c in result.cases[1:] if not c.hidden)


def test_an_answer_that_kills_its_process_fails_and_this_process_survives():
    result = check("01.train_step", step_kills_its_process)
    assert result.points == 0 and result.status == "failed"
    assert "died" in result.cases[0].got and "exit code 3" in result.cases[0].got
    assert check("01.train_step", SOLUTION["train_step"]).passed  # and checks still work afterwards
