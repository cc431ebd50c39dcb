"""Checkers of lesson 03 against a stub, answers that raise, trivially wrong answers and the references.

The right answers are the ones in solutions/03_data_parallel.ipynb, read from
the notebook itself. The wrong answers each check exists for are the named
mutants of tests/mutants/test_mutants_03.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
from torch import nn

from checking import solutions_from
from mgpu_lab.course.checks import check, exercises
from mgpu_lab.parallel.dp_tools import parallel_apply

pytestmark = pytest.mark.timeout(180)
cloudpickle.register_pickle_by_value(sys.modules[__name__])
NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "03_data_parallel.ipynb"
POINTS = {"03.data_parallel_forward": 7, "03.replicate": 6}
SOLUTION = solutions_from(NOTEBOOK, ("replicate", "data_parallel_forward"),
                          {"torch": torch, "nn": nn, "parallel_apply": parallel_apply})


def stub(*args, **kwargs):
    raise NotImplementedError("write this function")


def dp_raises(model, batch, devices):
    raise RuntimeError("Expected all tensors to be on the same device")


def returns_none(*args):
    return None


def the_model_for_every_device(module, devices):
    return [module for _ in devices]


def torch_replicate(module, devices):
    return torch.nn.parallel.replicate(module, devices)


def library_replicas(module, devices):
    from mgpu_lab.parallel.data_parallel import StepByStepDataParallel

    return StepByStepDataParallel(module, devices).replicas()


def dp_with_torch_pieces(model, batch, devices):
    return torch.nn.parallel.data_parallel(model, batch, devices)


def test_registered():
    assert [(e.id, e.points) for e in exercises("03")] == list(POINTS.items())


@pytest.mark.parametrize("exercise_id", list(POINTS))
def test_stub_is_not_attempted(exercise_id):
    result = check(exercise_id, stub)
    assert result.status == "not attempted" and result.points == 0, str(result)


def test_an_error_in_the_answer_is_named_in_every_visible_case():
    result = check("03.data_parallel_forward", dp_raises)
    assert result.points == 0
    visible = [c for c in result.cases if not c.hidden]
    assert all("RuntimeError: Expected all tensors" in c.got for c in visible), str(result)


@pytest.mark.parametrize("exercise_id", list(POINTS))
def test_an_answer_that_returns_nothing_passes_no_case(exercise_id):
    result = check(exercise_id, returns_none)
    assert result.points == 0, str(result)


def test_the_model_itself_as_every_replica_passes_only_what_it_does_not_lack():
    result = check("03.replicate", the_model_for_every_device)
    passed = {c.name.split(":")[0] for c in result.cases if c.passed}
    # It leaves the model unchanged; nothing else (the model is no replica of itself, and the sum of gradients
    # into one module used three times is no sum across replicas).
    assert result.points == 1 and result.cases[-2].passed, str(result)
    assert not any(c.passed for c in result.cases if "devices[i]" in c.name or "of its own" in c.name), passed


def replicate_with_torch_s_module_copy(module, devices):
    """Otherwise right: torch's per-module copy (what its replicate calls), parameters linked by hand."""
    out = []
    for device in devices:
        copies = {m: m._replicate_for_data_parallel() for m in module.modules()}
        for original, replica in copies.items():
            replica._modules = {k: None if c is None else copies[c] for k, c in original._modules.items()}
            replica._buffers = {k: None if b is None else b.to(device) for k, b in original._buffers.items()}
            for k, p in original._parameters.items():
                object.__setattr__(replica, k, None if p is None else p.to(device))
        out.append(copies[module])
    return out


@pytest.mark.parametrize("answer", [torch_replicate, library_replicas, replicate_with_torch_s_module_copy])
def test_calling_a_reference_replicate_fails_naming_it(answer):
    result = check("03.replicate", answer)
    assert result.points == 0 and "your code calls" in result.cases[0].got, str(result)


def the_model_on_the_whole_batch(model, batch, devices):
    return model(batch.to(devices[0]))


def test_the_model_on_the_whole_batch_passes_only_what_it_does():
    result = check("03.data_parallel_forward", the_model_on_the_whole_batch)
    passed = {c.name for c in result.cases if c.passed}
    # Its output and gradients are model(batch)'s: those two cases hold; no split, no replica, no gather.
    assert passed == {"3 GPUs (simulated: cuda:0, cuda:1, cuda:2), 10 samples: the output equals model(batch)",
                      "gradients reach the original model's parameters, equal to those of model(batch)"}, str(result)


def test_calling_torch_s_data_parallel_fails_naming_it():
    result = check("03.data_parallel_forward", dp_with_torch_pieces)
    assert result.points == 0 and "your code calls torch.nn.parallel" in result.cases[0].got, str(result)


def test_the_solution_gets_full_marks():
    for exercise_id, name in (("03.replicate", "replicate"), ("03.data_parallel_forward", "data_parallel_forward")):
        result = check(exercise_id, SOLUTION[name])
        assert result.points == result.max_points, str(result)


LEAF_REPLICATE = """
def replicate(module, devices):
    import copy
    return [copy.deepcopy(module).to(device) for device in devices]   # new leaves: no gradient reaches module
"""


def test_a_replicate_bug_costs_points_in_03_replicate_only():
    """Each exercise is judged on its own: the solution's forward, beside a replicate whose replicas are cut off
    from the model by autograd, gets full marks; the bug costs 03.replicate's points, with its own hint."""
    namespace = {"torch": torch, "nn": nn, "parallel_apply": parallel_apply}
    forward = solutions_from(NOTEBOOK, ("data_parallel_forward",), namespace)["data_parallel_forward"]
    exec(LEAF_REPLICATE, namespace)  # the forward's global `replicate` is now the broken one, as in a notebook
    broken = check("03.replicate", namespace["replicate"])
    assert not broken.passed and "leaves of their own" in str(broken), str(broken)
    result = check("03.data_parallel_forward", forward)
    assert result.points == result.max_points, str(result)
