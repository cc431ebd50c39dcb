"""What lesson 01's checks run in a fresh process: every case of an exercise in one call.

:func:`run_pick` calls the learner's ``pick_device`` under several simulated
GPU counts (and a ``CUDA_VISIBLE_DEVICES`` of this process);
:func:`run_train_step` runs ``train_step`` next to a reference with
``device=cuda:1`` (simulated: the batch's moves are logged and its data stays
on the CPU) and with ``device=cpu``; :func:`run_visible` starts real child
processes with the environment ``visible_devices_env`` returns, while this process
itself runs with or without a ``CUDA_VISIBLE_DEVICES`` of its own. Each returns
plain evidence per case, which :mod:`.checkers` judges in the kernel: one
process per check instead of one per case.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import torch
from contextlib import contextmanager

from ..sim.cuda import simulated_gpus
from ..sim.devices import place, Placed, PlacedLoss, PlacedModule, reset, UNTAGGED
from ..sim.outcome import one_thread, outcome


def run_pick(pick_device, calls) -> list:
    """``pick_device(*args)`` for every ``(gpus, args, visible)``, each under ``gpus`` simulated GPUs, with
    this process's ``CUDA_VISIBLE_DEVICES`` set to ``visible`` (None: unset) during the call."""
    one_thread()
    out = []
    for gpus, args, visible in calls:
        with simulated_gpus(gpus), _environ({"CUDA_VISIBLE_DEVICES": visible}):
            out.append(outcome(pick_device, *args))
    return out


@contextmanager
def _environ(values: dict):
    """``os.environ`` with ``values`` set (None: unset) inside the block, exactly as before after it."""
    before = dict(os.environ)
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


# -- train_step ----------------------------------------------------------------------
def _reference_step(model, x, y, optimizer, loss_fn):
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def _plain(value):
    """A returned loss as something that travels back to the check: a float, or its repr."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    return value if isinstance(value, (int, float)) else repr(value)[:200]


def one_run(train_step, regression: bool, steps: int, device) -> dict:
    """Run the learner's train_step ``steps`` times on ``device`` next to a reference step.

    Returns the losses and their types, the reference losses, every move of the
    batch (``(tag, device)``, dtype-only ``.to`` left out), which batch tensors
    reached the model or the loss *unmoved* (a ``y.to(device)`` whose result
    was thrown away), the model's own ``.to`` calls, and after each step
    whether the weights match the reference.
    """
    torch.manual_seed(0)
    if regression:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        loss_fn = torch.nn.MSELoss()
        batches = [(torch.randn(6, 3), torch.randn(6, 1)) for _ in range(steps)]
    else:
        model, loss_fn = torch.nn.Linear(4, 3), torch.nn.CrossEntropyLoss()
        batches = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(steps)]
    ref, ref_loss_fn = copy.deepcopy(model), copy.deepcopy(loss_fn)
    # The model stays where it is: it is "already on device", and its .to/.cuda/.cpu are logged.
    model, loss_fn = PlacedModule(model, name="model"), PlacedLoss(loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    losses, ref_losses, same = [], [], []
    reset()
    for x, y in batches:
        batch = (place(x, "inputs", tracked=False), place(y, "labels", tracked=False))
        losses.append(train_step(model, batch, opt, loss_fn, device))
        ref_losses.append(_reference_step(ref, x, y, ref_opt, ref_loss_fn))
        same.append(all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), ref.parameters())))
    # Untracked tensors come back from a move as plain tensors, so a tagged one reaching the model or
    # the loss was never moved: on a GPU that is the device error.
    unmoved = {tag for _, tag, *_ in PlacedModule.inputs} | {tag for _, _, tag in PlacedLoss.calls}
    return {"losses": [_plain(v) for v in losses], "ref_losses": ref_losses,
            "types": [type(v).__name__ for v in losses], "device": str(device),
            "moves": [(tag, to) for tag, _, to in Placed.moves if tag in ("inputs", "labels")],
            "unmoved": sorted(unmoved - {UNTAGGED}),
            "model_moves": [to for who, _, to in Placed.moves if who == "model"], "same_weights": same}


def run_train_step(train_step) -> dict:
    """Three steps with ``device=cuda:1`` (simulated GPU) and two of a regression with ``device=cpu``."""
    one_thread()
    return {"gpu": one_run(train_step, False, 3, torch.device("cuda", 1)),
            "cpu": one_run(train_step, True, 2, torch.device("cpu"))}


# -- visible_devices_env ----------------------------------------------------------------
def _child_sees(env: dict) -> dict:
    """What a real child started with this process's environment updated by ``env`` reads."""
    code = ("import os, json; print(json.dumps({k: os.environ.get(k) for k in "
            "('CUDA_VISIBLE_DEVICES', 'CUDA_DEVICE_ORDER')}))")
    # -S: no site packages to import; the child only reads its environment (3x faster to start here).
    proc = subprocess.run([sys.executable, "-S", "-c", code], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=30)
    return json.loads(proc.stdout.strip() or "{}")


def run_visible(visible_devices_env, calls) -> list:
    """For each ``(ids, parent)``: what the learner's function did while this process ran with the
    ``parent`` variables (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``; None: unset), what a real
    child started with that environment plus the returned one sees, and whether the function changed
    this process's own ``os.environ``."""
    out = []
    for ids, parent in calls:
        with _environ(parent):
            before = dict(os.environ)
            got = outcome(visible_devices_env, list(ids))
            changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
            os.environ.clear()
            os.environ.update(before)
            report = {"outcome": got, "environ_changed": changed}
            if got[0] == "ok":
                env = got[1]
                report["strings"] = isinstance(env, dict) and all(
                    isinstance(k, str) and isinstance(v, str) for k, v in env.items())
                report["seen"] = _child_sees(env) if report["strings"] else None
                if not report["strings"]:
                    report["outcome"] = ("ok", repr(env)[:200])
        out.append(report)
    return out
