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
    from mgpu_lab.pipelining.schedule import gpipe_schedule

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


# -- stage_step and pipeline_step: two ranks against one process --------------------------
def stage_reference(scenario, accumulate: bool = False, n_micro: int = 1, weigh: str = "") -> dict:
    """One process training ``nn.Sequential(stage0, stage1)`` as the two ranks should: the losses and each
    stage's parameters after the first and the last step.

    ``accumulate``: zero_grad never called. ``weigh``, a known wrong weighting of ``n_micro`` micro-batches
    (``torch.chunk``): ``"unscaled"`` every micro-batch's mean loss as it is, ``"one_over_n"`` each times
    1/n_micro. The right step is the whole batch's mean loss (``weigh=""``).
    """
    from .ranks import stage_setup

    stages, loss_fn, make_optimizer, data, _ = stage_setup(*scenario)
    model = nn.Sequential(*stages)
    optimizer = make_optimizer(model.parameters())
    losses, first = [], None
    for x, target in data:
        if not accumulate:
            optimizer.zero_grad()
        if weigh:
            scale = 1.0 if weigh == "unscaled" else 1.0 / n_micro
            loss = sum(loss_fn(model(xs), ys) * scale for xs, ys in zip(torch.chunk(x, n_micro),
                                                                        torch.chunk(target, n_micro)))
        else:
            loss = loss_fn(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        first = first or [[p.detach().clone() for p in s.parameters()] for s in stages]
    return {"losses": losses, "params": [[p.detach().clone() for p in s.parameters()] for s in stages], "first": first,
            "initial": [[p.detach().clone() for p in s.parameters()] for s in stage_setup(*scenario)[0]]}


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(a, b))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def stage_returns_problem(res) -> str:
    """What the two ranks returned, when it is not None on rank 0 and a float on rank 1."""
    for r, want in ((0, "none"), (1, "float")):
        for k, got in enumerate(res[r]["returns"]):
            if got[0] != want:
                shown = "None" if got[0] == "none" else f"a {got[1]} ({got[2]})" if got[0] == "other" else \
                    f"the float {got[1]:.4g}"
                return f"step {k + 1}: rank {r} returned {shown}"
    return ""


_KNOWN = {  # known wrong trainings: how the answer's weights came to be, in words
    "accumulate": ("your stages match training that never clears the gradients: each step's gradients were added "
                   "to the previous steps'; every step must start from zero gradients", "accumulated gradients"),
    "unscaled": ("your stages match training on the sum of the micro-batches' mean losses: each micro-batch "
                 "counted as much as the whole batch, a step n_micro times too big; one process's mean loss counts "
                 "every sample of the batch once", "the sum of the micro-batch losses"),
    "one_over_n": ("your stages match training where every micro-batch weighs 1/n_micro: when torch.chunk gives "
                   "pieces of unequal size, or fewer than n_micro of them, a sample then counts more or less than "
                   "in one process's mean loss over the batch", "every micro-batch weighted 1/n_micro"),
}


def stage_diagnosis(res, scenario, n_micro: int = 1) -> tuple[str, str]:
    """``(hint, got)`` for the first way the two ranks' training differs from one process's, or ``("", "")``.
    ``scenario`` is :func:`.ranks.stage_setup`'s; ``n_micro`` > 1 also names wrong micro-batch weightings."""
    ref = stage_reference(scenario)
    losses = [got[1] for got in res[1]["returns"]]
    own = [res[0]["params"], res[1]["params"]]
    right_weights = all(_same(own[r], ref["params"][r]) for r in (0, 1))
    if right_weights and all(_close(a, b) for a, b in zip(losses, ref["losses"])):
        return "", ""
    if right_weights:
        return ("both stages train like one process, but the value returned is not the step's loss: it must be the "
                "mean loss over the whole batch, what one process's loss_fn(model(x), target) gives"), \
            f"losses {[round(v, 5) for v in losses]}, one process {[round(v, 5) for v in ref['losses']]}"
    known = [("accumulate", dict(accumulate=True))] + \
        [(w, dict(n_micro=n_micro, weigh=w)) for w in ("unscaled", "one_over_n") if n_micro > 1]
    for name, options in known:
        if all(_same(own[r], stage_reference(scenario, **options)["params"][r]) for r in (0, 1)):
            return _KNOWN[name]
    return _drift(res, ref, losses, own)


def _drift(res, ref, losses, own) -> tuple[str, str]:
    """``(hint, got)``: which stage went wrong first, when no known wrong training matches."""
    for r, name in ((0, "rank 0's stage (the first)"), (1, "rank 1's stage (the last)")):
        if _same(own[r], ref["initial"][r]):
            return (f"{name} never changed: it got no gradient or took no optimizer step; in one process "
                    + ("the loss computed on the last stage reaches the first stage's weights through its activations"
                       if r == 0 else "the last stage's weights get the gradient of the loss")), \
                f"{name}: the initial weights"
    if _same(res[1]["first"], ref["first"][1]) and not _same(res[0]["first"], ref["first"][0]):
        return ("rank 1's stage and losses are right but rank 0's stage is not: the gradient rank 0's weights got "
                "is not the one one process computes for them (from the loss, through the activations exactly as "
                "rank 1 used them)"), "rank 0's weights differ"
    if losses and not _close(losses[0], ref["losses"][0]):
        return ("the first step's loss differs from one process's: rank 1's stage did not compute on the activations "
                "rank 0's stage made from x, or the loss is not loss_fn of its output and the labels"), \
            f"loss {losses[0]:.5g}, one process {ref['losses'][0]:.5g}"
    return ("the ranks' weights drift from one process's: each step, both stages' gradients must be those of "
            "the whole model's loss over the batch, and each rank steps once"), "different weights"


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


