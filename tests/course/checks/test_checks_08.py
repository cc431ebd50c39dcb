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
POINTS = {"08.sharded_sgd_step": 7, "08.ShardedAdam": 6, "08.build_sharded": 5, "08.load_full_into_sharded": 2,
          "08.MiniFSDP": 20}
ANSWERS = {"08.sharded_sgd_step": ("sharded_sgd_step",), "08.ShardedAdam": ("ShardedAdam",),
           "08.build_sharded": ("build_sharded",), "08.load_full_into_sharded": ("load_full_into_sharded",),
           "08.MiniFSDP": ("MiniFSDP",)}


def test_lesson_08_registers_five_exercises_with_one_point_per_case():
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
    (lambda p, g, r: p - judges.SGD_LR * sum(g), "sum of the ranks' gradients"),
    (lambda p, g, r: p - judges.SGD_LR * g[r], "own gradient"),
    (lambda p, g, r: torch.cat([p, torch.zeros(2)]), "cut the padding"),
])
def test_sgd_result_judge_names_the_bug(answer, words):
    said = _verdict(judges.judge_result, _sgd_evidence(answer), 0)
    assert (words in said) if words else said == "", said


# -- a trivially wrong answer (it does nothing) passes no case that names a behaviour it lacks -------------
_NOTHING: dict = {}
exec("import torch\n"
     "class ShardedAdam(torch.optim.Optimizer):\n"
     "    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):\n"
     "        super().__init__(params, dict(lr=lr))\n"
     "    def step(self, closure=None):\n"
     "        pass\n"
     "def build_sharded(model_fn, mesh):\n"
     "    return None\n"
     "def load_full_into_sharded(model, path):\n"
     "    return None\n"
     "def sharded_sgd_step(param, grad, lr):\n"
     "    return param\n"
     "class MiniFSDP(torch.nn.Module):\n"  # the module as it came, trained alone on each rank, nothing gathered
     "    def __init__(self, module, compute_dtype=None):\n"
     "        super().__init__()\n"
     "        self.inner = module\n"
     "    def forward(self, *args):\n"
     "        return self.inner(*args)\n"
     "    def finish_gradient_synchronization(self):\n"
     "        pass\n"
     "    def gather_full_params(self):\n"
     "        return {}\n", _NOTHING)


@pytest.mark.parametrize("exercise_id, name", [(e, n[0]) for e, n in ANSWERS.items()])
def test_an_answer_that_does_nothing_passes_no_case_of_the_behaviour_it_lacks(exercise_id, name):
    result = check(exercise_id, _NOTHING[name])
    assert result.status == "failed" and not [c.name for c in result.cases if c.passed], str(result)


# -- trivially wrong answers (a plain step, torch's Adam, a copy of the lesson's demos) pass only the cases
# -- whose behaviour they have ---------------------------------------------------------------------------
_TRIVIAL: dict = {}
exec("import torch\n"
     "import torch.distributed as dist\n"
     "from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict\n"
     "from torch.distributed.fsdp import fully_shard\n"
     "def sharded_sgd_step(param, grad, lr):\n"  # a local SGD step: no rank sees another's gradient
     "    return param - lr * grad\n"
     "class ShardedAdam(torch.optim.Adam):\n"  # plain Adam on every rank: nothing sharded, nothing shared
     "    pass\n"
     "def build_sharded(model_fn, mesh):\n"  # section 4's demo: the whole model built, then sharded
     "    model = model_fn()\n"
     "    for block in model.blocks:\n"
     "        fully_shard(block, mesh=mesh)\n"
     "    return fully_shard(model, mesh=mesh)\n"
     "def load_full_into_sharded(model, path):\n"  # every rank reads the whole file
     "    state = torch.load(path, weights_only=True)\n"
     "    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))\n"
     "class MiniFSDP(torch.nn.Module):\n"  # DDP by hand: full weights everywhere, gradients all-reduced
     "    def __init__(self, module, compute_dtype=None):\n"
     "        super().__init__()\n"
     "        self.inner = module\n"
     "    def forward(self, *args):\n"
     "        return self.inner(*args)\n"
     "    def finish_gradient_synchronization(self):\n"
     "        for p in self.inner.parameters():\n"
     "            dist.all_reduce(p.grad)\n"
     "            p.grad /= dist.get_world_size()\n"
     "    def gather_full_params(self):\n"
     "        return {k: v.detach().clone() for k, v in self.inner.named_parameters()}\n", _TRIVIAL)
PASSES = {  # the cases each trivially wrong answer has the behaviour of
    "08.sharded_sgd_step": [],
    "08.ShardedAdam": ["3 ranks, DDP, 5 steps", "betas=(0.8, 0.95)", "two ShardedAdams alive at once",
                       "the replicas stay equal"],
    # the whole model built, then sharded: section 4's demo; its sharding, gathers and training are not evidence
    # of the exercise (a model no rank held whole), so only the weights' case passes
    "08.build_sharded": ["the weights, gathered"],
    "08.load_full_into_sharded": ["2 ranks: after loading"],
    # DDP by hand trains like one process and returns the full fp32 weights by name; it shards nothing
    "08.MiniFSDP": ["2 ranks, 2 steps of SGD", "2 ranks, Adam and AdamW", "2 ranks, gather_full_params()",
                    "3 ranks, sizes 3", "3 ranks, gather_full_params()"],
}


