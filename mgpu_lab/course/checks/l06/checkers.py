"""Checks of lesson 06 (model parallelism): TwoStageNet, pipelined_step, bubble_fraction.

Placement is judged on a machine without GPUs by giving the learner's code names
of GPUs: the stages and tensors of :mod:`..sim.devices` keep their data on the CPU
and record where they would be, so "forgot to move the activations" fails here as
it fails on two GPUs ("Expected all tensors to be on the same device"). What runs
in the fresh process is :mod:`.ranks` (one launch per check); this module
judges, in the kernel.
"""
from __future__ import annotations

import torch

from .._core import exercise
from .judges import (judge_grads, judge_loss, judge_raises, judge_value, require_ran, Results, FORMULA,
                     judge_activations, judge_input, judge_output, judge_stages, placement_problem, SAME_DEVICE,
                     started, STEP_HINT)
from .ranks import evaluate, run_pipelined, run_two_stage


@exercise("06.TwoStageNet", points=8, description="TwoStageNet(stage1, stage2, dev1, dev2): each stage on its "
          "device, the input moved to dev1 and the activations to dev2 in forward, output on dev2; same outputs "
          "and gradients as unsplit")
def _two_stage(t, TwoStageNet):
    """Judges the net with dev1=cuda:2, dev2=cuda:3 (virtual GPUs; the batch on the CPU).

    Catches: not an nn.Module or stages kept in a plain list (parameters unseen);
    outputs or gradients that differ (detached activations, no_grad); a stage
    never moved, or moved to the other's device; the input never moved to dev1,
    or moved to "cpu", "cuda" or the wrong GPU; the activations never moved to
    dev2, or moved and the copy thrown away; the output moved off dev2 (.cpu(),
    .to(dev1)); hard-coded device names (the hidden case uses cuda:1 and cuda:0,
    as strings).
    """
    runs = [{}, {}]
    with t.case("is an nn.Module whose parameters are both stages' parameters",
                hint="subclass nn.Module, call super().__init__() first, and keep the stages as attributes "
                     "(self.stage1 = ...), so that model.parameters() and the optimizer see both"):
        runs = t.call(run_two_stage, TwoStageNet, [(False, torch.device("cuda", 2), torch.device("cuda", 3)),
                                                    (True, "cuda:1", "cuda:0")])
        run = runs[0]
        if "module" in run and not run["module"]:
            t.fail("", "an nn.Module", f"a {run['type']}")
        if "n_params" not in run:
            t.fail("", "the net built", "your code raised " + run["raised"])
        t.equal(run["n_params"], run["n_expected"])
    run = runs[0]
    with t.case("forward gives the same output as the unsplit model nn.Sequential(stage1, stage2)",
                hint="forward is stage2(stage1(x)) with a move in between; return the output of stage2"):
        started(t, run)
        if run["output_type"] != "Tensor":
            t.fail("forward must return the output tensor", "a Tensor", run["output_type"])
        t.equal(run["same_output"], True)
    with t.case("backward gives both stages the same gradients as the unsplit model",
                hint="do not detach the activations or wrap forward in torch.no_grad(): .to(dev2) keeps the "
                     "graph, so the gradient flows back to stage1"):
        started(t, run)
        if not run.get("same_output"):
            t.fail("needs the same output first")
        t.equal(run["same_grads"], True)
    with t.case("puts stage1 on dev1 and stage2 on dev2 (given cuda:2 and cuda:3: GPUs the check simulates, "
                "recording every move)", hint="in __init__: self.stage1 = stage1.to(dev1); self.stage2 = "
                                             "stage2.to(dev2)"):
        judge_stages(t, run)
    with t.case("moves the input x (on the CPU, as a DataLoader gives it) to dev1 before stage1",
                hint=f"forward starts with self.stage1(x.to(self.dev1)): stage1's weights are on dev1, and "
                     f"{SAME_DEVICE}"):
        judge_input(t, run)
    with t.case("moves the activations to dev2 before stage2, and gives stage2 the moved copy",
                hint=f"h = self.stage1(...); return self.stage2(h.to(self.dev2)): {SAME_DEVICE}"):
        judge_activations(t, run)
    with t.case("returns the output of stage2 where it is, on dev2",
                hint="return stage2's output as it is: moving it (.to(dev1), .cpu()) costs a copy, and the loss "
                     "belongs on dev2, with the labels moved there"):
        judge_output(t, run)
    with t.case("conv stages, devices passed as strings ('cuda:1', 'cuda:0'): all of the above", hidden=True):
        again = runs[1]
        for judge in (judge_stages, judge_input, judge_activations, judge_output):
            judge(t, again)
        if not again.get("same_grads"):
            t.fail("conv stages: different outputs or gradients")


PLACES = ("each micro-batch moved to stage1's device, the activations to stage2's, the labels to the output's; "
          "the stages stay where they are")


