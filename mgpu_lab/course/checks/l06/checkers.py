"""Checks of lesson 06 (model parallelism): stage_step, pipelined_step, bubble_fraction.

``stage_step`` runs in 2 real ranks (gloo), one stage each, every scenario in one
launch, and is judged against one process training the whole model. Placement
(pipelined_step) is judged on a machine without GPUs by giving the learner's code names
of GPUs: the stages and tensors of :mod:`..sim.devices` keep their data on the CPU
and record where they would be, so "forgot to move the activations" fails here as
it fails on two GPUs ("Expected all tensors to be on the same device"). What runs
in the fresh process is :mod:`.ranks` (one launch per check); this module
judges, in the kernel.
"""
from __future__ import annotations

import torch

from .._core import exercise
from ..sim.scenarios import launch_scenarios
from .judges import (judge_bubble, judge_grads, judge_loss, judge_raises, require_ran, Results,
                     placement_problem, stage_diagnosis, stage_placement_problem, stage_returns_problem,
                     STEP_HINT)
from .ranks import evaluate, probe_stage, run_pipelined, STAGE_SCENARIOS


STAGE_REFERENCES = ("torch.distributed.pipelining.stage:PipelineStage",)


STAGE_TIMEOUT = 20.0  # seconds: a right answer takes about one


STAGE_HINT = ("every send needs its receive on the other rank, with a tensor of the same shape: rank 0 sends its "
              "activations and then waits for their gradient; rank 1 receives them into a tensor of act_shape, "
              "and after its backward sends back that tensor's gradient, which autograd computes only for a "
              "tensor that requires grad")


@exercise("06.stage_step", points=5, description="stage_step(stage, x, target, loss_fn, optimizer, act_shape) -> "
          "float | None: one training step of one of two pipeline stages, each in its own rank; activations "
          "forward, their gradient back; two ranks train like one process", references=STAGE_REFERENCES)
def _stage_step(t, stage_step):
    """One launch of 2 ranks (gloo on the CPU on any machine: the check judges the exchange), two scenarios.

    Catches: a hang or error from unmatched sends and receives (reported after STAGE_TIMEOUT), received
    activations that do not require grad, rank 0 not finishing backward with the received gradient (or
    with another one), a rank that never steps, no zero_grad (gradients accumulated over steps), a tensor
    or nothing returned, torch's own pipelining (PipelineStage).
    """
    evidence = launch_scenarios(t, probe_stage, 2, stage_step, STAGE_SCENARIOS, timeout=STAGE_TIMEOUT)
    res = None
    with t.case("2 ranks, 3 steps of an MLP cut in two (CrossEntropyLoss, SGD with momentum): every step "
                "completes on both ranks, and each rank sends the other a tensor in every step", hint=STAGE_HINT):
        res = evidence.get(t, 0)
        sent = [r["sent"] for r in res]
        if min(sent) < len(res[0]["returns"]):
            t.fail("in a pipeline both ranks send: rank 0 its activations to rank 1, rank 1 their gradient back to "
                   "rank 0, once per step; " + " and ".join(f"rank {r} sent {n} tensor(s)" for r, n in
                                                           enumerate(sent)) + f" in {len(res[0]['returns'])} steps",
                   "at least one send per rank and step", f"sends: {sent}")
    with t.case("rank 1 returns each step's loss as a float, rank 0 returns None"):
        if res is None:
            t.fail("not judged: the first case did not pass")
        problem = stage_returns_problem(res)
        if problem:
            t.fail("the last rank has the loss: return it as a Python float (.item()); the first rank has none "
                   "and returns None", "None on rank 0, a float on rank 1", problem)
    with t.case("two ranks train like one process: after every step's losses, and at the end both stages' "
                "weights, equal those of nn.Sequential(stage0, stage1) trained in one process"):
        if res is None or stage_returns_problem(res):
            t.fail("not judged: the earlier cases did not pass")
        hint, got = stage_diagnosis(res, STAGE_SCENARIOS[0])
        if hint:
            t.fail(hint, "the losses and weights of one process", got)
    with t.case("stages on cuda:0 and cuda:1 (GPUs the check simulates), x and the labels on the CPU: x moved to "
                "stage 0's device, the labels to stage 1's, every receive buffer made on its stage's device; the "
                "same losses and weights as one process"):
        placed = evidence.get(t, 2)
        hint, got = stage_placement_problem(placed)
        if hint:
            t.fail(hint, "every tensor on the device of the stage that uses it", got)
        problem = stage_returns_problem(placed)
        hint, got = stage_diagnosis(placed, STAGE_SCENARIOS[2]) if not problem else ("", problem)
        if problem or hint:
            t.fail(hint, "the losses and weights of one process", got)
    with t.case("regression stages (MSELoss), batch 5, 4 steps: the same as one process", hidden=True):
        got_res = evidence.get(t, 1)
        problem = stage_returns_problem(got_res)
        if problem:
            t.fail("None on rank 0, the loss as a float on rank 1", got=problem)
        hint, got = stage_diagnosis(got_res, STAGE_SCENARIOS[1])
        if hint:
            t.fail(hint, "the losses and weights of one process", got)


