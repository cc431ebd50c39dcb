"""Lesson 06's placement verdicts: the evidence of the virtual GPUs (:mod:`..sim.devices`), in words.

:mod:`.checkers` asks these for the cases about devices: where each stage was
put, and on which device each input, activation and label reached what used it.
Each names the bug as it shows on two GPUs.
"""
from __future__ import annotations

from ..sim.outcome import in_words


# -- pipelined_step -----------------------------------------------------------------
_BUGS = {
    "unscaled": "the gradients are the sum of the micro-batch gradients, n_micro times too big: scale each "
                "micro-batch's loss by len(micro-batch) / len(x) (1/n_micro when they are equal) before backward",
    "one_over_n": "with uneven micro-batches, 1/n_micro is the wrong weight (and torch.chunk may give fewer than "
                  "n_micro pieces): weight each micro-batch's mean loss by len(micro-batch) / len(x)",
    "last_only": "only the last micro-batch's gradient is left: zero the gradients once, before the step (the "
                 "caller does), never inside the micro-batch loop, so backward adds up all micro-batches",
    "dropped": "the last len(x) % n_micro samples were left out: torch.chunk(x, n_micro) keeps every sample (the "
               "last chunk is smaller), and each chunk's loss weighs len(x_i) / len(x)",
    "zeroed": "the gradients .grad held before the step are gone: the caller zeroes the gradients (and may "
              "accumulate several steps first); pipelined_step must only add to them, never call zero_grad",
    "detached": "stage1 got no gradient: the activations were cut from the graph (.detach(), .data or "
                "torch.no_grad()); h.to(dev2) keeps the graph, so backward reaches stage1",
    "no_grads": "no gradients: call backward on the (weighted) loss",
}


STEP_HINT = ("split with torch.chunk(x, n_micro) and torch.chunk(y, n_micro); loss_i = loss_fn(out_i, y_i) * "
             "len(x_i) / len(x); backward the sum (or each); return the sum of the weighted losses as a float")


FORMULA = "(n_stages - 1) / (n_micro + n_stages - 1)"


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
        t.fail(f"bubble_fraction{args} must not raise:{one} compute {FORMULA}", repr(expected), in_words(got))
    if not isinstance(got[1], (int, float)):
        t.fail("return the fraction, a number", repr(expected), in_words(got))
    if expected and abs(got[1] - 100 * expected) < 1e-9:
        t.fail("a fraction in [0, 1), not a percentage: drop the * 100", repr(expected), in_words(got))
    t.close(got[1], expected, atol=1e-12, rtol=1e-12)


def judge_raises(t, results, calls) -> None:
    if not results:
        t.fail("the first case did not finish")
    for args in calls:
        if results[args][:2] != ("raised", "ValueError"):
            t.fail("", f"bubble_fraction{args!r} raises ValueError", in_words(results[args]))


SAME_DEVICE = "on two GPUs this raises 'Expected all tensors to be on the same device'"


# -- TwoStageNet --------------------------------------------------------------------
def inputs_of(run, stage):
    """``(tag, device)`` of every input that ``stage`` got in one run."""
    return [(tag, dev) for name, event, *rest in run.get("stage_log", []) if name == stage and event == "input"
            for tag, dev in [rest[:2]]]


def started(t, run) -> None:
    """Fail the case when the net was not built or raised (the earlier cases say why)."""
    if "raised" in run:
        t.fail("fix the error first", "", "your code raised " + run["raised"])
    if not run.get("module"):
        t.fail("the first case did not finish")


