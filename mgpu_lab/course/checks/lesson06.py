"""Checks of lesson 06 (model parallelism): TwoStageNet, pipelined_step, bubble_fraction.

Placement is judged on a CPU-only machine by giving the learner two names of
the CPU, ``cpu:0`` as ``dev1`` and ``cpu:1`` as ``dev2``: the stages record the
device of every ``.to``, and the activations and output are tensors that record
where they were moved (and whether the moved copy is the one used), so "forgot
to move the activations" fails here as it would fail on two GPUs. What runs
in that process is :mod:`.probes06`; this module judges, in the kernel.
"""
from __future__ import annotations

from ._core import exercise
from .probes06 import evaluate, run_pipelined, run_two_stage


# -- TwoStageNet --------------------------------------------------------------------
# A move to "cpu" is what .to(next(stage.parameters()).device) records here (parameters
# report plain "cpu" on cpu:0 and cpu:1 alike), right on GPUs: accept it for either device.
_ON = {"cpu:0": {"cpu:0", "cpu"}, "cpu:1": {"cpu:1", "cpu"}}


def _placed(log, name):
    return [dev for who, what, dev in log if who == name and what == "to"]


@exercise("06.TwoStageNet", points=8, description="TwoStageNet(stage1, stage2, dev1, dev2): each stage on its "
          "device, activations moved to dev2 in forward, output on dev2; same outputs and gradients as unsplit")
def _two_stage(t, TwoStageNet):
    got = None
    with t.case("is an nn.Module whose parameters are both stages' parameters",
                hint="subclass nn.Module, call super().__init__() first, and keep the stages as attributes "
                     "(self.stage1 = ...), so that model.parameters() and the optimizer see both"):
        got = t.call(run_two_stage, TwoStageNet)
        if not got["module"]:
            t.fail("", "an nn.Module", f"a {got['type']}")
        t.equal(got["n_params"], got["n_expected"])
    with t.case("forward gives the same output as the unsplit model nn.Sequential(stage1, stage2)",
                hint="forward is stage2(stage1(x)) with a move in between; return the output of stage2"):
        if got is None or not got["module"]:
            t.fail("the first case did not finish")
        if got["output_type"] != "Tensor":
            t.fail("forward must return the output tensor", "a Tensor", got["output_type"])
        t.equal(got["same_output"], True)
    with t.case("backward gives both stages the same gradients as the unsplit model",
                hint="do not detach the activations or wrap forward in torch.no_grad(): .to(dev2) keeps the "
                     "graph, so the gradient flows back to stage1"):
        if got is None or not got.get("same_output"):
            t.fail("needs the same output first")
        t.equal(got["same_grads"], True)
    for name, dev, hint in (
            ("stage1", "cpu:0", "move stage1 to dev1 in __init__: self.stage1 = stage1.to(dev1)"),
            ("stage2", "cpu:1", "move stage2 to dev2 in __init__: self.stage2 = stage2.to(dev2)")):
        with t.case(f"puts {name} on {'dev1' if name == 'stage1' else 'dev2'} (given {dev}: a name of the CPU "
                    "the check can tell apart)", hint=hint):
            if got is None or "stage_log" not in got:
                t.fail("the first cases did not finish")
            placed = _placed(got["stage_log"], name)
            if not placed or placed[-1] != dev:
                t.fail("", f"{name}.to({dev})", f"moves of {name}: {placed or 'none'}")
    with t.case("moves the activations to dev2 before stage2, and gives stage2 the moved copy",
                hint="h = self.stage1(x); return self.stage2(h.to(self.dev2)): on two GPUs, stage2 on cuda:1 "
                     "given a tensor on cuda:0 fails with 'Expected all tensors to be on the same device'"):
        if got is None or "moves" not in got:
            t.fail("the first cases did not finish")
        moved = [dev for tag, dev in got["moves"] if tag == "activations"]
        unmoved = ("stage2", "input", "activations") in got["stage_log"]
        wrong_inputs = [dev for tag, dev in got["moves"] if tag == "inputs" and dev not in _ON["cpu:0"]]
        if wrong_inputs:
            t.fail("the input x belongs on dev1, where stage1 is", "x.to(cpu:0) or no move", f"x.to({wrong_inputs[0]})")
        if not set(moved) & _ON["cpu:1"]:
            t.fail("", "activations.to(cpu:1)", f"moves of the activations: {moved or 'none'}")
        if unmoved:
            t.fail(".to() returns a moved copy and leaves the tensor where it was: pass the copy to stage2",
                   "stage2 gets the moved activations", "stage2 got the activations as stage1 made them")
    with t.case("returns the output of stage2 where it is, on dev2",
                hint="return stage2's output as it is: moving it (.to(dev1), .cpu()) costs a copy, and the loss "
                     "belongs on dev2, with the labels moved there"):
        if got is None or "moves" not in got:
            t.fail("the first cases did not finish")
        away = [dev for tag, dev in got["moves"] if tag == "output" and dev not in _ON["cpu:1"]]
        if away:
            t.fail("", "the output left on cpu:1", f"output moved to {away[0]}")
    with t.case("conv stages, devices passed as strings ('cpu:0', 'cpu:1')", hidden=True):
        again = t.call(run_two_stage, TwoStageNet, True, True)
        if not (again.get("same_grads") and _placed(again["stage_log"], "stage2")[-1:] == ["cpu:1"]
                and _placed(again["stage_log"], "stage1")[-1:] == ["cpu:0"]
                and set(dev for tag, dev in again["moves"] if tag == "activations") & _ON["cpu:1"]):
            t.fail("conv stages with string devices differ")


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
}
STEP_HINT = ("split with torch.chunk(x, n_micro) and torch.chunk(y, n_micro); loss_i = loss_fn(out_i, y_i) * "
             "len(x_i) / len(x); backward the sum (or each); return the sum of the weighted losses as a float")