PLACES = ("each micro-batch moved to stage1's device, the activations to stage2's, the labels to the output's; "
          "the stages stay where they are")


@exercise("06.pipelined_step", points=8, description="pipelined_step(stage1, stage2, x, y, loss_fn, n_micro): "
          "forward and backward over n_micro micro-batches placed on the stages' devices; the gradients of the "
          "full batch added to .grad; returns the mean loss",
          references=("mgpu_lab.parallel.gpipe:timed_step",))
def _pipelined(t, pipelined_step):
    """Judges five batches in one process, stages on cuda:2 and cuda:3 (virtual), batches on the CPU.

    Catches: a tensor returned, or the sum of the losses; unweighted micro-batch
    losses (n_micro times the gradient); 1/n_micro weights with uneven chunks;
    the remainder dropped; zero_grad in the loop (only the last micro-batch
    left) or at the start (what the caller had in .grad is gone); detached
    activations; no micro-batching or an extra pass over the whole batch,
    torch.split(x, n_micro) for torch.chunk; a micro-batch, the activations or
    the labels not moved (or moved to "cpu" or a fixed GPU); a stage moved.
    """
    specs = [(8, 4, False, True), (8, 1, False, False), (10, 4, False, False), (6, 4, False, False),
             (7, 3, True, False)]
    runs = [None] * len(specs)
    with t.case("batch 8, n_micro=4: returns the batch's mean loss as a Python float",
                hint="the value returned must be the whole batch's mean loss, a Python float"):
        runs = t.call(run_pipelined, pipelined_step, specs)
        require_ran(t, runs[0])
        if runs[0]["type"] != "float":
            t.fail("return a Python float, not a tensor", "float", runs[0]["type"])
        judge_loss(t, runs[0])
    main, plain_step, uneven, *hidden = runs
    with t.case("batch 8, n_micro=4: adds the gradients of one whole-batch step to what .grad held (the caller "
                "zeroes them, not pipelined_step)", hint=STEP_HINT):
        judge_grads(t, main)
    with t.case("batch 8, n_micro=4: both stages see 4 micro-batches of 2, and no pass over the whole batch",
                hint="each stage must see every micro-batch of torch.chunk(x, n_micro) once (n_micro pieces; "
                     "torch.split(x, n) cuts pieces of n rows) and never the whole batch"):
        require_ran(t, main)
        sizes = {name: [rest[3] for who, event, *rest in main["stage_log"] if who == name and event == "input"]
                 for name in ("stage1", "stage2")}
        t.equal(sizes, {"stage1": [2, 2, 2, 2], "stage2": [2, 2, 2, 2]})
    with t.case(f"stages on cuda:2 and cuda:3 (GPUs the check simulates), batch on the CPU: {PLACES}",
                hint=PLACES):
        if runs[0] is None:
            t.fail("the first case did not finish")
        if not any(event == "input" for run in runs for _, event, *_ in run.get("stage_log", [])):
            t.fail("the stages never ran on any batch, so nothing was placed", "every tensor on the device of "
                   "the stage that uses it", "no stage ran")
        problems = [p for run in runs if "stage_log" in run for p in [placement_problem(run)] if p]
        if problems:
            t.fail(problems[0], "every tensor on the device of the stage that uses it", problems[0].split(": ")[0])
    with t.case("n_micro=1 is the plain step", hint=STEP_HINT):
        judge_grads(t, plain_step)
        judge_loss(t, plain_step)
    with t.case("batch 10, n_micro=4 (torch.chunk: 3, 3, 3, 1): the gradients and loss of the whole batch",
                hint="with chunks of 3, 3, 3 and 1 every sample must count as much as in the whole batch's mean "
                     "loss, and none may be left out"):
        judge_grads(t, uneven)
        judge_loss(t, uneven)
    for run, name in zip(hidden, ("batch 6, n_micro=4 (torch.chunk gives 3 pieces of 2)", "batch 7, n_micro=3, "
                                                                                          "MSELoss")):
        with t.case(name, hidden=True):
            judge_grads(t, run)
            judge_loss(t, run)