@pytest.mark.parametrize("exercise_id", sorted(PASSES))
def test_a_trivially_wrong_answer_passes_only_the_cases_whose_behaviour_it_has(exercise_id):
    result = check(exercise_id, _TRIVIAL[ANSWERS[exercise_id][0]])
    passed = [c.name for c in result.cases if c.passed]
    assert len(passed) == len(PASSES[exercise_id]) and all(
        any(name.startswith(start) for name in passed) for start in PASSES[exercise_id]), str(result)


def _adam_evidence(weights_of_rank, owned, step_ops=(("broadcast", 10),), state_bytes=80):
    sizes = [10, 10]
    adam = [torch.ones(10), torch.ones(10)]
    adamw = [torch.full((10,), 2.0), torch.full((10,), 2.0)]
    return [{"sizes": sizes, "configs": [{"optimizer": True, "weights": weights_of_rank(r, adam, adamw), "moved": True,
                                          "adam": adam, "adamw": adamw, "step_ops": list(step_ops),
                                          "state": {"bytes": state_bytes, "owned": owned[r]}}] * 2}
            for r in range(2)]


def test_sharded_adam_judges_name_adamw_unshared_parameters_and_plain_adam():
    right = _adam_evidence(lambda r, a, w: a, [[0], [1]])
    assert _verdict(judges.judge_adam, right, 0) == ""
    assert "adamw" in _verdict(judges.judge_adam, _adam_evidence(lambda r, a, w: w, [[0], [1]]), 0)
    unshared = _adam_evidence(lambda r, a, w: [a[0], torch.zeros(10)] if r == 0 else [torch.zeros(10), a[1]],
                              [[0], [1]])
    assert "shares each updated parameter" in _verdict(judges.judge_replicas, unshared)
    assert "plain adam" in _verdict(judges.judge_adam_state, _adam_evidence(lambda r, a, w: a, [[0, 1], [0, 1]],
                                                                             state_bytes=200))
    assert "all-reduces" in _verdict(judges.judge_adam_traffic, _adam_evidence(lambda r, a, w: a, [[0], [1]],
                                                                                [("all_reduce", 20)]))


def test_build_and_load_judges_name_the_whole_model_and_other_ranks_reading():
    sizes = {"block_bytes": 100, "whole_bytes": 1000}
    params = {"params": {"w": {"dtensor": True}}}
    held = [{"sizes": sizes, "end": 500, "peak": 1200, "calls": ["cpu"], **params}] * 2
    assert "model_fn() ran 1 time(s) on the cpu" in _verdict(judges.judge_live, held)
    fine = [{"sizes": sizes, "end": 500, "peak": 650, "calls": ["meta"], **params}] * 2
    assert _verdict(judges.judge_live, fine) == ""
    loaded = {"params": {"w": {}}, "local_ok": ["w"]}
    assert "other ranks read the file" in _verdict(judges.judge_opened, [{"opened": 1, **loaded}] * 2)
    assert "whole state" in _verdict(judges.judge_not_full, [{}, {"peak": 600, "whole_bytes": 1000,
                                                                   "largest_bytes": 100, **loaded}])


def _mini_evidence(collectives, held=(1000,), peak=(1000,)):
    sizes = {"total": 4000, "count": 4, "whole_bytes": 16000, "layer": 1500, "names": ["w"]}
    scenario = {"collectives": collectives, "shard_numel": 2000, "dtypes": {"w": "torch.float32"}, "diff": {"w": 0.0},
                "start": {"w": 1.0}, "fsdp": 1e-6}
    return [{"sizes": sizes, "scenarios": {"AdamW": scenario},
             "memory": {"held": list(held), "peak": list(peak), "acts": 100, "shard_bytes": 8000}}] * 2


def test_minifsdp_judges_name_the_all_reduce_the_dtype_the_whole_model_and_one_big_gather():
    right = [("all_gather", 1000, "torch.float32")] * 8 + [("reduce_scatter", 1000, "torch.float32")] * 4
    assert _verdict(judges.judge_mini_reduce, _mini_evidence(right), "AdamW") == ""
    assert _verdict(judges.judge_mini_gathers, _mini_evidence(right), "AdamW") == ""
    assert "all-reduces" in _verdict(judges.judge_mini_reduce, _mini_evidence(
        right + [("all_reduce", 4000, "torch.float32")]), "AdamW")
    assert "another dtype" in _verdict(judges.judge_mini_half, _mini_evidence(right), "AdamW", "bfloat16")
    assert "more than a layer" in _verdict(judges.judge_mini_gathers, _mini_evidence(
        [("all_gather", 4000, "torch.float32")] * 2), "AdamW")
    assert "(the whole model)" in _verdict(judges.judge_mini_held, _mini_evidence(right, held=(9000, 17000)))
    assert _verdict(judges.judge_mini_held, _mini_evidence(right, held=(8000, 8100))) == ""
    assert "still alive" in _verdict(judges.judge_mini_peak, _mini_evidence(right, peak=(40000,)), "AdamW")
    assert "not sharded" in _verdict(judges.judge_mini_peak, _mini_evidence([]), "AdamW")