def _judge_grads(t, got):
    if got is None:
        t.fail("the first case did not finish")
    if not got["same"]:
        t.fail(_BUGS.get(got["bug"], ""), "the gradients of one full-batch step",
               "different gradients" + (f" ({got['bug']})" if got["bug"] else ""))


@exercise("06.pipelined_step", points=7, description="pipelined_step(stage1, stage2, x, y, loss_fn, n_micro): "
          "forward and backward over n_micro micro-batches; gradients of the full batch; returns the mean loss")
def _pipelined(t, pipelined_step):
    got = None
    with t.case("batch 8, n_micro=4: returns the batch's mean loss as a Python float",
                hint="return the sum of the micro-batch losses weighted by len(x_i)/len(x), as float(...) or .item()"):
        got = t.call(run_pipelined, pipelined_step, 8, 4)
        if got["type"] != "float":
            t.fail("return a Python float (loss.item()), not a tensor", "float", got["type"])
        t.close(got["loss"], got["ref_loss"])
    with t.case("batch 8, n_micro=4: the gradients equal those of one step on the whole batch", hint=STEP_HINT):
        _judge_grads(t, got)
    with t.case("batch 8, n_micro=4: both stages see 4 micro-batches of 2",
                hint="run the stages on each micro-batch in turn, and no extra pass over the whole batch: "
                     "the mean loss is the sum of the weighted micro-batch losses"):
        if got is None:
            t.fail("the first case did not finish")
        t.equal(got["sizes"], {"stage1": [2, 2, 2, 2], "stage2": [2, 2, 2, 2]})
    with t.case("n_micro=1 is the plain step", hint=STEP_HINT):
        one = t.call(run_pipelined, pipelined_step, 8, 1)
        _judge_grads(t, one)
        t.close(one["loss"], one["ref_loss"])
    with t.case("batch 10, n_micro=4 (torch.chunk: 3, 3, 3, 1): the gradients of the whole batch",
                hint="weight each micro-batch by its size, len(x_i) / len(x), not 1/n_micro; do not drop the rest"):
        uneven = t.call(run_pipelined, pipelined_step, 10, 4)
        _judge_grads(t, uneven)
        t.close(uneven["loss"], uneven["ref_loss"])
    for batch, n_micro, regression in ((6, 4, False), (7, 3, True)):
        with t.case(f"batch {batch}, n_micro={n_micro}" + (", MSELoss" if regression else ""), hidden=True):
            other = t.call(run_pipelined, pipelined_step, batch, n_micro, regression)
            _judge_grads(t, other)
            t.close(other["loss"], other["ref_loss"])
            if sum(other["sizes"]["stage1"]) != batch or len(other["sizes"]["stage1"]) < 2:
                t.fail("not micro-batched")