# -- bubble_fraction ----------------------------------------------------------------
_VISIBLE = [
    ("equal stages, free transfers: bubble_fraction([1, 1], [2, 2], 4) is 0.2, GPipe's formula (p-1)/(m+p-1); "
     "one stage never idles", [(([1, 1], [2, 2], 4), ()), (([1.5], [3.0], 6), ())]),
    ("unequal stages: forward [1, 3], backward [2, 6], 4 micro-batches: the slow stage sets the pace",
     [(([1, 3], [2, 6], 4), ())]),
    ("transfers: equal stages [1, 1] / [2, 2], 4 micro-batches, transfer=0.5: each message on the critical path",
     [(([1, 1], [2, 2], 4), (0.5,))]),
    ("3 unequal stages with transfers: forward [1, 2, 1], backward [2, 3, 2], 6 micro-batches, transfer=0.25",
     [(([1, 2, 1], [2, 3, 2], 6), (0.25,))]),
]


def _grid() -> list:
    g = torch.Generator().manual_seed(6)
    out = []
    for p in (1, 2, 3, 4, 6):
        for m in (1, 2, 5, 16):
            f = (0.5 + 2 * torch.rand(p, generator=g, dtype=torch.float64)).tolist()
            b = (0.5 + 4 * torch.rand(p, generator=g, dtype=torch.float64)).tolist()
            out.append(((f, b, m), (round(float(torch.rand(1, generator=g)), 3),)))
    return out


_BAD = [([1, 1], [2], 4), ([], [], 4), ([1], [2], 0), ([1], [2], -2), ([1], [2], True), ([1], [2], 2.0)]


@exercise("06.bubble_fraction", points=6, description="bubble_fraction(forward, backward, n_micro, transfer=0.0): "
          "the idle fraction of a GPipe step with per-stage forward and backward times and a transfer time "
          "between stages; ValueError for stages that do not match or a bad n_micro",
          references=("mgpu_lab.parallel.gpipe:fit_bubble", "mgpu_lab.parallel.schedule:gpipe_schedule"))
def _bubble(t, bubble_fraction):
    """Judges every call in one process against the simulated schedule (:func:`.judges.schedule_bubble`).

    Catches: GPipe's equal-stage formula for every input, transfers counted one way only, the mean
    stage instead of the slowest, m instead of m - 1 micro-batches at the slowest pace, the busy time
    not divided among the stages, a percentage, ValueError missing for mismatched stages, n_micro < 1,
    bools or floats (one case, the only one about input validation).
    """
    grid = _grid()
    calls = [args + extra for _, cases in _VISIBLE for args, extra in cases] + \
        [args + extra for args, extra in grid] + _BAD
    results = Results()
    for name, cases in _VISIBLE:
        with t.case(name):
            if not results:
                results.extend(zip(calls, t.call(evaluate, bubble_fraction, calls)))
            for args, extra in cases:
                judge_bubble(t, args, extra, results[args + extra])
    with t.case("raises ValueError when forward and backward differ in length or are empty, or n_micro is not "
                "an int >= 1 (0, -2, True, 2.0)",
                hint="your function accepted, or raised another error for, arguments that describe no pipeline "
                     "(True is an int in Python, and 2.0 is no int)"):
        judge_raises(t, results, _BAD)
    with t.case("20 more pipelines: 1 to 6 stages of random times, 1 to 16 micro-batches, random transfers",
                hidden=True):
        if not results:
            t.fail("the first case did not finish")
        for args, extra in grid:
            judge_bubble(t, args, extra, results[args + extra])
