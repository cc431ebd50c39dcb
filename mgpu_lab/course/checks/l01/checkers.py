"""Checks of lesson 01 (devices): pick_device, train_step, visible_devices_env.

The GPU branches are judged on any machine, and each check runs the learner's
code once, in one fresh process, for all its cases (:mod:`.ranks`):

- ``pick_device`` runs where ``torch.cuda`` reports a simulated number of GPUs
  (0, 1, 2, 4), once with ``CUDA_VISIBLE_DEVICES=5,3`` set in the process;
- ``train_step`` gets ``device=cuda:1`` on a machine without a GPU: the batch
  tensors record every move (:mod:`..sim.devices`: the move is logged, the
  data stays on the CPU), so a batch moved to ``"cpu"``, to ``"cuda"`` or not at
  all shows, as does a ``y.to(device)`` whose result was thrown away;
- ``visible_devices_env`` is judged by real child processes started with the
  environment it returns, while the check's process runs on all GPUs or on a
  subset of its own (``CUDA_VISIBLE_DEVICES=5,2,7``, or GPU UUIDs).
"""
from __future__ import annotations

import torch

from .._core import exercise
from ..sim.outcome import in_words
from .judges import need, raises_naming
from .ranks import run_pick, run_train_step, run_visible


# -- pick_device -------------------------------------------------------------------
FIRST_GPU = ("index None means the first GPU this process sees, cuda:0; a device without an index ('cuda') "
             "means whichever GPU is current, not a fixed one")
GIVEN = "the index you are given picks the GPU: pick_device(i) is the i-th GPU this process sees"
SUBSET_PICK = ("a process numbers the GPUs it sees from 0: under CUDA_VISIBLE_DEVICES=5,3 physical GPU 3 is its "
               "cuda:1, and cuda:3 does not exist in it (3 is a physical id, not one of its indices); " + GIVEN)
PICK_CASES = [  # name, (gpus, args, CUDA_VISIBLE_DEVICES) calls, expected devices, hidden, hint per call
    ("no GPU visible: pick_device() is the CPU", [(0, (), None)], [torch.device("cpu")], False,
     ["with no GPU visible the work falls back to the CPU (and says so): a GPU device there fails at the "
      "first allocation"]),
    ("2 GPUs visible: pick_device() and pick_device(0) are cuda:0, pick_device(1) is cuda:1",
     [(2, (), None), (2, (0,), None), (2, (1,), None)],
     [torch.device("cuda", 0), torch.device("cuda", 0), torch.device("cuda", 1)], False, [FIRST_GPU, GIVEN, GIVEN]),
    ("started with CUDA_VISIBLE_DEVICES=5,3 (two GPUs visible): this process's numbering, pick_device(1) is "
     "cuda:1 and pick_device(3) raises ValueError naming 2", [(2, (1,), "5,3"), (2, (3,), "5,3")],
     [torch.device("cuda", 1), ValueError], False, [SUBSET_PICK, SUBSET_PICK]),
    ("4 GPUs visible: pick_device(3) is cuda:3", [(4, (3,), None)], [torch.device("cuda", 3)], True, [GIVEN]),
]
BAD_INDEX = [(2, (2,), None), (2, (-1,), None), (2, (7,), None), (0, (0,), None)]
# The exercise turns the text into code (depth 1): 2 points, for the process's own numbering under
# CUDA_VISIBLE_DEVICES and the bad index; its other cases are practice (reported, no points)
PAID_PICK = 2
RANGE_HINT = ("an index that names no GPU of this process is an error the caller must hear about, with the "
              "number of GPUs it can choose from; a silent fallback hides a wrong index")


@exercise("01.pick_device", points=2, description="pick_device(index=None): the GPU this process calls "
          "cuda:index, cuda:0 for None, the CPU without GPUs; ValueError naming the visible count for a bad index")
