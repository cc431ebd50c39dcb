"""Checkers of lesson 01 against the solution, a stub, a hang and a crash.

The right answers are the ones in solutions/01_devices.ipynb, read from the
notebook itself. Every answer runs through ``check()`` for real: fresh
processes, simulated GPU counts, recorded tensor moves, real child processes.
The wrong answers each check exists for are the named mutants of
tests/mutants/test_mutants_01.py.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import torch

from checking import solutions_from
from mgpu_lab.course.checks import _core, check, exercises

pytestmark = pytest.mark.timeout(300)
# The answers below travel to the check's processes by value, as notebook
# functions do: by reference, every call would re-import this test module there.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "01_devices.ipynb"
IDS = ["01.pick_device", "01.train_step", "01.visible_devices_env"]
POINTS = {"01.pick_device": 2, "01.train_step": 2, "01.visible_devices_env": 6}


def stub(*args, **kwargs):
    """A student copy's exercise; defined here, so it travels by value: checking.stub would travel by
    reference and make every process import tests/checking.py and nbformat (seconds on a loaded machine)."""
    raise NotImplementedError("write this function")


SOLUTION = solutions_from(NOTEBOOK, ("pick_device", "train_step", "visible_devices_env"), {"torch": torch, "os": os})

# -- registry ---------------------------------------------------------------------------
def test_lesson_01_has_exactly_the_issue_s_exercises():
    assert [(e.id, e.points) for e in exercises("01")] == list(POINTS.items())


@pytest.mark.parametrize("exercise_id", IDS)
def test_a_stub_is_not_attempted(exercise_id):
    result = check(exercise_id, stub)
    assert (result.status, result.points) == ("not attempted", 0)
    assert result.summary() == f"{exercise_id}: 0/{POINTS[exercise_id]} points · not attempted"


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


# -- trivially wrong answers and the library's own versions ---------------------------------------
def returns_none(*args):
    return None


def does_nothing_but_returns_a_float(model, batch, optimizer, loss_fn, device):
    return 0.0


def library_subset_vars(ids):
    from mgpu_lab.devices.visible import subset_vars

    return subset_vars(ids)


def library_traced_step(model, batch, optimizer, loss_fn, device):
    from mgpu_lab.parallel.dp_tools import traced_step

    inputs, labels = batch
    return traced_step(model, inputs.to(device), labels.to(device), loss_fn, optimizer)


@pytest.mark.parametrize("exercise_id", IDS)
def test_an_answer_that_returns_nothing_passes_no_case(exercise_id):
    result = check(exercise_id, returns_none)
    # pick_device: None is neither a device nor an error; train_step and visible_devices_env: nothing done.
    passed = [c.name for c in result.cases if c.passed]
    assert passed == [], passed  # visible_devices_env: os.environ unchanged counts only beside returned variables


# Trivially wrong answers a learner would try: a copy of the notebook's demo cell, the CPU always, the loss
# without a step, the ids joined as they are. Each passes only the cases that name what it really does.
def pick_like_the_demo_cell(index=None):
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def pick_the_cpu(index=None):
    return torch.device("cpu")


def loss_without_a_step(model, batch, optimizer, loss_fn, device):
    inputs, labels = batch
    return loss_fn(model(inputs.to(device)), labels.to(device)).item()


def ids_joined(ids):
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}


@pytest.mark.parametrize("exercise_id, answer, allowed", [
    ("01.pick_device", pick_like_the_demo_cell, {"no GPU visible", "returns a torch.device"}),
    ("01.pick_device", pick_the_cpu, {"no GPU visible", "returns a torch.device"}),
    ("01.train_step", loss_without_a_step, {"returns this batch's loss", "the inputs used", "the labels used"}),
    ("01.visible_devices_env", ids_joined, {"leaves this process's own os.environ"}),
])
def test_a_trivially_wrong_answer_passes_only_what_it_does(exercise_id, answer, allowed):
    result = check(exercise_id, answer)
    passed = {c.name for c in result.cases if c.passed}
    assert all(any(name.startswith(a) for a in allowed) for name in passed), str(result)
    assert result.status == "failed", str(result)


def test_a_step_that_does_nothing_passes_only_the_type_of_its_result():
    result = check("01.train_step", does_nothing_but_returns_a_float)
    assert result.points == 0, str(result)


@pytest.mark.parametrize("exercise_id, answer", [("01.visible_devices_env", library_subset_vars),
                                                 ("01.train_step", library_traced_step)])
def test_an_answer_that_calls_the_library_s_version_fails_naming_it(exercise_id, answer):
    result = check(exercise_id, answer)
    assert result.points == 0 and "your code calls mgpu_lab." in result.cases[0].got, str(result)


# -- a case passes only with its evidence: an answer that does the visible part and skips the evidenced one ------
def pick_accepting_physical_ids(index=None):
    """Right with and without CUDA_VISIBLE_DEVICES for the indices this process has, but takes a physical id the
    variable lists (3 of 5,3) for one of its own indices: under 5,3 it returns cuda:3, which does not exist."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index is None:
        return torch.device("cuda", 0) if count else torch.device("cpu")
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [int(v) for v in listed.split(",")] if listed else []
    if not (0 <= index < count or index in physical):
        raise ValueError(f"index={index} but {count} GPU(s) are visible")
    return torch.device("cuda", index)


def test_the_cuda_visible_devices_case_needs_this_process_s_numbering():
    result = check("01.pick_device", pick_accepting_physical_ids)
    failed = [c for c in result.cases if not c.passed]
    assert [c.name.split(":")[0] for c in failed] == ["started with CUDA_VISIBLE_DEVICES=5,3 (two GPUs visible)"], \
        str(result)
    assert "3 is a physical id" in failed[0].hint and "pick_device(3)" in failed[0].got, str(result)


def keeps_this_process_s_order(ids):
    """A reading the notebook's criteria rule out: from a process that sees every GPU, the child keeps this
    process's order (CUDA's default here) instead of nvidia-smi's."""
    mine = os.environ.get("CUDA_VISIBLE_DEVICES")
    if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        raise ValueError(f"bad ids {ids}")
    entries = None if mine is None else mine.split(",")
    if entries is not None and any(i >= len(entries) for i in ids):
        raise ValueError(f"bad ids {ids} for {len(entries)} GPUs")
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) if entries is None else entries[i] for i in ids)}


def test_the_whole_machine_case_asks_for_nvidia_smi_s_order_as_the_notebook_says():
    result = check("01.visible_devices_env", keeps_this_process_s_order)
    first = result.cases[0]
    assert not first.passed and "nvidia-smi" in first.hint and "whatever order this process" in first.hint, str(result)
    text = "".join(c.source for c in __import__("nbformat").read(NOTEBOOK, as_version=4).cells
                   if "## Exercise 3: `visible_devices_env`" in c.source)
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in text and "even when this" in text  # the criterion the check holds
