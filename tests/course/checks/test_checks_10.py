"""Lesson 10's checkers: stubs are "not attempted", and the judging helpers.

The wrong answers every case exists for are tests/mutants/test_mutants_10.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import cloudpickle
import pytest
from checking import case_starting, stub

from mgpu_lab.course.checks import check, exercises
from mgpu_lab.course.checks.l10 import judges
from mgpu_lab.course.checks.l10.ranks import NEW, OLD, classify

pytestmark = pytest.mark.timeout(600)
# The answers below travel to the check's ranks by value: by reference every rank would import this
# file, and pytest with it (seconds per rank: the 3 ranks of each of 10.guarded's 6 scenarios).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "10_failures.ipynb"
PRELUDE = """
import os, tempfile
from collections import Counter
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from mgpu_lab.failures import snapshot
from mgpu_lab import dist as mdist
"""


def test_lesson_10_registers_its_three_exercises_with_one_point_per_case():
    got = {e.id: e.points for e in exercises("10")}
    assert got == {"10.atomic_save": 7, "10.guarded": 6, "10.resumable_train": 7}


@pytest.mark.parametrize("exercise_id,answer", [
    ("10.atomic_save", stub), ("10.guarded", stub), ("10.resumable_train", stub)])
def test_a_stub_is_not_attempted(exercise_id, answer):
    assert check(exercise_id, answer).status == "not attempted"


# -- the judging helpers, on made-up evidence (no processes) ---------------------------------
def test_classify_tells_old_new_missing_and_torn_files(tmp_path):
    import torch

    path = tmp_path / "s.pt"
    assert classify(str(path)) == "missing"
    torch.save(OLD, path)
    assert classify(str(path)) == "old"
    torch.save(NEW, path)
    data = path.read_bytes()
    assert classify(str(path)) == "new"
    path.write_bytes(data[: len(data) // 2])
    assert classify(str(path)) == "torn"


def test_resumed_from_follows_the_snapshots_of_a_kill_schedule():
    every = judges.CFG["every"]
    assert every == 4
    assert judges.resumed_from([None]) == 0
    assert judges.resumed_from([["step", 0, 1, 10], None]) == 8        # steps 1-9 done, snapshot of 8
    assert judges.resumed_from([["save", 0, 0, 2], None]) == 4         # the 2nd snapshot (8) torn: the 1st
    assert judges.resumed_from([["step", 0, 0, 3], ["step", 1, 1, 5], None]) == 4


def _trace(n, w=None, x=None, rng=None):
    return [{"f": i + 1, "w": [float(i), 1.0] if w is None else w(i), "x": float(i) if x is None else x(i),
             "rng": f"r{i}" if rng is None else rng(i)} for i in range(n)]


@pytest.mark.parametrize("steps,words", [
    (_trace(18)[8:], None),
    (_trace(18)[6:], "weights after step 6"),
    ([dict(r, x=-1.0) for r in _trace(18)[8:]], "other samples"),
    ([dict(r, rng="other") for r in _trace(18)[8:]], "iterator was made"),
    ([r if r["f"] == 9 else dict(r, w=[-1.0, 0.0]) for r in _trace(18)[8:]], "optimizer"),
    (_trace(18)[8:12], "stopped after step 12"),
])
def test_first_difference_names_the_first_thing_that_differs_after_a_resume(steps, words):
    why = judges.first_difference(steps, _trace(18), 8, 1)
    assert (why is None) if words is None else (words in why), why


def test_first_difference_of_a_fresh_run_points_at_the_epoch_s_reshuffle_after_the_first_epoch():
    ref = _trace(18)
    steps = [dict(r, x=-1.0) if r["f"] > 6 else r for r in ref]
    assert "reshuffles only when told the epoch" in judges.first_difference(steps, ref, 0, 0)


# -- trivially wrong answers pass no case that names a behaviour they lack -----------------------------------
def does_nothing(*args, **kwargs):
    return None


@pytest.mark.parametrize("exercise_id", ["10.atomic_save", "10.guarded", "10.resumable_train"])
def test_an_answer_that_does_nothing_passes_no_case(exercise_id):
    result = check(exercise_id, does_nothing)
    assert result.points == 0, str(result)


def plain_save(obj, path):
    import torch

    torch.save(obj, path)


def test_plain_torch_save_passes_only_the_save_itself_and_says_torn_files_in_the_check_s_words():
    result = check("10.atomic_save", plain_save)
    assert [c.name for c in result.cases if c.passed] == [
        "saves the object (torch.load(path) gives it back) and a second save replaces it"], result
    text = str(result)
    assert "the file at path was half written when the writer was killed at byte 1 (it holds 1 byte)" in text, text
    assert "no file operation" in case_starting(result, "SIGKILL at each file operation").got
    assert "written in place" in case_starting(result, "the temporary file is made").got
    for torch_words in ("UnpicklingError", "weights_only", "1 bytes", "PytorchStreamReader"):
        assert torch_words not in text, text


def no_guard(collective):
    """The collective itself: no agreement, no bound."""
    return collective


def test_a_guard_that_only_calls_the_collective_passes_only_the_agreeing_calls():
    result = check("10.guarded", no_guard)
    assert [c.passed for c in result.cases] == [True, False, False, False, False, False], result


def train_without_snapshots(model_fn, dataset, epochs, batch_size, lr, snapshot_path, snapshot_every):
    """Lesson 04's DDP training, right, but it never snapshots: every restart begins again from scratch."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    model = model_fn()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    return model.state_dict()


def test_training_without_snapshots_passes_only_the_fresh_start():
    result = check("10.resumable_train", train_without_snapshots)
    assert [c.passed for c in result.cases] == [True] + [False] * 6, result
    assert "steps" in case_starting(result, "rank 1 SIGKILLed as step 10").hint


# -- dist.monitored_barrier as a guard's absent-rank half: allowed, not enough (the lesson's decision) ------------------
def test_a_guard_whose_absent_half_is_monitored_barrier_fails_the_absent_case_saying_it_tells_rank_0_only():
    """What a guard built on ``dist.monitored_barrier`` (gloo) leaves when rank 2 never comes, as run by hand on
    3 ranks: rank 0 raises with the barrier's report, which names no call, and rank 1, which arrived, waits for
    rank 0's answer that never comes."""
    from mgpu_lab.course.checks._core import CaseFailed, Exercise, Tester

    got = [{"raised": ("RuntimeError", "Rank 2 failed to pass monitoredBarrier in 2000 ms"), "ran": ["all_reduce"],
            "seconds": 2.1, "waiting": None},
           {"raised": None, "ran": ["all_reduce"], "seconds": None, "waiting": 6.5},
           {"raised": None, "ran": ["all_reduce"], "seconds": 0.0, "waiting": None}]
    hint = judges.absent_hint(got, "a right guard waits up to a deadline")
    assert "monitored_barrier names the ranks that did not arrive on rank 0 only" in hint
    t = Tester(Exercise("10.x", 1, "", None))
    with pytest.raises(CaseFailed) as failed:
        judges.judge_guard(t, got, 2, (0, 1), "rank 2 never makes a second call", hint)
    assert "monitored_barrier" in failed.value.hint and "rank 0" in failed.value.got, failed.value.got
    plain = [dict(g, raised=("RuntimeError", "call 1: rank 2 did not make it")) for g in got]
    assert "monitored_barrier" not in judges.absent_hint(plain, "a right guard waits up to a deadline")
