"""Checks of lesson 01 (devices): pick_device, train_step, visible_devices_env.

The GPU branches are judged on any machine: the learner's code runs in a fresh
process where ``torch.cuda`` reports a simulated number of GPUs, and tensor
moves are recorded, so "forgot to move the labels" shows on a CPU too. A batch
tensor that reaches the model or the loss unmoved (``y.to(device)`` whose result
was thrown away) is caught the same way.
"""
from __future__ import annotations

import copy
import re
import subprocess
import sys

import torch

from ._core import exercise
from ._moves import Moved
from ._moves import tag as _tag

PICK_HINT = ("return torch.device('cuda', index) (index 0 when None) if torch.cuda.is_available(), "
             "else torch.device('cpu')")
RANGE_HINT = ("check 0 <= index < torch.cuda.device_count() and otherwise "
              "raise ValueError(f'... {count} GPU(s) visible ...')")


def simulate_gpus(n: int) -> None:
    """Make ``torch.cuda`` in this process report ``n`` GPUs (no CUDA call is made)."""
    torch.cuda.is_available = lambda: n > 0
    torch.cuda.device_count = lambda: n


def _raises_naming(result, count: int) -> bool:
    """Whether ``result`` (from ``t.call(..., catch=True)``) is a ValueError naming ``count``."""
    return (result[0] == "raised" and result[1] == "ValueError"
            and re.search(rf"(?<![\d-]){count}(?!\d)", result[2]) is not None)


def _outcome(result) -> str:
    return f"{result[1]}: {result[2]}" if result[0] == "raised" else f"returned {result[1]!r}"


@exercise("01.pick_device", points=6, description="pick_device(index=None): cuda:index with GPUs, cpu without, "
          "ValueError naming the visible count for a bad index")
def _pick_device(t, pick_device):
    cases = [
        ("no GPU visible: pick_device() is cpu", 0, (), torch.device("cpu"), False,
         "with no GPU visible (torch.cuda.is_available() is False) return torch.device('cpu')"),
        ("2 GPUs visible: pick_device() is cuda:0", 2, (), torch.device("cuda", 0), False,
         "index=None means the first visible GPU: torch.device('cuda', 0)"),
        ("2 GPUs visible: pick_device(1) is cuda:1", 2, (1,), torch.device("cuda", 1), False,
         "use the index you were given: torch.device('cuda', index)"),
        ("4 GPUs visible: pick_device(3) is cuda:3", 4, (3,), torch.device("cuda", 3), True, PICK_HINT),
    ]
    for name, gpus, args, expected, hidden, hint in cases:
        with t.case(name, hidden=hidden, hint=hint):
            got = t.call(pick_device, *args, prepare=(simulate_gpus, (gpus,)))
            if not isinstance(got, torch.device):
                t.fail(f"return a torch.device, not a {type(got).__name__}: {PICK_HINT}",
                       repr(expected), repr(got))
            t.equal(got, expected)
    with t.case("2 GPUs visible: pick_device(2) and pick_device(-1) raise ValueError naming the count (2)",
                hint=RANGE_HINT):
        for index in (2, -1):
            got = t.call(pick_device, index, prepare=(simulate_gpus, (2,)), catch=True)
            if not _raises_naming(got, 2):
                t.fail(f"pick_device({index}) with 2 GPUs: valid indices are 0 and 1, so raise ValueError "
                       "and say how many GPUs are visible (2); " + RANGE_HINT,
                       "ValueError mentioning 2", _outcome(got))
    with t.case("no GPU visible: pick_device(0) raises ValueError naming the count (0)", hidden=True,
                hint=RANGE_HINT):
        got = t.call(pick_device, 0, prepare=(simulate_gpus, (0,)), catch=True)
        if not _raises_naming(got, 0):
            t.fail("", "ValueError mentioning 0", _outcome(got))


# -- train_step ------------------------------------------------------------------
def _reference_step(model, x, y, optimizer, loss_fn):
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def _first(args, kwargs, position, name):
    return args[position] if len(args) > position else kwargs.get(name)


def run_train_step(train_step, regression: bool, steps: int) -> dict:
    """Run the learner's train_step next to a reference, in a fresh process.

    Returns what the check judges: the losses and their types, the reference
    losses, every ``.to``/``.cuda`` move of the batch, which batch tensors
    reached the model or the loss *unmoved* (a ``y.to(device)`` whose result
    was thrown away), and whether the weights match the reference.
    """
    torch.manual_seed(0)
    if regression:
        model, loss_fn = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)), torch.nn.MSELoss()
        batches = [(torch.randn(6, 3), torch.randn(6, 1)) for _ in range(steps)]
    else:
        model, loss_fn = torch.nn.Linear(4, 3), torch.nn.CrossEntropyLoss()
        batches = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(steps)]
    ref, ref_loss_fn = copy.deepcopy(model), copy.deepcopy(loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    unmoved = set()
    # Moved tensors come back as plain tensors, so a tagged one reaching the
    # model or the loss was never moved: on a GPU that is the device error.
    model.register_forward_pre_hook(
        lambda m, args, kwargs: unmoved.add("inputs") if isinstance(_first(args, kwargs, 0, "input"), Moved)
        else None, with_kwargs=True)
    loss_fn.register_forward_pre_hook(
        lambda m, args, kwargs: unmoved.add("labels") if isinstance(_first(args, kwargs, 1, "target"), Moved)
        else None, with_kwargs=True)
    device = torch.device("cpu")
    losses, ref_losses = [], []
    Moved.log = []
    for x, y in batches:
        losses.append(train_step(model, (_tag(x, "inputs"), _tag(y, "labels")), opt, loss_fn, device))
        ref_losses.append(_reference_step(ref, x, y, ref_opt, ref_loss_fn))
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), ref.parameters()))
    return {"losses": [_plain(v) for v in losses], "ref_losses": ref_losses,
            "types": [type(v).__name__ for v in losses], "moves": list(Moved.log),
            "unmoved": sorted(unmoved), "same_weights": same}


