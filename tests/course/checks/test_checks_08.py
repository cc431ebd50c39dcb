"""Lesson 08's checkers against the solutions, a stub, and evidence of the bugs they exist for.

The right answers are read from solutions/08_sharding.ipynb. The wrong answers
that run in ranks are the named mutants of tests/mutants/test_mutants_08.py; here
the judges also get hand-made evidence (plain data, as the probes return it), so
each verdict and its hint is tested without starting ranks.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mgpu_lab.course.checks import check, exercises
from mgpu_lab.course.checks._core import CaseFailed, Exercise, Tester
from mgpu_lab.course.checks.l08 import judges

pytestmark = pytest.mark.timeout(400)
NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "08_sharding.ipynb"
# The stub is made by exec and bound to no module attribute, so cloudpickle sends it by value:
# a stub it can find in a module (checking.stub, or a global here) is sent by reference, and
# every rank then imports that test module, nbformat and all (seconds of CPU per rank).
_STUBS: dict = {}
exec("def stub(*args, **kwargs):\n    raise NotImplementedError('write this function')\n", _STUBS)
POINTS = {"08.zero_memory": 9, "08.sharded_sgd_step": 7, "08.shard_model": 5, "08.dcp_checkpoint": 5}
ANSWERS = {"08.zero_memory": ("zero_memory",), "08.sharded_sgd_step": ("sharded_sgd_step",),
           "08.shard_model": ("shard_model",), "08.dcp_checkpoint": ("save_checkpoint", "load_checkpoint")}


def test_lesson_08_registers_four_exercises_with_one_point_per_case():
    assert {e.id: e.points for e in exercises("08")} == POINTS


@pytest.mark.parametrize("exercise_id", sorted(POINTS))
def test_stub_is_not_attempted(exercise_id):
    result = check(exercise_id, *([_STUBS["stub"]] * len(ANSWERS[exercise_id])))
    assert result.status == "not attempted" and result.points == 0, str(result)


# -- the judges, on hand-made evidence ---------------------------------------------------------
def _verdict(judge, *args) -> str:
    """The failure a judge gives (hint, expected, got as one lower-case text), or '' when it passes."""
    t = Tester(Exercise("08.x", 1, "", None))
    try:
        judge(t, *args)
    except CaseFailed as failed:
        return f"{failed.hint} | {failed.expected} | {failed.got}".lower()
    return ""


SIZES = {"block": 64, "root": 80, "total": 272, "blocks": 3}


@pytest.mark.parametrize("calls, words", [
    ([("all_gather", 80), ("all_gather", 64), ("all_gather", 64), ("all_gather", 64)], ""),
    ([("all_gather", 272)], "the whole model"),
    ([("all_gather", 64), ("all_gather", 64), ("all_gather", 64)], "1 of 80 (the root)"),
    ([], "not sharded"),
])
def test_block_by_block_all_gathers(calls, words):
    said = _verdict(judges.judge_gathers, calls, "all_gather", SIZES)
    assert (words in said) if words else said == "", said


def _sgd_evidence(results_of_rank):
    """Three ranks' evidence for the 12-element case, each rank's result given by a function of (param, grads)."""
    param = torch.linspace(-1, 1, 12)
    grads = [torch.full((12,), float(r + 1)) for r in range(3)]
    return [[{"param": param, "grad": grads[r], "status": "ok", "result": results_of_rank(param, grads, r),
              "collectives": []}] for r in range(3)]


@pytest.mark.parametrize("answer, words", [
    (lambda p, g, r: p - judges.SGD_LR * sum(g) / 3, ""),
    (lambda p, g, r: p - judges.SGD_LR * sum(g), "sum of the gradients"),
    (lambda p, g, r: p - judges.SGD_LR * g[r], "own gradient"),
    (lambda p, g, r: torch.cat([p, torch.zeros(2)]), "cut the padding"),
])
def test_sgd_result_judge_names_the_bug(answer, words):
    said = _verdict(judges.judge_result, _sgd_evidence(answer), 0)
    assert (words in said) if words else said == "", said


def _dcp_evidence(layout, loaded=None, load_error=None):
    ev = {"files": sorted(layout["files"]) if layout else ["ckpt.pt"], "layout": layout,
          "saved": {"model.w": torch.ones(4)}, "loaded": loaded}
    if load_error:
        ev["load_error"] = load_error
    return [ev]


def _layout(chunks):
    return {"files": {".metadata": 1, **{f"__{r}_0.distcp": 1 for r in range(4)}},
            "tensors": {"model.w": {"shape": [8], "chunks": chunks,
                                    "files": [f"__{r}_0.distcp" for r in range(chunks)]}}}


def test_dcp_judges_say_what_is_wrong():
    assert "not a dcp checkpoint" in _verdict(judges.judge_dcp, "files", _dcp_evidence(None))
    assert _verdict(judges.judge_dcp, "files", _dcp_evidence(_layout(4))) == ""
    assert "1 slice(s)" in _verdict(judges.judge_dcp, "sharded", _dcp_evidence(_layout(1)))
    assert _verdict(judges.judge_dcp, "sharded", _dcp_evidence(_layout(4))) == ""
    assert "it raised keyerror" in _verdict(judges.judge_dcp, "load4", _dcp_evidence(_layout(4), None, "KeyError: x"))
    assert "differ" in _verdict(judges.judge_dcp, "load4", _dcp_evidence(_layout(4), {"model.w": torch.zeros(4)}))
    assert _verdict(judges.judge_dcp, "load4", _dcp_evidence(_layout(4), {"model.w": torch.ones(4)})) == ""
