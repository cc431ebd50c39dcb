"""Lesson 06's verdicts, in words: stage_step against one process, pipelined_step, bubble_fraction.

:mod:`.checkers` asks these for ``stage_step``'s comparison with one process training
the whole model (:func:`stage_diagnosis` names the known mistake the weights match),
for ``pipelined_step``'s gradients and placement (the evidence of the virtual GPUs,
:mod:`..sim.devices`: on which device each input, activation and label reached what
used it, named as the bug shows on two GPUs), and for ``bubble_fraction``'s values
against the simulated schedule (:func:`judge_bubble`, naming the wrong model a value matches).
"""
from __future__ import annotations

import torch
from torch import nn

from ..sim.outcome import in_words


# -- pipelined_step -----------------------------------------------------------------
_BUGS = {
    "unscaled": "the gradients are the sum of the micro-batch gradients, n_micro times too big: each micro-batch's "
                "loss is a mean over that micro-batch, so taken as it is it counts as much as the whole batch",
    "one_over_n": "with uneven micro-batches, 1/n_micro is the wrong weight (and torch.chunk may give fewer than "
                  "n_micro pieces): a micro-batch of 1 sample then counts as much as one of 3",
    "last_only": "only the last micro-batch's gradient is left: the gradients were cleared between micro-batches; "
                 "the caller zeroes them once, before the step, and backward must add up every micro-batch",
    "dropped": "the last len(x) % n_micro samples were left out: every sample of the batch must count (torch.chunk's "
               "last chunk is the smaller one)",
    "zeroed": "the gradients .grad held before the step are gone: the caller zeroes the gradients (and may "
              "accumulate several steps first); pipelined_step must only add to them, never call zero_grad",
    "detached": "stage1 got no gradient: the activations were cut from the graph (.detach(), .data or "
                "torch.no_grad()); a move with .to() keeps the graph, so backward reaches stage1",
    "no_grads": "no gradients: nothing ran backward",
}


STEP_HINT = ("the gradients added to .grad must be those of the mean loss over the whole batch, what one backward "
             "of the unsplit model on the whole batch adds, and the value returned that mean loss")


def require_ran(t, run) -> None:
    if run is None:
        t.fail("the first case did not finish")
    if "raised" in run:
        t.fail(STEP_HINT, "", "your code raised " + run["raised"])


def judge_grads(t, run) -> None:
    require_ran(t, run)
    if not run["same"]:
        t.fail(_BUGS.get(run["bug"], STEP_HINT), "the gradients of one full-batch step" + (
            " added to what .grad held" if run["batch"] == 8 and run["n_micro"] == 4 else ""),
            "different gradients" + (f" ({run['bug']})" if run["bug"] else ""))


def judge_loss(t, run) -> None:
    require_ran(t, run)
    if not isinstance(run["loss"], float):
        t.fail("return the mean loss, a number", "a float", run["loss"])
    t.close(run["loss"], run["ref_loss"], hint="return the sum of the micro-batch losses, each weighted by "
                                               "len(x_i) / len(x): the mean loss over the batch")


class Results(list):
    """``(args, result)`` pairs looked up by identity of types: (2.0, 4) == (2, 4) as dict keys."""

    def __getitem__(self, args):
        return next(r for a, r in self if a == args and list(map(type, a)) == list(map(type, args)))


def schedule_bubble(forward, backward, n_micro, transfer=0.0) -> float:
    """The idle fraction of GPipe's schedule, simulated span by span (the check's reference)."""
    from mgpu_lab.parallel.schedule import gpipe_schedule

    return gpipe_schedule(forward, backward, n_micro, transfer).idle_fraction()