def _plain(value):
    """A returned loss as something that travels back to the check: a float, or its repr."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    return value if isinstance(value, (int, float)) else repr(value)[:200]


@exercise("01.train_step", points=6, description="train_step(model, batch, optimizer, loss_fn, device): move "
          "inputs and labels to the device, one optimisation step, return the loss as a float")
def _train_step(t, train_step):
    one = None
    with t.case("returns the loss as a Python float",
                hint="run one step and end with `return loss.item()` (a float, not the loss tensor)"):
        one = t.call(run_train_step, train_step, False, 1)
        if one["types"] != ["float"]:
            t.fail("return loss.item(): a Python float, not the loss tensor", "float", one["types"][0])
        t.close(one["losses"][0], one["ref_losses"][0],
                hint="return the loss of this batch computed before optimizer.step()")
    for tag in ("inputs", "labels"):
        with t.case(f"moves the {tag} to the device",
                    hint=f"call .to(device) on the {tag}: on a GPU, forgetting it fails with "
                         "'Expected all tensors to be on the same device'"):
            if one is None:
                t.fail("the first case did not finish")
            moved = [target for what, target in one["moves"] if what == tag]
            if "cpu" not in moved:
                t.fail("", f"{tag}.to(device) with device=cpu", f"moves recorded: {one['moves'] or 'none'}")
            if tag in one["unmoved"]:
                t.fail(f"{tag}.to(device) returns a new tensor and leaves {tag} where it was: "
                       f"assign it ({tag[0]} = {tag[0]}.to(device)) and use that one",
                       f"the moved {tag} used by the " + ("model" if tag == "inputs" else "loss"),
                       f"the {tag} as they came in the batch (not moved)")
    with t.case("updates the weights exactly like zero_grad, backward, step",
                hint="call optimizer.zero_grad(), loss.backward() and optimizer.step() once each"):
        if one is None:
            t.fail("the first case did not finish")
        if not one["same_weights"]:
            t.fail("", "weights after one reference step", "different weights")
    with t.case("three steps in a row match the reference (gradients reset each step)",
                hint="without optimizer.zero_grad() gradients add up from step to step"):
        three = t.call(run_train_step, train_step, False, 3)
        if not three["same_weights"]:
            t.fail("", "weights after three reference steps", "different weights")
    with t.case("a regression model with MSELoss", hidden=True):
        reg = t.call(run_train_step, train_step, True, 2)
        if not reg["same_weights"] or reg["types"] != ["float", "float"]:
            t.fail("regression case differs")


# -- visible_devices_env ------------------------------------------------------------
def _child_sees(env: dict) -> str:
    import os

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
    return proc.stdout.strip()


def run_visible(visible_devices_env, ids) -> tuple:
    env = visible_devices_env(ids)
    ok = isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    return env, ok, _child_sees(env) if ok else None


@exercise("01.visible_devices_env", points=6, description="visible_devices_env(ids): the environment a child "
          "process needs to see exactly those GPUs, in that order; ValueError for bad ids")
def _visible(t, visible_devices_env):
    for ids, hidden in (([2, 3], False), ([3, 1], False), ([0], True)):
        expected = ",".join(map(str, ids))
        with t.case(f"visible_devices_env({ids}) makes a real child process see CUDA_VISIBLE_DEVICES={expected}",
                    hidden=hidden, hint="return {'CUDA_VISIBLE_DEVICES': ','.join(str(i) for i in ids)}: keep "
                                        "the order, values must be strings"):
            env, ok, seen = t.call(run_visible, visible_devices_env, ids)
            if not ok:
                t.fail("return a dict of str to str", "dict[str, str]", repr(env))
            t.equal(seen, expected)
            extra = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
            if extra not in ({}, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}):
                t.fail("set only CUDA_VISIBLE_DEVICES (and optionally CUDA_DEVICE_ORDER=PCI_BUS_ID)", "", repr(extra))
    for bad, why, hidden in (([1, 1], "duplicate ids", False), ([-1], "a negative id", False),
                             (["1"], "a string id", True)):
        with t.case(f"visible_devices_env({bad}) raises ValueError ({why})", hidden=hidden,
                    hint="validate: every id an int >= 0, no id twice; raise ValueError naming the bad id"):
            got = t.call(visible_devices_env, bad, catch=True)
            if got[0] != "raised" or got[1] != "ValueError":
                t.fail("", "ValueError", got[1] if got[0] == "raised" else f"returned {got[1]!r}")