def _pick_device(t, pick_device):
    """Catches: the index ignored (always cuda:0), no CPU fallback, ``torch.device('cuda')`` for None,
    the physical id of CUDA_VISIBLE_DEVICES instead of the process's numbering (or accepted as an index), strings instead of devices
    (one case), an index out of range accepted (off by one, negative, any index without GPUs) or refused
    with another error or without the count (one case)."""
    calls = [c for case in PICK_CASES for c in case[1]] + BAD_INDEX
    got = None
    returned = []
    for i, (name, these, expected, hidden, hints) in enumerate(PICK_CASES):
        with t.case(name, hidden=hidden, hint=hints[0], points=int(i == PAID_PICK)):
            if i == 0:
                got = dict(zip(calls, t.call(run_pick, pick_device, calls)))
            need(t, got)
            for (gpus, args, visible), want, hint in zip(these, expected, hints):
                result = got[(gpus, args, visible)]
                call = f"pick_device({', '.join(map(repr, args))}) with {gpus} GPU(s)"
                if want is ValueError:  # an index this process does not have, though the machine may
                    if not raises_naming(result, gpus):
                        t.fail(hint, f"{call}: ValueError mentioning {gpus}", f"{call}: {in_words(result, raised='')}")
                    continue
                if result[0] == "raised":
                    t.fail(hint, repr(want), f"{call}: {in_words(result, raised='')}")
                value = result[1]
                returned.append(value)
                # Strings name devices too ("cuda:1"); the type is judged once, below.
                if (torch.device(value) if isinstance(value, str) else value) != want:
                    t.fail(hint, f"{call}: {want!r}", f"{call}: {value!r}")
    with t.case("returns a torch.device, not a string", points=0,
                hint="a string names a device but is not one: it does not compare equal to torch.device('cuda', 1) "
                     "and has no .type or .index"):
        need(t, got)
        wrong = [v for v in returned if not isinstance(v, torch.device)]
        if wrong:
            t.fail("", "a torch.device", f"{type(wrong[0]).__name__} {wrong[0]!r}")
    with t.case("an index that names no visible GPU raises ValueError naming the count: pick_device(2), (-1) and "
                "(7) with 2 GPUs, pick_device(0) with none", hint=RANGE_HINT):
        need(t, got)
        for call in BAD_INDEX:
            gpus = call[0]
            if not raises_naming(got[call], gpus):
                t.fail(f"pick_device({call[1][0]}) with {gpus} GPU(s): " + RANGE_HINT,
                       f"ValueError mentioning {gpus}", in_words(got[call], raised=""))


# -- train_step ----------------------------------------------------------------------
MOVE_HINT = ("the {tag} arrive on the CPU and the model is on the device you are given: on a GPU, {tag} left "
             "behind or sent elsewhere ('cpu', or 'cuda', which means cuda:0 while device is cuda:1) fail with "
             "'Expected all tensors to be on the same device'")


@exercise("01.train_step", points=2, references=("mgpu_lab.parallel.dp_tools:traced_step",),
          description="train_step(model, batch, optimizer, loss_fn, device): one optimisation step computed on "
                      "device (a CPU batch), the loss as a float")
def _train_step(t, train_step):
    """Runs with ``device=cuda:1`` (simulated) and catches: inputs or labels not moved, moved to
    ``"cpu"``/``"cuda"``/``.cuda()`` instead of ``device``, a moved copy thrown away, the model moved
    elsewhere, no ``zero_grad``/``step``, a wrong order, the loss tensor returned (one case), a loss
    computed after the step."""
    runs = None
    with t.case("returns this batch's loss, before the step, as a Python float", points=0,
                hint="train_step returns this batch's loss, computed before the weights change, as a Python float"):
        runs = t.call(run_train_step, train_step)
        gpu = runs["gpu"]
        if gpu["types"][0] != "float":
            t.fail("your step returned the loss tensor (it keeps its graph and its device alive); a Python float "
                   "is what a training loop logs", "float", gpu["types"][0])
        if not all(isinstance(v, (int, float)) for v in gpu["losses"]):
            t.fail("the loss as a Python float", "float", gpu["losses"][0])
        t.close(gpu["losses"], gpu["ref_losses"],
                hint="your loss differs from this batch's loss before the step: it was computed after the weights "
                     "changed, or on something else")
    for tag in ("inputs", "labels"):
        with t.case(f"the {tag} used are on the device it is given (device=cuda:1, a simulated GPU)",
                    hint=MOVE_HINT.format(tag=tag)):
            need(t, runs)
            gpu = runs["gpu"]
            moved = [where for what, where in gpu["moves"] if what == tag]
            if not moved or any(where != gpu["device"] for where in moved):
                t.fail("", f"{tag}.to(device) with device={gpu['device']}",
                       f"moves of the {tag}: {sorted(set(moved)) or 'none'}")
            if tag in gpu["unmoved"]:
                t.fail(f"your step moved the {tag} but used the originals: a tensor's .to returns a moved copy "
                       "and leaves the tensor where it was",
                       f"the moved {tag} used by the " + ("model" if tag == "inputs" else "loss"),
                       f"the {tag} as they came in the batch (not moved)")
            if tag == "inputs" and any(where != gpu["device"] for where in gpu["model_moves"]):
                t.fail("the model is already on device and your step moved it elsewhere ('cuda' means cuda:0 "
                       "while the batch is on cuda:1)", f"the model on {gpu['device']}",
                       f"model moved to {sorted(set(gpu['model_moves']))}")
    with t.case("one call updates the weights exactly like one optimizer step on this batch's loss", points=0,
                hint="after your step the weights differ from one optimisation step's: the gradient of this "
                     "batch's loss, from zero, applied by the optimizer once"):
        need(t, runs)
        if not runs["gpu"]["same_weights"][0]:
            t.fail("", "weights after one reference step", "different weights")
    with t.case("three calls in a row match three optimizer steps", points=0,
                hint="one step is right but the next ones drift: each step's gradient was added to the "
                     "previous steps' (gradients accumulate in .grad until they are reset)"):
        need(t, runs)
        if not all(runs["gpu"]["same_weights"]):
            t.fail("", "weights after three reference steps", "different weights")
    with t.case("device=cpu, a regression model with MSELoss: two steps match the reference", hidden=True, points=0,
                hint="the same step for any model, loss and device"):
        need(t, runs)
        cpu = runs["cpu"]
        if not all(cpu["same_weights"]) or cpu["unmoved"]:
            t.fail("", "the reference weights", f"same weights per step {cpu['same_weights']}, "
                                                 f"unmoved {cpu['unmoved']}")


