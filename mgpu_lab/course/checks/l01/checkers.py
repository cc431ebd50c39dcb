"""Checks of lesson 01 (devices): pick_device, train_step, visible_devices_env.

The GPU branches are judged on any machine, and each check runs the learner's
code once, in one fresh process, for all its cases (:mod:`.ranks`):

- ``pick_device`` runs where ``torch.cuda`` reports a simulated number of GPUs
  (0, 2, 4);
- ``train_step`` gets ``device=cuda:1`` on a machine without a GPU: the batch
  tensors record every move (:mod:`..sim.devices`: the move is logged, the
  data stays on the CPU), so a batch moved to ``"cpu"``, to ``"cuda"`` or not at
  all shows, as does a ``y.to(device)`` whose result was thrown away;
- ``visible_devices_env`` is judged by real child processes started with the
  environment it returns.
"""
from __future__ import annotations

import torch

from .._core import exercise
from ..sim.outcome import in_words
from .judges import need, raises_naming
from .ranks import run_pick, run_train_step, run_visible


PICK_HINT = ("return torch.device('cuda', index) (index 0 when None) if torch.cuda.is_available(), "
             "else torch.device('cpu')")


RANGE_HINT = ("check 0 <= index < torch.cuda.device_count() and otherwise "
              "raise ValueError(f'... {count} GPU(s) visible ...')")


# -- pick_device -------------------------------------------------------------------
PICK_CASES = [  # name, (gpus, args) calls, expected devices, hidden, hint per call
    ("no GPU visible: pick_device() is cpu", [(0, ())], [torch.device("cpu")], False,
     ["with no GPU visible (torch.cuda.is_available() is False) return torch.device('cpu')"]),
    ("2 GPUs visible: pick_device() and pick_device(0) are cuda:0, pick_device(1) is cuda:1",
     [(2, ()), (2, (0,)), (2, (1,))], [torch.device("cuda", 0), torch.device("cuda", 0), torch.device("cuda", 1)],
     False, ["index=None means the first visible GPU: torch.device('cuda', 0)",
             "use the index you were given: torch.device('cuda', index)",
             "use the index you were given: torch.device('cuda', index)"]),
    ("4 GPUs visible: pick_device(3) is cuda:3", [(4, (3,))], [torch.device("cuda", 3)], True, [PICK_HINT]),
]


BAD_INDEX = [(2, (2,)), (2, (-1,)), (2, (7,))]


NO_GPU_INDEX = [(0, (0,))]


@exercise("01.pick_device", points=6, description="pick_device(index=None): cuda:index with GPUs, cpu without, "
          "ValueError naming the visible count for a bad index")
def _pick_device(t, pick_device):
    """Catches: the index ignored (always cuda:0), no CPU fallback, ``torch.device('cuda')`` for None,
    strings instead of devices (one case), an off-by-one or missing negative check, another error
    type, a message that does not name the visible count, an index accepted when no GPU is visible."""
    calls = [c for case in PICK_CASES for c in case[1]] + BAD_INDEX + NO_GPU_INDEX
    got = None
    returned = []
    for i, (name, these, expected, hidden, hints) in enumerate(PICK_CASES):
        with t.case(name, hidden=hidden, hint=hints[0]):
            if i == 0:
                got = dict(zip(calls, t.call(run_pick, pick_device, calls)))
            need(t, got)
            for (gpus, args), want, hint in zip(these, expected, hints):
                result = got[(gpus, args)]
                call = f"pick_device({', '.join(map(repr, args))}) with {gpus} GPU(s)"
                if result[0] == "raised":
                    t.fail(hint, repr(want), f"{call}: {in_words(result, raised='')}")
                value = result[1]
                returned.append(value)
                # Strings name devices too ("cuda:1"); the type is judged once, below.
                if (torch.device(value) if isinstance(value, str) else value) != want:
                    t.fail(hint, f"{call}: {want!r}", f"{call}: {value!r}")
    with t.case("returns a torch.device, not a string",
                hint="return torch.device('cuda', index) / torch.device('cpu'): a device object, which "
                     "compares and prints as a device everywhere"):
        need(t, got)
        wrong = [v for v in returned if not isinstance(v, torch.device)]
        if wrong:
            t.fail("", "torch.device(...)", f"{type(wrong[0]).__name__} {wrong[0]!r}")
    with t.case("2 GPUs visible: pick_device(2), pick_device(-1) and pick_device(7) raise ValueError "
                "naming the count (2)", hint=RANGE_HINT):
        need(t, got)
        for call in BAD_INDEX:
            if not raises_naming(got[call], 2):
                t.fail(f"pick_device({call[1][0]}) with 2 GPUs: valid indices are 0 and 1, so raise ValueError "
                       "and say how many GPUs are visible (2); " + RANGE_HINT,
                       "ValueError mentioning 2", in_words(got[call], raised=""))
    with t.case("no GPU visible: pick_device(0) raises ValueError naming the count (0)", hidden=True,
                hint=RANGE_HINT):
        need(t, got)
        if not raises_naming(got[NO_GPU_INDEX[0]], 0):
            t.fail("with no GPU any explicit index is out of range: " + RANGE_HINT,
                   "ValueError mentioning 0", in_words(got[NO_GPU_INDEX[0]], raised=""))