# -- pipeline_step: messages, order, overlap ---------------------------------------------
def messages_problem(res) -> tuple[str, str]:
    """``(hint, got)`` when a step's messages are not one per micro-batch each way, each of its micro-batch's
    activations (rank 0) or their gradient (rank 1): ``rows x width`` elements; ``("", "")`` when they are."""
    want = sorted(rows * res[0]["row_numel"] for rows in res[0]["chunks"])
    for k, (steps0, steps1) in enumerate(zip(res[0]["steps"], res[1]["steps"])):
        for r, sent in ((0, steps0["sent"]), (1, steps1["sent"])):
            if sorted(sent) != want:
                what = "activations" if r == 0 else "gradients of the activations"
                return (f"in step {k + 1}, rank {r} sent {len(sent)} message(s) of {sorted(sent)} elements for "
                        f"{len(want)} micro-batches of {want} elements: each message on the critical path costs a "
                        f"latency, and a micro-batch's {what} are all the other rank needs of it"), \
                    f"step {k + 1}, rank {r}: {len(sent)} message(s) of {sorted(sent)} elements"
    return "", ""


def order_problem(res) -> tuple[str, str]:
    """``(hint, got)`` when a rank's stage did not run one forward per micro-batch (of its rows) and then one
    backward per micro-batch, every forward before any backward (GPipe); ``("", "")`` when it did."""
    chunks = res[0]["chunks"]
    for k in range(len(res[0]["steps"])):
        for r in (0, 1):
            clock = res[r]["steps"][k]["clock"]
            forwards = [e[4] for e in clock if e[0] == "F"]
            backwards = [e[1] for e in clock if e[0] == "B"]
            labels = " ".join(f"{e[0]}{e[1]}" for e in clock)
            if forwards != chunks:
                return (f"in step {k + 1}, rank {r}'s stage ran forwards on {forwards} rows; the micro-batches of "
                        f"torch.chunk are {chunks} rows: each is one forward of each stage, in order, and no "
                        "stage sees the whole batch at once"), f"step {k + 1}, rank {r}: {labels or 'no forward'}"
            if sorted(backwards) != list(range(len(chunks))):
                return (f"in step {k + 1}, rank {r}'s backward reached its stage's output {len(backwards)} time(s) "
                        f"for {len(chunks)} micro-batches: every micro-batch's forward needs its own backward"), \
                    f"step {k + 1}, rank {r}: {labels}"
            first_b = next(i for i, e in enumerate(clock) if e[0] == "B")
            if any(e[0] == "F" for e in clock[first_b:]):
                return (f"in step {k + 1}, rank {r} began a backward before its last forward: GPipe runs every "
                        "micro-batch's forward, then the backwards"), f"step {k + 1}, rank {r}: {labels}"
    return "", ""


def overlap_problem(res) -> tuple[str, str]:
    """``(hint, got)`` unless, in some step, rank 1 began micro-batch 0's forward before rank 0 had finished its
    last forward (on one clock: both ranks run on this machine); ``("", "")`` when it did."""
    leads, said = [], ""
    for k, (s0, s1) in enumerate(zip(res[0]["steps"], res[1]["steps"])):
        f0 = [e for e in s0["clock"] if e[0] == "F"]
        f1 = [e for e in s1["clock"] if e[0] == "F"]
        if not f0 or not f1:
            return "not judged: a rank's stage ran no forward", f"step {k + 1}: no forward"
        leads.append(f0[-1][3] - f1[0][2])
        if not said:
            said = _who_held_back(f0, f1)
    if max(leads) > 0:
        return "", ""
    return ("rank 1 began its first forward only after rank 0 had finished its last one, so the two stages never "
            "computed at the same time and the step takes as long as on one device" + (f": {said}" if said else "")
            + "; a pipelined step has rank 1 working on early micro-batches while rank 0 computes later ones"), \
        f"rank 1's first forward began {-1e3 * max(leads):.0f} ms after rank 0's last forward ended"


def _who_held_back(f0, f1) -> str:
    """Which rank made the stages take turns, from what each had sent or posted when its forwards began."""
    if len(f0) > 1 and f0[-1][5] == 0:
        return f"rank 0 had sent nothing when it began its last forward (micro-batch {len(f0) - 1})"
    if len(f1) > 1 and f1[0][5] >= len(f1):
        return f"rank 1 had asked for all {len(f1)} micro-batches' activations before its first forward began"
    return ""