# -- visible_devices_env ------------------------------------------------------------
ALL = {"CUDA_VISIBLE_DEVICES": None, "CUDA_DEVICE_ORDER": None}  # this process sees every GPU
SUBSET = {"CUDA_VISIBLE_DEVICES": "5,2,7", "CUDA_DEVICE_ORDER": None}  # this process runs on a subset
UUIDS = {"CUDA_VISIBLE_DEVICES": "GPU-1a2b,GPU-3c4d,GPU-5e6f", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
ENV_HINT = ("a child's environment holds strings only; CUDA reads CUDA_VISIBLE_DEVICES as GPU entries separated by "
            "commas alone, in the order given: the child's cuda:0 is the first entry")
SUBSET_HINT = ("ids are GPUs as this process numbers them: when it already runs on a subset, its cuda:i is entry i "
               "of its own CUDA_VISIBLE_DEVICES, and the child must read those entries in the order this process "
               "reads them (its CUDA_DEVICE_ORDER, CUDA's default FASTEST_FIRST when unset)")
ENV_CASES = [  # name, [(ids, parent)], expected CUDA_VISIBLE_DEVICES of the child, hidden
    ("this process sees every GPU: visible_devices_env([2, 3]) and ([0]) make real children see GPUs 2,3 and 0",
     [([2, 3], ALL), ([0], ALL)], ["2,3", "0"], False),
    ("visible_devices_env([3, 1]) keeps the order: the child sees 3,1 (its cuda:0 is GPU 3)", [([3, 1], ALL)],
     ["3,1"], False),
    ("this process runs on CUDA_VISIBLE_DEVICES=5,2,7: ([2, 0]) gives the child the GPUs this process calls "
     "cuda:2 and cuda:0 (7,5), read in this process's order", [([2, 0], SUBSET)], ["7,5"], False),
    ("this process runs on GPUs named by UUID (GPU-1a2b,GPU-3c4d,GPU-5e6f): ([1]) gives the child GPU-3c4d",
     [([1], UUIDS)], ["GPU-3c4d"], True),
]
BAD_IDS = [([1, 1], ALL), ([-1], ALL), ([3], SUBSET)]


def _order(values: dict) -> str:
    return values.get("CUDA_DEVICE_ORDER") or "FASTEST_FIRST"


def _judge_child(t, report, ids, parent, want):
    """Fail the case unless the child saw ``want``, in the parent's order when the parent runs on a subset."""
    if report["outcome"][0] == "raised":
        t.fail("", "a dict of variables", in_words(report["outcome"], raised=""))
    if not report["strings"]:
        t.fail(ENV_HINT, "dict[str, str]", report["outcome"][1])
    extra = {k for k in report["outcome"][1] if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    if extra:
        t.fail("the child needs only CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER: everything else it inherits",
               "those two variables", ", ".join(sorted(extra)))
    seen = report["seen"]
    if seen.get("CUDA_VISIBLE_DEVICES") != want:
        mine = parent["CUDA_VISIBLE_DEVICES"]
        hint = ""
        if mine is not None and seen.get("CUDA_VISIBLE_DEVICES") == ",".join(map(str, ids)):
            hint = (f"your child got the ids themselves: with this process on {mine} those are other GPUs than "
                    "the ones it calls cuda:" + ", cuda:".join(map(str, ids)) + "; " + SUBSET_HINT)
        t.fail(hint, f"the child sees {want!r}", f"the child sees {seen.get('CUDA_VISIBLE_DEVICES')!r}")
    if parent["CUDA_VISIBLE_DEVICES"] is None and _order(seen) != "PCI_BUS_ID":
        t.fail("your child numbers the GPUs in CUDA's default order (fastest first), which can differ from "
               "nvidia-smi's: its GPU 2 may be another card; from a process that sees every GPU the ids are "
               "nvidia-smi's numbers, whatever order this process was left in, and CUDA_DEVICE_ORDER says which "
               "order the child uses",
               "CUDA_DEVICE_ORDER PCI_BUS_ID", f"CUDA_DEVICE_ORDER {_order(seen)}")
    if parent["CUDA_VISIBLE_DEVICES"] is not None and _order(seen) != _order(parent):
        t.fail("your child reads the list in another order than this process: the same entries can then name "
               "other GPUs; " + SUBSET_HINT, f"CUDA_DEVICE_ORDER {_order(parent)}", f"CUDA_DEVICE_ORDER {_order(seen)}")


@exercise("01.visible_devices_env", points=6,
          references=("mgpu_lab.devices.visible:subset_vars", "mgpu_lab.devices.visible:child_env"),
          description="visible_devices_env(ids): the variables that make a child process see exactly the GPUs "
                      "this process calls cuda:ids[0], cuda:ids[1], ..., in that order")
def _visible(t, visible_devices_env):
    """Catches: sorted ids, spaces or other separators, values that are not strings, extra variables, setting
    ``os.environ`` of the calling process, this process's own CUDA_VISIBLE_DEVICES ignored (the ids passed on
    as they are), the child reading them in another order (PCI_BUS_ID against the parent's default), the parent's
    entries parsed as ints (UUIDs), repeated, negative or out-of-range ids accepted (one case)."""
    calls = [c for case in ENV_CASES for c in case[1]] + BAD_IDS
    got, at = None, 0
    for i, (name, these, wants, hidden) in enumerate(ENV_CASES):
        with t.case(name, hidden=hidden, hint=SUBSET_HINT if these[0][1] is not ALL else ENV_HINT):
            if i == 0:
                got = t.call(run_visible, visible_devices_env, calls)
            need(t, got)
            for k, ((ids, parent), want) in enumerate(zip(these, wants)):
                _judge_child(t, got[at + k], ids, parent, want)
        at += len(these)
    with t.case("leaves this process's own os.environ unchanged (the variables are for the child)",
                hint="CUDA has already read this process's variables, and every later child would inherit a "
                     "change: the variables belong in the child's environment only"):
        need(t, got)
        if not any(report["outcome"][0] == "ok" and isinstance(report["outcome"][1], dict)
                   and "CUDA_VISIBLE_DEVICES" in report["outcome"][1] for report in got[:at]):
            t.fail("not judged: your function returned no CUDA_VISIBLE_DEVICES for a child (see the cases above); "
                   "leaving os.environ alone counts beside variables that are returned for the child",
                   "variables for the child, os.environ unchanged", "no variables returned")
        changed = sorted({k for report in got for k in report["environ_changed"]})
        if changed:
            t.fail("", "os.environ unchanged", f"os.environ changed: {', '.join(changed)}")
    with t.case("ids that name no GPU of this process raise ValueError: [1, 1], [-1], and [3] on 5,2,7",
                hint="a GPU listed twice is one GPU, an id below 0 or past this process's GPUs names none: a "
                     "child started with them would see fewer GPUs than asked (CUDA stops reading at a bad entry)"):
        need(t, got)
        for (ids, parent), report in zip(BAD_IDS, got[at:]):
            result = report["outcome"]
            if result[0] != "raised" or result[1] != "ValueError":
                where = f" with this process on {parent['CUDA_VISIBLE_DEVICES']}" if parent is SUBSET else ""
                t.fail("", f"ValueError for {ids}{where}", in_words(result, raised=""))