# -- train_step ----------------------------------------------------------------------
MOVE_HINT = ("call .to(device) on the {tag} with the device you were given: on a GPU, forgetting it (or "
             "moving to 'cpu', or to 'cuda', which means cuda:0) fails with 'Expected all tensors to be on "
             "the same device'")


@exercise("01.train_step", points=6, description="train_step(model, batch, optimizer, loss_fn, device): move "
          "inputs and labels to the device, one optimisation step, return the loss as a float")
def _train_step(t, train_step):
    """Runs with ``device=cuda:1`` (simulated) and catches: inputs or labels not moved, moved to
    ``"cpu"``/``"cuda"``/``.cuda()`` instead of ``device``, a moved copy thrown away, the model moved
    elsewhere, no ``zero_grad``/``step``, a wrong order, the loss tensor returned (one case), a loss
    computed after the step."""
    runs = None
    with t.case("returns the batch's loss (computed before optimizer.step()) as a Python float",
                hint="run one step and end with `return loss.item()` (a float, not the loss tensor)"):
        runs = t.call(run_train_step, train_step)
        gpu = runs["gpu"]
        if gpu["types"][0] != "float":
            t.fail("return loss.item(): a Python float, not the loss tensor", "float", gpu["types"][0])
        if not all(isinstance(v, (int, float)) for v in gpu["losses"]):
            t.fail("return loss.item(): a Python float", "float", gpu["losses"][0])
        t.close(gpu["losses"], gpu["ref_losses"],
                hint="return the loss of this batch computed before optimizer.step()")
    for tag in ("inputs", "labels"):
        with t.case(f"moves the {tag} to the device it is given (device=cuda:1, a simulated GPU)",
                    hint=MOVE_HINT.format(tag=tag)):
            need(t, runs)
            gpu = runs["gpu"]
            moved = [where for what, where in gpu["moves"] if what == tag]
            if not moved or any(where != gpu["device"] for where in moved):
                t.fail("", f"{tag}.to(device) with device={gpu['device']}",
                       f"moves of the {tag}: {sorted(set(moved)) or 'none'}")
            if tag in gpu["unmoved"]:
                t.fail(f"{tag}.to(device) returns a new tensor and leaves {tag} where it was: "
                       f"assign it ({tag[0]} = {tag[0]}.to(device)) and use that one",
                       f"the moved {tag} used by the " + ("model" if tag == "inputs" else "loss"),
                       f"the {tag} as they came in the batch (not moved)")
            if tag == "inputs" and any(where != gpu["device"] for where in gpu["model_moves"]):
                t.fail("the model is already on device: leave it there (a model.to('cuda') puts it on "
                       "cuda:0 while the batch is on cuda:1)", f"the model on {gpu['device']}",
                       f"model moved to {sorted(set(gpu['model_moves']))}")
    with t.case("one step updates the weights exactly like zero_grad, backward, step",
                hint="call optimizer.zero_grad(), loss.backward() and optimizer.step() once each, in this order"):
        need(t, runs)
        if not runs["gpu"]["same_weights"][0]:
            t.fail("", "weights after one reference step", "different weights")
    with t.case("three steps in a row match the reference (gradients reset each step)",
                hint="without optimizer.zero_grad() gradients add up from step to step"):
        need(t, runs)
        if not all(runs["gpu"]["same_weights"]):
            t.fail("", "weights after three reference steps", "different weights")
    with t.case("device=cpu, a regression model with MSELoss: two steps match the reference", hidden=True,
                hint="the same step for any model, loss and device"):
        need(t, runs)
        cpu = runs["cpu"]
        if not all(cpu["same_weights"]) or cpu["unmoved"]:
            t.fail("", "the reference weights", f"same weights per step {cpu['same_weights']}, "
                                                 f"unmoved {cpu['unmoved']}")


