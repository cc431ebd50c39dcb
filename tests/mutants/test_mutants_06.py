"""Lesson 06's checks against named wrong answers made from the solution, and correct variants.

Every mutant is a solution cell of ``solutions/06_model_parallel.ipynb`` with one
learner bug put in; its check must fail with a message that names the bug. Most
of them are bugs that change no number on a CPU (a tensor left on the wrong
device): the checks see them through the virtual GPUs of
``mgpu_lab/course/checks/sim/devices.py``. Every variant is a correct answer
written differently; it must get full marks.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mutation import ExerciseMutants, Mutant, Variant, drop_statement, mutant_tests, replace, sub

pytestmark = pytest.mark.timeout(300)
NOTEBOOK = "06_model_parallel.ipynb"
NAMESPACE = {"torch": torch, "nn": nn}

TWO_STAGE = ExerciseMutants("06.TwoStageNet", NOTEBOOK, ("TwoStageNet",), mutants=[
    Mutant("input never moved to dev1", replace("self.stage1(x.to(self.dev1))", "self.stage1(x)"),
           ("x reached stage1 on cpu", "never moved")),
    Mutant("input moved to a hard-coded 'cpu'", replace("x.to(self.dev1)", 'x.to("cpu")'),
           ("x reached stage1 on cpu", "not to a fixed device")),
    Mutant("activations never moved to dev2", replace("self.stage2(h.to(self.dev2))", "self.stage2(h)"),
           ("activations reached stage2", "h.to(self.dev2)")),
    Mutant("the moved activations thrown away",
           replace("        return self.stage2(h.to(self.dev2))",
                   "        h.to(self.dev2)\n        return self.stage2(h)"),
           ".to() returns a moved copy"),
    Mutant("activations detached", replace("h.to(self.dev2)", "h.detach().to(self.dev2)"), "do not detach"),
    Mutant("stages on each other's device",
           (replace("stage1.to(dev1)", "stage1.to(dev2)"), replace("stage2.to(dev2)", "stage2.to(dev1)")),
           ("stage1 is on cuda:3", "not on cuda:2")),
    Mutant("stage2 never placed", replace("self.stage2 = stage2.to(dev2)", "self.stage2 = stage2"),
           ("stage2 is on cpu", "never moved")),
    Mutant("stage2 moved to the activations in forward",
           replace("        return self.stage2(h.to(self.dev2))",
                   "        self.stage2.to(h.device)\n        return self.stage2(h)"),
           ("forward moved stage2 to cuda:2", "place the stages once")),
    Mutant("output brought back to the CPU",
           replace("return self.stage2(h.to(self.dev2))", "return self.stage2(h.to(self.dev2)).cpu()"),
           ("output moved to cpu", "the loss belongs on dev2")),
    Mutant("hard-coded cuda:0 and cuda:1",
           (replace("stage1.to(dev1)", 'stage1.to("cuda:0")'), replace("stage2.to(dev2)", 'stage2.to("cuda:1")'),
            replace("self.dev1, self.dev2 = dev1, dev2", 'self.dev1, self.dev2 = "cuda:0", "cuda:1"')),
           ("stage1 is on cuda:0", "not on cuda:2")),
    Mutant("stages kept in a plain list",
           (replace("self.stage1 = stage1.to(dev1)\n        self.stage2 = stage2.to(dev2)",
                    "self.stages = [stage1.to(dev1), stage2.to(dev2)]"),
            replace("self.stage1(", "self.stages[0]("), replace("self.stage2(", "self.stages[1](")),
           "model.parameters() and the optimizer see both"),
    Mutant("no super().__init__()", drop_statement("super().__init__()"),
           ("call super().__init__() first", "before module.__init__() call")),
], variants=[
    Variant("devices read from the parameters", '''
class TwoStageNet(nn.Module):
    def __init__(self, stage1, stage2, dev1, dev2):
        super().__init__()
        self.stage1 = stage1.to(dev1)
        self.stage2 = stage2.to(dev2)

    def forward(self, x):
        h = self.stage1(x.to(next(self.stage1.parameters()).device))
        return self.stage2(h.to(next(self.stage2.parameters()).device))
'''),
    Variant("a ModuleList walked in a loop, non_blocking moves", '''
class TwoStageNet(nn.Module):
    def __init__(self, stage1, stage2, dev1, dev2):
        super().__init__()
        self.devices = [torch.device(dev1), torch.device(dev2)]
        self.stages = nn.ModuleList([stage1.to(self.devices[0]), stage2.to(self.devices[1])])

    def forward(self, x):
        for stage, device in zip(self.stages, self.devices):
            x = stage(x.to(device, non_blocking=True))
        return x
'''),
])

PIPELINED = ExerciseMutants("06.pipelined_step", NOTEBOOK, ("pipelined_step",), mutants=[
    Mutant("micro-batches never moved to stage1's device", replace("stage1(xs.to(d1))", "stage1(xs)"),
           ("a micro-batch reached stage1 on cpu", "xs.to(d1)")),
    Mutant("activations never moved to stage2's device", replace("stage1(xs.to(d1)).to(d2)", "stage1(xs.to(d1))"),
           ("the activations reached stage2 on cuda:2", "h.to(d2)")),
    Mutant("labels left on the CPU", replace("ys.to(out.device)", "ys"),
           ("the labels reached the loss on cpu", "ys.to(out.device)")),
    Mutant("devices hard-coded as 'cpu'",
           replace("d1, d2 = next(stage1.parameters()).device, next(stage2.parameters()).device",
                   'd1, d2 = torch.device("cpu"), torch.device("cpu")'),
           ("reached stage1 on cpu", "next(stage1.parameters()).device")),
    Mutant("a stage moved inside the step", sub(r"^(\s+)total = 0\.0$", r"\1stage2.to(d1)\n\1total = 0.0"),
           ("moved a stage", "already on their devices")),
    Mutant("unweighted micro-batch losses", replace(" * (len(xs) / len(x))", ""), "n_micro times too big"),
    Mutant("weight 1/n_micro for every chunk", replace("(len(xs) / len(x))", "(1 / n_micro)"),
           "1/n_micro is the wrong weight"),
    Mutant("zero_grad inside the micro-batch loop",
           (sub(r"^(\s+)total = total \+ (.*)$", r"\1stage1.zero_grad()\n\1stage2.zero_grad()\n\1loss = \2\n"
                r"\1loss.backward()\n\1total = total + loss.detach()"), drop_statement("total.backward()")),
           "only the last micro-batch's gradient is left"),
    Mutant("zero_grad at the start (the caller's job)",
           sub(r"^(\s+)total = 0\.0$", r"\1stage1.zero_grad()\n\1stage2.zero_grad()\n\1total = 0.0"),
           ("the gradients .grad held before the step are gone", "never call zero_grad")),
    Mutant("activations detached", replace(".to(d2))", ".detach().to(d2))"), ("stage1 got no gradient", "detach")),
    Mutant("torch.split for torch.chunk", replace("torch.chunk", "torch.split", count=0),
           ("both stages see 4 micro-batches of 2", "torch.split(x, n) cuts pieces of n rows")),
    Mutant("remainder dropped",
           replace("for xs, ys in zip(torch.chunk(x, n_micro), torch.chunk(y, n_micro)):",
                   "size = len(x) // n_micro\n    for i in range(n_micro):\n"
                   "        xs, ys = x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]"),
           "samples were left out"),
    Mutant("returns the loss tensor", replace("return total.item()", "return total"), ("float", "not a tensor")),
], variants=[
    Variant("backward after each micro-batch, tensor_split, a float sum", '''
def pipelined_step(stage1, stage2, x, y, loss_fn, n_micro):
    dev1 = next(stage1.parameters()).device
    dev2 = next(stage2.parameters()).device
    total = 0.0
    for xs, ys in zip(torch.tensor_split(x, n_micro), torch.tensor_split(y, n_micro)):
        if len(xs) == 0:
            continue
        out = stage2(stage1(xs.to(dev1, non_blocking=True)).to(dev2, non_blocking=True))
        loss = loss_fn(out, ys.to(dev2)) * (xs.shape[0] / x.shape[0])
        loss.backward()
        total += loss.item()
    return total
'''),
    Variant("GPipe's two phases: every forward, then one backward of the stacked losses", '''
def pipelined_step(stage1, stage2, x, y, loss_fn, n_micro):
    devices = [next(s.parameters()).device for s in (stage1, stage2)]
    x, y = x.to(devices[0]), y.to(devices[1])  # the whole batch moved once, then cut
    losses = []
    for xs, ys in zip(x.chunk(n_micro), y.chunk(n_micro)):
        losses.append(loss_fn(stage2(stage1(xs).to(devices[1])), ys) * len(xs) / len(x))
    loss = torch.stack(losses).sum()
    loss.backward()
    return float(loss)
'''),
])

BUBBLE = ExerciseMutants("06.bubble_fraction", NOTEBOOK, ("bubble_fraction",), mutants=[
    Mutant("stages and micro-batches swapped in the numerator",
           replace("return (n_stages - 1) / (n_micro + n_stages - 1)",
                   "return (n_micro - 1) / (n_micro + n_stages - 1)"),
           "(n_stages - 1) / (n_micro + n_stages - 1)"),
    Mutant("off by one in the denominator", replace("(n_micro + n_stages - 1)", "(n_micro + n_stages)"),
           ("bubble_fraction(2, 1) is 0.5", "p - 1 slots to fill the pipe")),
    Mutant("// for /", replace("1) / (n_micro", "1) // (n_micro"), ("// rounds down to 0", "return a float")),
    Mutant("a percentage", replace("return (n_stages", "return 100 * (n_stages"), "not a percentage"),
    Mutant("no validation", drop_statement("raise ValueError"), ("raises valueerror for zero or negative",)),
    Mutant("bools accepted", replace("isinstance(value, bool) or ", ""), "reject bools explicitly"),
    Mutant("zero allowed (value < 0)", replace("value < 1", "value < 0"), ("bubble_fraction(0, 4) raises valueerror",)),
    Mutant("one micro-batch rejected (value <= 1)", replace("value < 1", "value <= 1"),
           "one micro-batch (n_micro=1) are allowed"),
    Mutant("TypeError instead of ValueError", replace("raise ValueError", "raise TypeError"),
           ("raises valueerror", "raised typeerror")),
], variants=[
    Variant("one minus the busy share, numbers.Integral", '''
import numbers

def bubble_fraction(n_stages, n_micro):
    for name, value in {"n_stages": n_stages, "n_micro": n_micro}.items():
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise ValueError(f"{name} must be a whole number, got {value!r}")
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    return 1 - n_micro / (n_micro + n_stages - 1)
'''),
    Variant("fill-and-drain slots over all slots, type() is int", '''
def bubble_fraction(n_stages, n_micro):
    if not all(type(v) is int and v >= 1 for v in (n_stages, n_micro)):
        raise ValueError(f"n_stages and n_micro must be ints >= 1, got {n_stages!r}, {n_micro!r}")
    fill = n_stages - 1
    return float(fill) / (n_micro + fill)
'''),
])

SPECS = [TWO_STAGE, PIPELINED, BUBBLE]


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "06", NAMESPACE)
