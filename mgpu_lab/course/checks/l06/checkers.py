"""Checks of lesson 06 (model parallelism): stage_step, pipeline_step, pipelined_step, bubble_fraction.

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
from .judges import (judge_bubble, judge_grads, judge_loss, judge_raises, messages_problem, order_problem,
                     overlap_problem, require_ran, Results, placement_problem, stage_diagnosis, stage_reference,
                     stage_placement_problem, stage_returns_problem, STEP_HINT)
from .ranks import evaluate, PIPE_SCENARIOS, probe_pipeline, probe_stage, run_pipelined, STAGE_SCENARIOS, WORK_S


STAGE_REFERENCES = ("torch.distributed.pipelining.stage:PipelineStage",)
PIPE_REFERENCES = STAGE_REFERENCES + ("mgpu_lab.pipelining.train:train",)  # every torch schedule needs a stage


STAGE_TIMEOUT = 20.0  # seconds: a right answer takes about one
PIPE_TIMEOUT = 30.0   # seconds: a right answer takes about two


WAITED = ("the ranks waited for each other: a blocking send or receive returns only once the other rank has made "
          "the matching call, so each one needs a partner on the other rank, reached in an order that lets both "
          "ranks get there (what each rank waited in is above)")


NO_GRAD = ("a .grad your code read was None: autograd fills .grad only for a tensor that requires grad and that "
           "the backward went through")


DIED = ("a rank's process died without a Python error: gloo, for one, aborts a process that receives a message "
        "larger than the tensor it receives into")


def _evidence(t, evidence, k: int) -> list:
    """Scenario ``k``'s evidence; when the ranks raised there, fail saying what the error tells (a deadlock: where
    each rank waited; a missing gradient) instead of leaving a hang's hint on an error that is no hang."""
    from mgpu_lab.launcher.errors import LaunchError, LaunchTimeout

    from .._core import _error_text

    try:
        return evidence.get(t, k)
    except LaunchTimeout:
        raise  # the case says it hung, with its hint
    except LaunchError as exc:
        if exc.exc_type in ("NotImplementedError", "ReferenceCalled"):
            raise
        said = _error_text(exc)
        hint = WAITED if exc.exc_type == "Deadlock" else NO_GRAD if "'NoneType' object" in said else \
            DIED if not exc.exc_type else "your code raised in a rank: the error and its line are above"
        t.fail(hint, got=said)


def _stage_training(t, evidence, k: int) -> None:
    """Fail unless scenario ``k``'s two ranks returned None and floats and trained like one process."""
    res = _evidence(t, evidence, k)
    problem = stage_returns_problem(res)
    hint, got = stage_diagnosis(res, STAGE_SCENARIOS[k]) if not problem else ("", problem)
    if problem or hint:
        t.fail(hint or "rank 1 returns each step's loss as a Python float, rank 0 returns None",
               "the losses and weights of one process", got)


@exercise("06.stage_step", points=3, description="stage_step(stage, x, target, loss_fn, optimizer, act_shape) -> "
          "float | None: one training step of one of two pipeline stages, each in its own rank; two ranks train "
          "like one process", references=STAGE_REFERENCES)
def _stage_step(t, stage_step):
    """One launch of 2 ranks (gloo on the CPU on any machine: the check judges the exchange), three scenarios.

    Catches: a hang or error from unmatched sends and receives (reported after STAGE_TIMEOUT), received
    activations that do not require grad, rank 0 not finishing backward with the received gradient (or
    with another one), a rank that never steps, no zero_grad (gradients accumulated over steps), a tensor
    or nothing returned, torch's own pipelining (PipelineStage).
    """
    evidence = launch_scenarios(t, probe_stage, 2, stage_step, STAGE_SCENARIOS, timeout=STAGE_TIMEOUT)
    with t.case("2 ranks, 3 steps of an MLP cut in two (CrossEntropyLoss, SGD with momentum): every step completes "
                "on both ranks, each rank sends the other a tensor in every step, rank 1 returns the loss as a "
                "float and rank 0 None", hint=WAITED):
        res = _evidence(t, evidence, 0)
        sent = [r["sent"] for r in res]
        if min(sent) < len(res[0]["returns"]):
            t.fail(" and ".join(f"rank {r} sent {n} tensor(s)" for r, n in enumerate(sent)) + f" in "
                   f"{len(res[0]['returns'])} steps: in one process, forward needs what the first stage computes "
                   "and backward needs what only the last stage's side computes; across two ranks, whatever one "
                   "rank needs of the other's work must travel", "at least one send per rank and step",
                   f"sends: {sent}")
        problem = stage_returns_problem(res)
        if problem:
            t.fail("the last rank has the loss: return it as a Python float (.item()); the first rank has none "
                   "and returns None", "None on rank 0, a float on rank 1", problem)
    with t.case("two ranks train like one process: after every step the loss, and both stages' weights, equal "
                "those of nn.Sequential(stage0, stage1) trained in one process (the MLP, 3 steps; regression "
                "stages with MSELoss, batch 5, 4 steps)"):
        _stage_training(t, evidence, 0)
        _stage_training(t, evidence, 1)
    with t.case("stages on cuda:0 and cuda:1 (GPUs the check simulates), x and the labels on the CPU: x moved to "
                "stage 0's device, the labels to stage 1's, every receive buffer made on its stage's device; the "
                "same losses and weights as one process"):
        placed = _evidence(t, evidence, 2)
        hint, got = stage_placement_problem(placed)
        if hint:
            t.fail(hint, "every tensor on the device of the stage that uses it", got)
        _stage_training(t, evidence, 2)


