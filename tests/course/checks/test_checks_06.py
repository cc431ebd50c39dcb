"""Checkers of lesson 06 against right answers, a stub, and the wrong answers they exist for.

Every answer runs through ``check()`` for real, in fresh processes.
"""
from __future__ import annotations

import numbers

import pytest
import torch
from torch import nn

from mgpu_lab.course.checks import check, exercises

pytestmark = pytest.mark.timeout(300)


# -- right answers (as in solutions/06_model_parallel.ipynb) -----------------------------
class TwoStageNet(nn.Module):
    def __init__(self, stage1, stage2, dev1, dev2):
        super().__init__()
        self.dev1, self.dev2 = dev1, dev2
        self.stage1 = stage1.to(dev1)
        self.stage2 = stage2.to(dev2)

    def forward(self, x):
        h = self.stage1(x.to(self.dev1))
        return self.stage2(h.to(self.dev2))


class TwoStageNetCallerMovesInputs(TwoStageNet):  # also right: the caller puts x on dev1
    def forward(self, x):
        return self.stage2(self.stage1(x).to(self.dev2))


class TwoStageNetParameterDevices(TwoStageNet):  # also right: moves to where the parameters are
    def forward(self, x):
        h = self.stage1(x.to(next(self.stage1.parameters()).device))
        return self.stage2(h.to(next(self.stage2.parameters()).device))


class OutputToCPU(TwoStageNet):
    def forward(self, x):
        return super().forward(x).cpu()


def pipelined_step(stage1, stage2, x, y, loss_fn, n_micro):
    dev1, dev2 = next(stage1.parameters()).device, next(stage2.parameters()).device
    total = 0.0
    for xs, ys in zip(torch.chunk(x, n_micro), torch.chunk(y, n_micro)):
        out = stage2(stage1(xs.to(dev1)).to(dev2))
        total = total + loss_fn(out, ys.to(out.device)) * len(xs) / len(x)
    total.backward()
    return total.item()


def pipelined_step_backward_each(stage1, stage2, x, y, loss_fn, n_micro):  # also right
    total = 0.0
    for xs, ys in zip(torch.tensor_split(x, n_micro), torch.tensor_split(y, n_micro)):
        loss = loss_fn(stage2(stage1(xs)), ys) * (len(xs) / len(x))
        loss.backward()
        total += loss.item()
    return total


def bubble_fraction(n_stages, n_micro):
    for name, value in (("n_stages", n_stages), ("n_micro", n_micro)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    return (n_stages - 1) / (n_micro + n_stages - 1)


def stub(*args, **kwargs):
    raise NotImplementedError("write this")


class StubNet(nn.Module):
    def __init__(self, stage1, stage2, dev1, dev2):
        raise NotImplementedError("write this")


# -- wrong answers: TwoStageNet -----------------------------------------------------------
class PlainList:  # not a Module
    def __init__(self, stage1, stage2, dev1, dev2):
        self.stages = [stage1, stage2]

    def __call__(self, x):
        return self.stages[1](self.stages[0](x))


class StagesInAList(nn.Module):  # a plain list hides the parameters from model.parameters()
    def __init__(self, stage1, stage2, dev1, dev2):
        super().__init__()
        self.stages, self.dev2 = [stage1.to(dev1), stage2.to(dev2)], dev2

    def forward(self, x):
        return self.stages[1](self.stages[0](x).to(self.dev2))


class ForgetsTheMove(TwoStageNet):
    def forward(self, x):
        return self.stage2(self.stage1(x))


class ThrowsTheMoveAway(TwoStageNet):
    def forward(self, x):
        h = self.stage1(x)
        h.to(self.dev2)
        return self.stage2(h)


class Detaches(TwoStageNet):
    def forward(self, x):
        return self.stage2(self.stage1(x).detach().to(self.dev2))


class SwapsDevices(TwoStageNet):
    def __init__(self, stage1, stage2, dev1, dev2):
        super().__init__(stage1, stage2, dev2, dev1)


class NeverPlaces(nn.Module):
    def __init__(self, stage1, stage2, dev1, dev2):
        super().__init__()
        self.stage1, self.stage2, self.dev2 = stage1, stage2, dev2

    def forward(self, x):
        return self.stage2(self.stage1(x).to(self.dev2))


class OutputBackToDev1(TwoStageNet):
    def forward(self, x):
        return super().forward(x).to(self.dev1)


# -- wrong answers: pipelined_step ----------------------------------------------------------
def unscaled(stage1, stage2, x, y, loss_fn, n_micro):
    total = 0.0
    for xs, ys in zip(torch.chunk(x, n_micro), torch.chunk(y, n_micro)):
        loss = loss_fn(stage2(stage1(xs)), ys)
        loss.backward()
        total += loss.item() / n_micro
    return total


def zero_grad_inside(stage1, stage2, x, y, loss_fn, n_micro):
    total = 0.0
    for xs, ys in zip(torch.chunk(x, n_micro), torch.chunk(y, n_micro)):
        stage1.zero_grad()
        stage2.zero_grad()
        loss = loss_fn(stage2(stage1(xs)), ys) * len(xs) / len(x)
        loss.backward()
        total += loss.item()
    return total


def one_over_n_micro(stage1, stage2, x, y, loss_fn, n_micro):  # right only when n_micro divides the batch
    total = 0.0
    for xs, ys in zip(torch.chunk(x, n_micro), torch.chunk(y, n_micro)):
        loss = loss_fn(stage2(stage1(xs)), ys) / n_micro
        loss.backward()
        total += loss.item()
    return total


def drops_the_rest(stage1, stage2, x, y, loss_fn, n_micro):
    size = len(x) // n_micro
    total = 0.0
    for i in range(n_micro):
        xs, ys = x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]
        loss = loss_fn(stage2(stage1(xs)), ys) / n_micro
        loss.backward()
        total += loss.item()
    return total