def _wrong_models(forward, backward, m, c=0.0) -> dict:
    """The values of known wrong answers, by what they did."""
    p, f, b = len(forward), sum(forward), sum(backward)
    busy = m * (f + b)

    def idle(step, per_stage=True):
        return 1 - busy / ((p if per_stage else 1) * step) if step else float("nan")

    slow = max(forward) + max(backward)
    return {
        "GPipe's formula for equal stages and free transfers, whatever the stage and transfer times":
            (p - 1) / (m + p - 1),
        "transfers counted in one direction only: the gradients travel back through the same p - 1 links":
            idle(f + b + (p - 1) * c + (m - 1) * slow),
        "the mean stage sets the pace: it is the slowest stage that the micro-batches queue behind":
            idle(f + b + 2 * (p - 1) * c + (m - 1) * (f + b) / p),
        "all m micro-batches at the slowest stage's pace on top of the first one's trip: m - 1 follow it":
            idle(f + b + 2 * (p - 1) * c + m * slow),
        "the busy time of all stages over one stage's time: the idle fraction is over p stages' time":
            idle(f + b + 2 * (p - 1) * c + (m - 1) * slow, per_stage=False),
    }


def judge_bubble(t, args, extra, got) -> None:
    """Fail unless ``got`` is the schedule's idle fraction; name the known wrong answer it matches."""
    expected = schedule_bubble(*args, *extra)
    shown = f"bubble_fraction{tuple(args) + tuple(extra)}"
    if got[0] != "ok":
        t.fail(f"{shown} describes a pipeline and must not raise", repr(expected), in_words(got))
    if not isinstance(got[1], (int, float)):
        t.fail("return the fraction, a number", repr(expected), in_words(got))
    value = got[1]
    if expected and abs(value - 100 * expected) < 1e-9:
        t.fail("a fraction in [0, 1), not a percentage", repr(expected), f"{shown}: {value!r}")
    if abs(value - expected) <= 1e-9 * max(1.0, abs(expected)):
        return
    wrong = next((why for why, v in _wrong_models(*args, *extra).items() if abs(value - v) <= 1e-9), None)
    t.fail(f"your value matches {wrong}" if wrong else
           "your value is not the idle fraction of GPipe's schedule: every stage runs every forward, then every "
           "backward, each as soon as its previous span is done and the result it needs has arrived",
           f"{expected:.6f}", f"{shown}: {value!r}")


def judge_raises(t, results, calls) -> None:
    if not results:
        t.fail("the first case did not finish")
    for args in calls:
        if results[args][:2] != ("raised", "ValueError"):
            t.fail("", f"bubble_fraction{args!r} raises ValueError", in_words(results[args]))


SAME_DEVICE = "on two GPUs this raises 'Expected all tensors to be on the same device'"


# -- stage_step ---------------------------------------------------------------------
def stage_reference(scenario, accumulate: bool = False) -> dict:
    """One process training ``nn.Sequential(stage0, stage1)`` as the two ranks should: the losses and each
    stage's parameters after every step (``accumulate``: zero_grad never called)."""
    from .ranks import stage_setup

    stages, loss_fn, make_optimizer, data, _ = stage_setup(*scenario)
    model = nn.Sequential(*stages)
    optimizer = make_optimizer(model.parameters())
    losses, first = [], None
    for x, target in data:
        if not accumulate:
            optimizer.zero_grad()
        loss = loss_fn(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        first = first or [[p.detach().clone() for p in s.parameters()] for s in stages]
    return {"losses": losses, "params": [[p.detach().clone() for p in s.parameters()] for s in stages], "first": first,
            "initial": [[p.detach().clone() for p in s.parameters()] for s in stage_setup(*scenario)[0]]}


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(a, b))


def stage_returns_problem(res) -> str:
    """What the two ranks returned, when it is not None on rank 0 and a float on rank 1."""
    for r, want in ((0, "none"), (1, "float")):
        for k, got in enumerate(res[r]["returns"]):
            if got[0] != want:
                shown = "None" if got[0] == "none" else f"a {got[1]} ({got[2]})" if got[0] == "other" else \
                    f"the float {got[1]:.4g}"
                return f"step {k + 1}: rank {r} returned {shown}"
    return ""