# -- bubble_fraction ----------------------------------------------------------------
_VALUES = [((2, 1), 0.5), ((2, 4), 0.2), ((4, 8), 3 / 11), ((1, 8), 0.0)]
_GRID = [((p, m), (p - 1) / (m + p - 1)) for p in (1, 2, 3, 5, 8, 16) for m in (1, 2, 3, 7, 32, 100)]
_BAD_SIGN = [(0, 4), (2, 0), (-1, 4), (2, -3)]
_BAD_TYPE = [(True, 4), (2, False), (2.0, 4), (2, 4.5), ("2", 4), (None, 4)]
FORMULA = "(n_stages - 1) / (n_micro + n_stages - 1)"


@exercise("06.bubble_fraction", points=7, description="bubble_fraction(n_stages, n_micro): GPipe's idle "
          "fraction (p-1)/(m+p-1); ValueError for anything but whole numbers >= 1")
def _bubble(t, bubble_fraction):
    calls = [a for a, _ in _VALUES] + [a for a, _ in _GRID] + _BAD_SIGN + _BAD_TYPE
    results = _Results()
    names = ["bubble_fraction(2, 1) is 0.5: with one micro-batch each of 2 stages idles half the time",
             "bubble_fraction(2, 4) is 0.2", "bubble_fraction(4, 8) is 3/11",
             "bubble_fraction(1, 8) is 0.0: one stage never waits"]
    for name, (args, expected) in zip(names, _VALUES):
        with t.case(name, hint=f"compute {FORMULA} and return it as a float"):
            if not results:
                results.extend(zip(calls, t.call(evaluate, bubble_fraction, calls)))
            _judge_value(t, results[args], expected)
    with t.case("raises ValueError for zero or negative n_stages or n_micro",
                hint="check both arguments are >= 1 first: raise ValueError(f'n_micro={n_micro} must be >= 1')"):
        _judge_raises(t, results, _BAD_SIGN)
    with t.case("raises ValueError for bools and non-integers (True, 2.0, 4.5, '2', None)",
                hint="isinstance(True, int) is True: reject bools explicitly, and anything that is not an int, "
                     "with ValueError"):
        _judge_raises(t, results, _BAD_TYPE)
    with t.case("36 more (n_stages, n_micro) pairs, each a float", hidden=True):
        if not results:
            t.fail("the first case did not finish")
        for args, expected in _GRID:
            _judge_value(t, results[args], expected)


class _Results(list):
    """``(args, result)`` pairs looked up by identity of types: (2.0, 4) == (2, 4) as dict keys."""

    def __getitem__(self, args):
        return next(r for a, r in self if a == args and list(map(type, a)) == list(map(type, args)))


def _judge_value(t, got, expected) -> None:
    if got[0] != "ok":
        t.fail("", repr(expected), _show(got))
    if not got[2]:
        t.fail("return a float: in Python 3, / divides as floats", repr(expected), _show(got))
    t.close(got[1], expected, atol=1e-12, rtol=1e-12)


def _judge_raises(t, results, calls) -> None:
    if not results:
        t.fail("the first case did not finish")
    for args in calls:
        if results[args][:2] != ("raised", "ValueError"):
            t.fail("", f"bubble_fraction{args!r} raises ValueError", _show(results[args]))


def _show(result) -> str:
    return f"raised {result[1]}: {result[2]}" if result[0] == "raised" else f"returned {result[1]!r}"