def _pipe_training(t, evidence, k: int) -> list:
    """Scenario ``k``'s evidence; fail unless its ranks returned None and floats and trained like one process."""
    res = _evidence(t, evidence, k)
    kind, batch, n_micro, steps, seed = PIPE_SCENARIOS[k]
    problem = stage_returns_problem(res)
    if problem:
        t.fail("rank 1 returns each step's loss as a Python float, rank 0 returns None",
               "None on rank 0, a float on rank 1", problem)
    hint, got = stage_diagnosis(res, (kind, batch, steps, seed), n_micro)
    if hint:
        t.fail(hint, "the losses and weights of one process", got)
    return res


def _pipe_case(t, evidence, k: int, what: str) -> None:
    """A case judged on the training of scenario ``k`` alone."""
    kind, batch, n_micro, steps, seed = PIPE_SCENARIOS[k]
    chunks = [len(c) for c in torch.chunk(torch.empty(batch), n_micro)]
    with t.case(f"{batch} rows, n_micro={n_micro} (torch.chunk: {chunks}), {what}: the losses and both stages' "
                "weights equal one process's", hidden=k >= 5, hint=WAITED):
        _pipe_training(t, evidence, k)


@exercise("06.pipeline_step", points=11, description="pipeline_step(stage, x, target, loss_fn, optimizer, "
          "act_shape, n_micro) -> float | None: stage_step with micro-batches in GPipe order on 2 ranks: one "
          "message per micro-batch each way, the stages overlap, two ranks train like one process",
          references=PIPE_REFERENCES)