def stage_diagnosis(res, scenario) -> tuple[str, str]:
    """``(hint, got)`` for the first way the two ranks' training differs from one process's, or ``("", "")``."""
    ref = stage_reference(scenario)
    losses = [got[1] for got in res[1]["returns"]]
    own = [res[0]["params"], res[1]["params"]]
    if all(_same(own[r], ref["params"][r]) for r in (0, 1)) and \
            all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(losses, ref["losses"])):
        return "", ""
    acc = stage_reference(scenario, accumulate=True)
    if all(_same(own[r], acc["params"][r]) for r in (0, 1)):
        return ("your stages match training that never clears the gradients: each step's gradients were added "
                "to the previous steps'; every step must start from zero gradients"), "accumulated gradients"
    for r, name in ((0, "rank 0's stage (the first)"), (1, "rank 1's stage (the last)")):
        if _same(own[r], ref["initial"][r]):
            return (f"{name} never changed: it got no gradient or took no optimizer step; "
                    + ("rank 0's backward starts from the gradient of the activations that rank 1 sends back"
                       if r == 0 else "rank 1 runs backward from the loss and steps its own optimizer")), \
                f"{name}: the initial weights"
    if _same(res[1]["first"], ref["first"][1]) and not _same(res[0]["first"], ref["first"][0]):
        return ("rank 1's stage and losses are right but rank 0's stage is not: its backward must start from "
                "exactly the gradient of its activations that rank 1 computed and sent back"), "rank 0's weights differ"
    if losses and abs(losses[0] - ref["losses"][0]) > 1e-5 * max(1.0, abs(ref["losses"][0])):
        return ("the first step's loss differs from one process's: rank 1 must run its stage on the activations "
                "rank 0 computed from x, and compute loss_fn(output, target)"), f"loss {losses[0]:.5g}"
    return ("the ranks' weights drift from one process's: each step, both stages' gradients must be those of "
            "the whole model's loss, and each rank steps once"), "different weights"


def stage_placement_problem(res) -> tuple[str, str]:
    """``(hint, got)`` for the first tensor of the placed scenario that was on another device than the stage
    using it, or ``("", "")``; ``res``: both ranks' evidence (stages on cuda:0 and cuda:1, x and labels on cpu)."""
    for r, ev in enumerate(res):
        device = ev["device"]
        moved = [rest[0] for _, event, *rest in ev["stage_log"] if event == "to"]
        if moved:
            return ("the stage is already on its device: move the tensors to it, not the stage",
                    f"rank {r} moved its stage to {moved[0]}")
        wrong = [d for d in ev["received"] if d != device]
        if wrong:
            return ("a receive buffer made without device= is a CPU tensor: beside a GPU stage NCCL refuses it "
                    "(and the stage could not compute with it); make it on the stage's device, as the parameters "
                    "say it is", f"rank {r} (stage on {device}) received into a tensor on {wrong[0]}")
        for _, event, *rest in ev["stage_log"]:
            if event == "input" and rest[1] != rest[2]:
                what = "x" if rest[0] == "inputs" else "the received activations"
                return (f"{what} reached the stage on {rest[1]}, the stage is on {rest[2]}: {SAME_DEVICE}; every "
                        "tensor a stage uses must be on the device of its parameters",
                        f"rank {r}: {what} on {rest[1]}")
        for out_dev, labels_dev, _ in ev["loss_log"]:
            if out_dev != labels_dev:
                return ("the labels must be where the output is: on the last stage's device",
                        f"rank {r}: the labels reached the loss on {labels_dev}, the output is on {out_dev}")
    if not any(ev["stage_log"] for ev in res):
        return "not judged: no stage ran on any tensor", "no forward"
    return "", ""


# -- pipelined_step -----------------------------------------------------------------
def placement_problem(run) -> str:
    """What went to the wrong device in one run, in words ("" if nothing)."""
    d1, d2 = run["devices"]
    moved = [f"{name}.to({rest[0]})" for name, event, *rest in run["stage_log"] if event == "to"]
    if moved:
        return (f"your code moved a stage ({moved[0]}): the stages are already on their devices ({d1}, {d2}); "
                "the tensors must go to them, whatever devices they are on")
    for name, event, *rest in run["stage_log"]:
        if event == "input" and rest[1] != rest[2]:
            what = "a micro-batch" if name == "stage1" else "the activations"
            return (f"{what} reached {name} on {rest[1]}, but {name} is on {rest[2]}: {SAME_DEVICE}; a tensor "
                    f"must be on the device of the parameters of the stage that uses it")
    for out_dev, labels_dev, _ in run["loss_log"]:
        if out_dev != labels_dev:
            return (f"the labels reached the loss on {labels_dev}, the output is on {out_dev}: the labels must be "
                    f"where the output is")
    return ""