@exercise("06.pipelined_step", points=8, description="pipelined_step(stage1, stage2, x, y, loss_fn, n_micro): "
          "forward and backward over n_micro micro-batches placed on the stages' devices; the gradients of the "
          "full batch added to .grad; returns the mean loss")
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
                hint="return the sum of the micro-batch losses weighted by len(x_i)/len(x), as float(...) or .item()"):
        runs = t.call(run_pipelined, pipelined_step, specs)
        require_ran(t, runs[0])
        if runs[0]["type"] != "float":
            t.fail("return a Python float (loss.item()), not a tensor", "float", runs[0]["type"])
        judge_loss(t, runs[0])
    main, plain_step, uneven, *hidden = runs
    with t.case("batch 8, n_micro=4: adds the gradients of one whole-batch step to what .grad held (the caller "
                "zeroes them, not pipelined_step)", hint=STEP_HINT):
        judge_grads(t, main)
    with t.case("batch 8, n_micro=4: both stages see 4 micro-batches of 2, and no pass over the whole batch",
                hint="torch.chunk(x, n_micro) cuts n_micro pieces (torch.split(x, n) cuts pieces of n rows); run "
                     "the stages on each micro-batch in turn, and no extra pass over the whole batch: the mean loss "
                     "is the sum of the weighted micro-batch losses"):
        require_ran(t, main)
        sizes = {name: [rest[3] for who, event, *rest in main["stage_log"] if who == name and event == "input"]
                 for name in ("stage1", "stage2")}
        t.equal(sizes, {"stage1": [2, 2, 2, 2], "stage2": [2, 2, 2, 2]})
    with t.case(f"stages on cuda:2 and cuda:3 (GPUs the check simulates), batch on the CPU: {PLACES}",
                hint=PLACES):
        if runs[0] is None:
            t.fail("the first case did not finish")
        problems = [p for run in runs if "stage_log" in run for p in [placement_problem(run)] if p]
        if problems:
            t.fail(problems[0], "every tensor on the device of the stage that uses it", problems[0].split(": ")[0])
    with t.case("n_micro=1 is the plain step", hint=STEP_HINT):
        judge_grads(t, plain_step)
        judge_loss(t, plain_step)
    with t.case("batch 10, n_micro=4 (torch.chunk: 3, 3, 3, 1): the gradients and loss of the whole batch",
                hint="weight each micro-batch by its size, len(x_i) / len(x), not 1/n_micro; do not drop the rest"):
        judge_grads(t, uneven)
        judge_loss(t, uneven)
    for run, name in zip(hidden, ("batch 6, n_micro=4 (torch.chunk gives 3 pieces of 2)", "batch 7, n_micro=3, "
                                                                                          "MSELoss")):
        with t.case(name, hidden=True):
            judge_grads(t, run)
            judge_loss(t, run)


# -- bubble_fraction ----------------------------------------------------------------
_VALUES = [((2, 1), 0.5), ((2, 4), 0.2), ((4, 8), 3 / 11), ((1, 8), 0.0)]


_GRID = [((p, m), (p - 1) / (m + p - 1)) for p in (1, 2, 3, 5, 8, 16) for m in (1, 2, 3, 7, 32, 100)]


_BAD_SIGN = [(0, 4), (2, 0), (-1, 4), (2, -3)]


_BAD_TYPE = [(True, 4), (2, False), (2.0, 4), (2, 4.5), ("2", 4), (None, 4)]


@exercise("06.bubble_fraction", points=7, description="bubble_fraction(n_stages, n_micro): GPipe's idle "
          "fraction (p-1)/(m+p-1); ValueError for anything but whole numbers >= 1")
def _bubble(t, bubble_fraction):
    """Judges 50 calls made in one process.

    Catches: the arguments swapped, an off-by-one in the numerator or the
    denominator, // for /, a percentage or a rounded value; one stage or one
    micro-batch rejected; no ValueError for 0 or negatives; bools, floats,
    strings or None accepted, or TypeError raised for them (one case, the only
    one about types, also asks for a float result).
    """
    calls = [a for a, _ in _VALUES] + [a for a, _ in _GRID] + _BAD_SIGN + _BAD_TYPE
    results = Results()
    cases = [("bubble_fraction(2, 1) is 0.5: with one micro-batch each of 2 stages idles half the time", _VALUES[:1]),
             ("bubble_fraction(2, 4) is 0.2: more micro-batches, a smaller bubble", _VALUES[1:2]),
             ("bubble_fraction(4, 8) is 3/11", _VALUES[2:3]),
             ("bubble_fraction(1, 8) is 0: one stage never waits", _VALUES[3:])]
    for name, values in cases:
        with t.case(name, hint=f"compute {FORMULA} with / (// rounds down to 0): p - 1 slots to fill the pipe, "
                               "m slots of work"):
            if not results:
                results.extend(zip(calls, t.call(evaluate, bubble_fraction, calls)))
            for args, expected in values:
                judge_value(t, args, results[args], expected)
    with t.case("raises ValueError for zero or negative n_stages or n_micro",
                hint="check both arguments are >= 1 first: raise ValueError(f'n_micro={n_micro} must be >= 1')"):
        judge_raises(t, results, _BAD_SIGN)
    with t.case("returns a float, and raises ValueError for bools and non-integers (True, 2.0, 4.5, '2', None)",
                hint="isinstance(True, int) is True: reject bools explicitly, and anything that is not an int, "
                     "with ValueError; / returns a float"):
        judge_raises(t, results, _BAD_TYPE)
        ints = [(args, results[args]) for args, _ in _VALUES if results[args][0] == "ok" and not results[args][2]]
        if ints:
            t.fail("return a float: (p - 1) / (m + p - 1) with /", "a float", f"bubble_fraction{ints[0][0]} "
                   f"returned {ints[0][1][1]!r}")
    with t.case("36 more (n_stages, n_micro) pairs", hidden=True):
        if not results:
            t.fail("the first case did not finish")
        for args, expected in _GRID:
            judge_value(t, args, results[args], expected)