def whole_batch(stage1, stage2, x, y, loss_fn, n_micro):
    loss = loss_fn(stage2(stage1(x)), y)
    loss.backward()
    return loss.item()


def returns_tensor(stage1, stage2, x, y, loss_fn, n_micro):
    pipelined_step(stage1, stage2, x, y, loss_fn, n_micro)
    return loss_fn(stage2(stage1(x)), y).detach()


def returns_sum(stage1, stage2, x, y, loss_fn, n_micro):
    return pipelined_step(stage1, stage2, x, y, loss_fn, n_micro) * n_micro


# -- wrong answers: bubble_fraction ---------------------------------------------------------
def no_checks(n_stages, n_micro):
    return (n_stages - 1) / (n_micro + n_stages - 1)


def bools_pass(n_stages, n_micro):
    if n_stages < 1 or n_micro < 1:
        raise ValueError("must be >= 1")
    return (n_stages - 1) / (n_micro + n_stages - 1)


def type_error(n_stages, n_micro):
    if not isinstance(n_stages, int) or not isinstance(n_micro, int) or isinstance(n_stages, bool) \
            or isinstance(n_micro, bool):
        raise TypeError("ints only")
    return bubble_fraction(n_stages, n_micro)


def ratio_wrong(n_stages, n_micro):
    bubble_fraction(n_stages, n_micro)
    return (n_stages - 1) / (n_micro * n_stages)


def integer_division(n_stages, n_micro):
    bubble_fraction(n_stages, n_micro)
    return (n_stages - 1) // (n_micro + n_stages - 1)


def failed(result) -> list[str]:
    return [c.name for c in result.cases if not c.passed]


def hint_of(result, fragment: str) -> str:
    return next(c.hint for c in result.cases if fragment in c.name and not c.passed)


# -- tests ------------------------------------------------------------------------------------
def test_the_lesson_registers_three_exercises_with_one_point_per_case():
    listed = {e.id: e.points for e in exercises("06")}
    assert listed == {"06.TwoStageNet": 8, "06.pipelined_step": 7, "06.bubble_fraction": 7}


@pytest.mark.parametrize("answer", [TwoStageNet, TwoStageNetCallerMovesInputs, TwoStageNetParameterDevices])
def test_two_stage_net_right_answers_get_full_marks(answer):
    r = check("06.TwoStageNet", answer)
    assert (r.points, r.max_points, r.status) == (8, 8, "passed"), str(r)