def judge_stages(t, run) -> None:
    """Each stage on its device: ``stage1.to(dev1)``, ``stage2.to(dev2)``."""
    started(t, run)
    for name, dev in (("stage1", run["dev1"]), ("stage2", run["dev2"])):
        placed = run["placed"].get(name)
        if placed != dev:
            moves = [rest[0] for who, event, *rest in run["stage_log"] if who == name and event == "to"]
            t.fail(f"{name} is on {placed or 'no device'}, not on {dev}: "
                   + ("it was never moved" if not moves else f"it was moved to {moves[-1]}"),
                   f"{name}.to({dev})", f"moves of {name}: {moves or 'none'}")
        after = run.get("placed_after", {}).get(name, placed)
        if after != dev:
            t.fail(f"forward moved {name} to {after}: place the stages once, in __init__, and move the tensors "
                   "to them in forward", f"{name} stays on {dev}", f"{name} on {after} after forward")


def judge_input(t, run) -> None:
    """x reached stage1 on dev1."""
    started(t, run)
    seen = inputs_of(run, "stage1")
    if not seen:
        t.fail("stage1 never ran")
    wrong = [dev for _, dev in seen if dev != run["dev1"]]
    if wrong:
        how = "never moved" if not [m for m in run["moves"] if m[0] == "inputs"] else \
            "moved to " + ", ".join(sorted({m[2] for m in run["moves"] if m[0] == "inputs"}))
        t.fail(f"x reached stage1 on {wrong[0]} ({how}), but stage1 is on dev1 = {run['dev1']}: move it with "
               f"x.to(self.dev1), not to a fixed device; {SAME_DEVICE}", f"x on {run['dev1']}", f"x on {wrong[0]}")


def judge_activations(t, run) -> None:
    """The activations reached stage2 on dev2 (moved, and the moved copy used)."""
    started(t, run)
    seen = inputs_of(run, "stage2")
    if not seen:
        t.fail("stage2 never ran")
    wrong = [(tag, dev) for tag, dev in seen if dev != run["dev2"]]
    if wrong:
        moved = [m[2] for m in run["moves"] if m[0] == "activations"]
        if run["dev2"] in moved:
            t.fail(".to() returns a moved copy and leaves the tensor where it was: pass the copy to stage2",
                   "stage2 gets the moved activations", f"stage2 got the activations on {wrong[0][1]}")
        t.fail(f"the activations reached stage2 on {wrong[0][1]}, but stage2 is on dev2 = {run['dev2']}: "
               f"{SAME_DEVICE}; move them with h.to(self.dev2)", f"activations.to({run['dev2']})",
               f"moves of the activations: {moved or 'none'}")


def judge_output(t, run) -> None:
    """The output returned where stage2 made it, on dev2."""
    started(t, run)
    if run.get("output_type") != "Tensor":
        t.fail("forward must return the output tensor")
    away = [m[2] for m in run["moves"] if m[0] == "output"]
    if away or run["out_device"] != run["dev2"]:
        t.fail("", f"the output left on {run['dev2']}", f"output moved to {away[-1] if away else run['out_device']}")


# -- pipelined_step -----------------------------------------------------------------
def placement_problem(run) -> str:
    """What went to the wrong device in one run, in words ("" if nothing)."""
    d1, d2 = run["devices"]
    moved = [f"{name}.to({rest[0]})" for name, event, *rest in run["stage_log"] if event == "to"]
    if moved:
        return (f"your code moved a stage ({moved[0]}): the stages are already on their devices ({d1}, {d2}); "
                "read the devices from their parameters, next(stage1.parameters()).device, and move the tensors")
    for name, event, *rest in run["stage_log"]:
        if event == "input" and rest[1] != rest[2]:
            what = "a micro-batch" if name == "stage1" else "the activations"
            fix = "xs.to(d1) with d1 = next(stage1.parameters()).device" if name == "stage1" else \
                "h.to(d2) with d2 = next(stage2.parameters()).device"
            return f"{what} reached {name} on {rest[1]}, but {name} is on {rest[2]}: {SAME_DEVICE}; move with {fix}"
    for out_dev, labels_dev, _ in run["loss_log"]:
        if out_dev != labels_dev:
            return (f"the labels reached the loss on {labels_dev}, the output is on {out_dev}: move each "
                    f"micro-batch's labels to the output's device, ys.to(out.device)")
    return ""