def _pipeline_step(t, pipeline_step):
    """One launch of 2 ranks (gloo), every scenario of :data:`.ranks.PIPE_SCENARIOS` in it.

    Catches: a hang (unmatched or mis-ordered sends and receives, a receive for a micro-batch torch.chunk
    did not make) after PIPE_TIMEOUT or at once by the recorder's deadlock finder, a step without
    overlap (every forward before the first send, every receive before the first forward), backwards
    before the last forward, extra or merged messages, micro-batch losses unweighted or weighted 1/n_micro,
    gradients matched to the wrong micro-batch, no zero_grad, a tensor returned, buffers off the stage's
    device, torch's own pipelining.
    """
    evidence = launch_scenarios(t, probe_pipeline, 2, pipeline_step, PIPE_SCENARIOS, timeout=PIPE_TIMEOUT)
    main = None
    with t.case("8 rows in 4 micro-batches (an MLP cut in two, CrossEntropyLoss, SGD with momentum, 3 steps): "
                "every step completes on both ranks; rank 1 returns the loss as a float, rank 0 None", hint=WAITED):
        main = _evidence(t, evidence, 0)
        problem = stage_returns_problem(main)
        if problem:
            t.fail("the last rank has the loss: return it as a Python float; the first rank returns None",
                   "None on rank 0, a float on rank 1", problem)
    with t.case("8 rows in 4 micro-batches: each step's loss is the whole batch's, as one process computes it"):
        if main is None or stage_returns_problem(main):
            t.fail("not judged: the first case did not pass")
        kind, batch, _, steps, seed = PIPE_SCENARIOS[0]
        ref = stage_reference((kind, batch, steps, seed))["losses"]
        got = [r[1] for r in main[1]["returns"]]
        if not all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(got, ref)):
            t.fail("the loss returned must be the mean loss over the whole batch, what one process's "
                   "loss_fn(model(x), target) gives (each micro-batch's loss is a mean over its own rows)",
                   [round(v, 5) for v in ref], [round(v, 5) for v in got])
    with t.case("8 rows in 4 micro-batches: after every step both stages' weights equal one process's"):
        _pipe_training(t, evidence, 0)
    with t.case("8 rows, and 10 rows, in 4 micro-batches: in every step one message per micro-batch each way, "
                "each of that micro-batch's size (recorded sends)"):
        for k in (0, 1):
            hint, got = messages_problem(_evidence(t, evidence, k))
            if hint:
                t.fail(hint, "one message per micro-batch from each rank", got)
    _pipe_case(t, evidence, 1, "regression stages, MSELoss, 3 steps")
    _pipe_case(t, evidence, 4, "fewer micro-batches than n_micro, 2 steps")
    with t.case("each rank's stage runs one forward per micro-batch, then one backward per micro-batch: every "
                "forward before any backward (GPipe's order), in every step of every scenario"):
        for k in (0, 1, 2, 4):
            hint, got = order_problem(_evidence(t, evidence, k))
            if hint:
                batch, n_micro = PIPE_SCENARIOS[k][1:3]
                t.fail(hint, "F0 ... F(m-1), then the backwards", f"{batch} rows, n_micro={n_micro}, {got}")
    with t.case(f"stages of fixed-work layers (every forward sleeps {1e3 * WORK_S:.0f} ms), 8 rows in 4 micro-batches:"
                " rank 1 starts micro-batch 0's forward before rank 0 has finished the last micro-batch's forward "
                "(timestamps on one clock); and the same weights as one process"):
        res = _pipe_training(t, evidence, 2)
        hint, got = overlap_problem(res)
        if hint:
            t.fail(hint, "rank 1's first forward begins before rank 0's last forward ends", got)
    with t.case("stages on cuda:0 and cuda:1 (GPUs the check simulates), x and the labels on the CPU, 6 rows in 3 "
                "micro-batches: every tensor reaches a stage, the loss or a receive on that stage's device; the same "
                "losses and weights as one process"):
        placed = _evidence(t, evidence, 3)
        hint, got = stage_placement_problem(placed)
        if hint:
            t.fail(hint, "every tensor on the device of the stage that uses it", got)
        _pipe_training(t, evidence, 3)
    _pipe_case(t, evidence, 5, "one micro-batch: stage_step's step")
    _pipe_case(t, evidence, 6, "CrossEntropyLoss")


PLACES = ("each micro-batch moved to stage1's device, the activations to stage2's, the labels to the output's; "
          "the stages stay where they are")


@exercise("06.pipelined_step", points=2, description="pipelined_step(stage1, stage2, x, y, loss_fn, n_micro): "
          "forward and backward over n_micro micro-batches placed on the stages' devices; the gradients of the "
          "full batch added to .grad; returns the mean loss",
          references=("mgpu_lab.pipelining.gpipe:timed_step",))
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
    with t.case(f"batch 8 in 4 micro-batches, and in 1, stages on cuda:2 and cuda:3 (GPUs the check simulates), "
                f"batch on the CPU: returns the batch's mean loss as a float and adds one whole-batch step's "
                f"gradients to what .grad held; both stages see 4 micro-batches of 2, never the whole batch; {PLACES}",
                hint=STEP_HINT):
        runs = t.call(run_pipelined, pipelined_step, specs)
        main, plain_step = runs[0], runs[1]
        require_ran(t, main)
        if main["type"] != "float":
            t.fail("return a Python float, not a tensor", "float", main["type"])
        for run in (main, plain_step):
            judge_loss(t, run)
            judge_grads(t, run)
        sizes = {name: [rest[3] for who, event, *rest in main["stage_log"] if who == name and event == "input"]
                 for name in ("stage1", "stage2")}
        t.equal(sizes, {"stage1": [2, 2, 2, 2], "stage2": [2, 2, 2, 2]},
                hint="each stage must see every micro-batch of torch.chunk(x, n_micro) once (n_micro pieces; "
                     "torch.split(x, n) cuts pieces of n rows) and never the whole batch")
        problems = [p for run in runs if "stage_log" in run for p in [placement_problem(run)] if p]
        if problems:
            t.fail(problems[0], "every tensor on the device of the stage that uses it", problems[0].split(": ")[0])
    with t.case("chunks that do not divide the batch: 10 rows in 4 micro-batches (torch.chunk: 3, 3, 3, 1), 6 rows "
                "in 4 (3 pieces of 2), 7 rows in 3 with MSELoss: the gradients and loss of the whole batch",
                hint="with chunks of 3, 3, 3 and 1 every sample must count as much as in the whole batch's mean "
                     "loss, and none may be left out"):
        for run in runs[2:]:
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
          references=("mgpu_lab.pipelining.gpipe:fit_bubble", "mgpu_lab.pipelining.schedule:gpipe_schedule"))
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