def test_two_stage_net_stub_is_not_attempted():
    assert check("06.TwoStageNet", StubNet).status == "not attempted"


@pytest.mark.parametrize("answer, case, hint", [
    (PlainList, "is an nn.Module", "subclass nn.Module"),
    (StagesInAList, "is an nn.Module", "self.stage1 = ..."),
    (ForgetsTheMove, "moves the activations", "Expected all tensors to be on the same device"),
    (ThrowsTheMoveAway, "moves the activations", "pass the copy to stage2"),
    (Detaches, "backward gives both stages", "do not detach"),
    (SwapsDevices, "puts stage1 on dev1", "self.stage1 = stage1.to(dev1)"),
    (NeverPlaces, "puts stage2 on dev2", "self.stage2 = stage2.to(dev2)"),
    (OutputBackToDev1, "returns the output of stage2", "the loss belongs on dev2"),
    (OutputToCPU, "returns the output of stage2", "the loss belongs on dev2"),
])
def test_two_stage_net_wrong_answers_fail_their_case(answer, case, hint):
    r = check("06.TwoStageNet", answer)
    assert r.status == "failed"
    assert any(case in name for name in failed(r)), str(r)
    assert hint in hint_of(r, case), str(r)


@pytest.mark.parametrize("answer", [pipelined_step, pipelined_step_backward_each])
def test_pipelined_step_right_answers_get_full_marks(answer):
    r = check("06.pipelined_step", answer)
    assert (r.points, r.max_points, r.status) == (7, 7, "passed"), str(r)


def test_pipelined_step_stub_is_not_attempted():
    assert check("06.pipelined_step", stub).status == "not attempted"


@pytest.mark.parametrize("answer, case, hint", [
    (unscaled, "the gradients equal", "n_micro times too big"),
    (zero_grad_inside, "the gradients equal", "never inside the micro-batch loop"),
    (one_over_n_micro, "batch 10, n_micro=4", "1/n_micro is the wrong weight"),
    (drops_the_rest, "batch 10, n_micro=4", "samples were left out"),
    (whole_batch, "see 4 micro-batches", "run the stages on each micro-batch in turn"),
    (returns_tensor, "as a Python float", "not a tensor"),
    (returns_sum, "as a Python float", "weighted by len(x_i)/len(x)"),
])
def test_pipelined_step_wrong_answers_fail_their_case(answer, case, hint):
    r = check("06.pipelined_step", answer)
    assert r.status == "failed"
    assert any(case in name for name in failed(r)), str(r)
    assert hint in hint_of(r, case), str(r)


def test_pipelined_step_one_over_n_passes_even_splits_and_fails_the_hidden_uneven_ones():
    r = check("06.pipelined_step", one_over_n_micro)
    assert failed(r) == ["batch 10, n_micro=4 (torch.chunk: 3, 3, 3, 1): the gradients of the whole batch",
                         "batch 6, n_micro=4", "batch 7, n_micro=3, MSELoss"], str(r)
    assert "1/n_micro is the wrong weight" in hint_of(r, "batch 10")


def test_bubble_fraction_right_answer_gets_full_marks():
    r = check("06.bubble_fraction", bubble_fraction)
    assert (r.points, r.max_points, r.status) == (7, 7, "passed"), str(r)


def test_bubble_fraction_stub_is_not_attempted():
    assert check("06.bubble_fraction", stub).status == "not attempted"


@pytest.mark.parametrize("answer, case, hint", [
    (no_checks, "zero or negative", "raise ValueError"),
    (bools_pass, "bools and non-integers", "reject bools explicitly"),
    (type_error, "bools and non-integers", "with ValueError"),
    (ratio_wrong, "bubble_fraction(2, 4) is 0.2", "(n_stages - 1) / (n_micro + n_stages - 1)"),
    (integer_division, "bubble_fraction(2, 1) is 0.5", "return a float"),
])
def test_bubble_fraction_wrong_answers_fail_their_case(answer, case, hint):
    r = check("06.bubble_fraction", answer)
    assert r.status == "failed"
    assert any(case in name for name in failed(r)), str(r)
    assert hint in (hint_of(r, case) + " " + str(r)), str(r)