# -- visible_devices_env ------------------------------------------------------------
ENV_HINT = ("return {'CUDA_VISIBLE_DEVICES': ','.join(str(i) for i in ids)}: keep the order, no spaces, "
            "values must be strings")


BAD_HINT = "validate: every id an int >= 0, no id twice; raise ValueError naming the bad id"


ENV_CASES = [  # name, ids lists, hidden
    ("visible_devices_env([2, 3]) and ([0]) make real child processes see CUDA_VISIBLE_DEVICES=2,3 and 0",
     [[2, 3], [0]], False),
    ("visible_devices_env([3, 1]) keeps the order: the child sees 3,1 (its cuda:0 is GPU 3)", [[3, 1]], False),
]


BAD_CASES = [  # name, ids, hidden, hint
    ("visible_devices_env([1, 1]) raises ValueError (an id twice)", [[1, 1]], False,
     "no id twice: a GPU listed twice is one GPU, not two; " + BAD_HINT),
    ("visible_devices_env([-1]) and ([0, -2]) raise ValueError (negative ids)", [[-1], [0, -2]], False,
     "every id an int >= 0 (CUDA stops reading the list at the first invalid id); " + BAD_HINT),
    ("visible_devices_env(['1']) and ([True]) raise ValueError (not ints)", [["1"], [True]], True, BAD_HINT),
]


@exercise("01.visible_devices_env", points=6, description="visible_devices_env(ids): the environment a child "
          "process needs to see exactly those GPUs, in that order; ValueError for bad ids")
def _visible(t, visible_devices_env):
    """Catches: sorted ids, spaces or other separators, values that are not strings, extra variables,
    setting ``os.environ`` of the calling process, duplicate, negative or non-int ids accepted (one case)."""
    calls = [ids for case in ENV_CASES for ids in case[1]] + [ids for case in BAD_CASES for ids in case[1]]
    got = None
    at = 0
    for i, (name, these, hidden) in enumerate(ENV_CASES):
        with t.case(name, hidden=hidden, hint=ENV_HINT):
            if i == 0:
                got = t.call(run_visible, visible_devices_env, calls)
            need(t, got)
            for k, ids in enumerate(these):
                report = got[at + k]
                if report["outcome"][0] == "raised":
                    t.fail("", "a dict of variables", in_words(report["outcome"], raised=""))
                if not report["strings"]:
                    t.fail("return a dict of str to str (a child's environment holds only strings)",
                           "dict[str, str]", report["outcome"][1])
                t.equal(report["seen"], ",".join(map(str, ids)))
                extra = {k: v for k, v in report["outcome"][1].items() if k != "CUDA_VISIBLE_DEVICES"}
                if extra not in ({}, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}):
                    t.fail("set only CUDA_VISIBLE_DEVICES (and optionally CUDA_DEVICE_ORDER=PCI_BUS_ID)", "",
                           repr(extra))
        at += len(these)
    with t.case("leaves this process's own os.environ unchanged (the variables are for the child)",
                hint="return a new dict; do not set os.environ here: CUDA has already read it in this process, "
                     "and every later child would inherit it"):
        need(t, got)
        changed = sorted({k for report in got for k in report["environ_changed"]})
        if changed:
            t.fail("", "os.environ unchanged", f"os.environ changed: {', '.join(changed)}")
    first_bad = at
    for name, bad, hidden, hint in BAD_CASES:
        with t.case(name, hidden=hidden, hint=hint):
            need(t, got)
            for k, ids in enumerate(bad):
                result = got[first_bad + k]["outcome"]
                if result[0] != "raised" or result[1] != "ValueError":
                    t.fail("", f"ValueError for {ids}", in_words(result, raised=""))
        first_bad += len(bad)
