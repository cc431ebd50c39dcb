"""Lesson 06's placement verdicts: the evidence of the virtual GPUs (:mod:`..sim.devices`), in words.

:mod:`.checkers` asks these for the cases about devices: where each stage was
put, and on which device each input, activation and label reached what used it.
Each names the bug as it shows on two GPUs.
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


def judge_value(t, args, got, expected) -> None:
    if got[0] != "ok":
        one = " one stage (n_stages=1) and one micro-batch (n_micro=1) are allowed;" if 1 in args else ""
        t.fail(f"bubble_fraction{args} must not raise:{one} it is a fraction of the step", repr(expected),
               in_words(got))
    if not isinstance(got[1], (int, float)):
        t.fail("return the fraction, a number", repr(expected), in_words(got))
    if expected and abs(got[1] - 100 * expected) < 1e-9:
        t.fail("a fraction in [0, 1), not a percentage", repr(expected), in_words(got))
    if isinstance(got[1], int) and expected != got[1]:
        t.fail("your function returned a whole number: the fraction lies between 0 and 1, so return a float "
               "(// rounds down to 0)", repr(expected), in_words(got))
    t.close(got[1], expected, atol=1e-12, rtol=1e-12)


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
