"""Lesson 01's checks against named wrong answers made from the solution, and correct variants.

Every mutant is the solution cell of ``solutions/01_devices.ipynb`` with one
learner bug put in; its check must fail with a message that names the bug.
Every variant is a correct answer written differently; it must get full marks.
"""
from __future__ import annotations

import os

import pytest
import torch

from mutation import ExerciseMutants, Mutant, Variant, drop_statement, mutant_tests, replace, sub

pytestmark = pytest.mark.timeout(300)
NOTEBOOK = "01_devices.ipynb"
NAMESPACE = {"torch": torch, "os": os}

PICK = ExerciseMutants("01.pick_device", NOTEBOOK, ("pick_device",), mutants=[
    Mutant("index ignored, always cuda:0",
           replace('return torch.device("cuda", index)', 'return torch.device("cuda", 0)'), "the index you are given"),
    Mutant("no CPU fallback",
           replace('torch.device("cuda", 0) if count else torch.device("cpu")', 'torch.device("cuda", 0)'),
           "falls back to the cpu"),
    Mutant("torch.device('cuda') without an index for None",
           replace('torch.device("cuda", 0) if count', 'torch.device("cuda") if count'), "first gpu this process sees"),
    Mutant("strings instead of devices",
           (replace('return torch.device("cuda", index)', 'return f"cuda:{index}"'),
            replace('torch.device("cuda", 0) if count else torch.device("cpu")', '"cuda:0" if count else "cpu"')),
           ("a torch.device", "str 'cpu'")),
    Mutant("the physical id of CUDA_VISIBLE_DEVICES, not this process's numbering",
           replace('    return torch.device("cuda", index)',
                   '    import os\n    visible = os.environ.get("CUDA_VISIBLE_DEVICES")\n'
                   '    return torch.device("cuda", int(visible.split(",")[index]) if visible else index)'),
           ("physical gpu 3 is its cuda:1", "cuda:3")),
    Mutant("index == count allowed (off by one)", replace("index < count", "index <= count"),
           "pick_device(2) with 2 gpu(s)"),
    Mutant("negative index allowed", replace("0 <= index < count", "index < count"), "pick_device(-1)"),
    Mutant("a physical GPU listed in CUDA_VISIBLE_DEVICES accepted as an index",
           replace("if not 0 <= index < count:",
                   'if not (0 <= index < count or str(index) in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")):'),
           ("pick_device(3) with 2 gpu(s)", "3 is a physical id")),
    Mutant("IndexError instead of ValueError", replace("raise ValueError", "raise IndexError"),
           ("valueerror", "indexerror")),
    Mutant("message does not name the visible count",
           replace("{count} GPU(s) are visible", "too few GPUs are visible"), ("pick_device(2)", "mentioning 2")),
    Mutant("explicit index without GPUs falls back to the CPU",
           replace("if index is None:", "if index is None or not count:"), "pick_device(0) with 0 gpu(s)"),
], variants=[
    Variant("CPU branch first, f-string device", '''
def pick_device(index=None):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        if index is not None:
            raise ValueError(f"no GPU visible (0 GPUs), so index {index} does not exist")
        return torch.device("cpu")
    i = 0 if index is None else index
    if i < 0 or i >= n:
        raise ValueError(f"{n} GPUs visible; index {i} is out of range")
    return torch.device(f"cuda:{i}")
'''),
    Variant("is_available first, range membership", '''
def pick_device(index=None):
    if not torch.cuda.is_available():
        if index is None:
            return torch.device("cpu")
        raise ValueError(f"index={index} requested but 0 GPU(s) are visible")
    count = torch.cuda.device_count()
    if index is None:
        index = 0
    if index not in range(count):
        raise ValueError(f"there are {count} visible GPUs (0..{count - 1}); got index={index}")
    return torch.device("cuda", index)
'''),
])

STEP = ExerciseMutants("01.train_step", NOTEBOOK, ("train_step",), mutants=[
    Mutant("labels never moved", replace("labels.to(device)", "labels"), ("labels", "none")),
    Mutant("inputs never moved", replace("inputs.to(device)", "inputs"), ("inputs", "none")),
    Mutant("batch moved to 'cpu', device ignored", sub(r"\.to\(device\)", '.to("cpu")'),
           ("cuda:1", "moves of the inputs: ['cpu']")),
    Mutant("batch moved with .cuda() (cuda:0, not device)", sub(r"\.to\(device\)", ".cuda()"),
           ("which means cuda:0", "['cuda']")),
    Mutant("moved labels thrown away",
           replace("inputs, labels = inputs.to(device), labels.to(device)",
                   "inputs = inputs.to(device)\n    labels.to(device)"), "returns a moved copy"),
    Mutant("model moved to 'cuda' (cuda:0)",
           replace("    optimizer.zero_grad()", '    model.to("cuda")\n    optimizer.zero_grad()'),
           ("model moved to ['cuda']",)),
    Mutant("no zero_grad", drop_statement("zero_grad"), "gradients accumulate"),
    Mutant("no optimizer.step()", drop_statement("optimizer.step"), "different weights"),
    Mutant("zero_grad between backward and step",
           (drop_statement("zero_grad"),
            replace("    optimizer.step()", "    optimizer.zero_grad()\n    optimizer.step()")),
           "applied by the optimizer once"),
    Mutant("the loss tensor returned", replace("return loss.item()", "return loss"), ("float", "tensor")),
    Mutant("loss recomputed after the step",
           replace("return loss.item()", "return loss_fn(model(inputs), labels).item()"),
           "computed after the weights changed"),
], variants=[
    Variant("generator of moves, non_blocking, float()", '''
def train_step(model, batch, optimizer, loss_fn, device):
    x, y = (t.to(device, non_blocking=True) for t in batch)
    optimizer.zero_grad(set_to_none=True)
    out = model(x)
    loss = loss_fn(out, y)
    loss.backward()
    optimizer.step()
    return float(loss)
'''),
    Variant("model.to(device) again, zero_grad after the step", '''
def train_step(model, batch, optimizer, loss_fn, device):
    model.to(device)
    inputs = batch[0].to(device=device)
    labels = batch[1].to(device=device)
    loss = loss_fn(model(inputs), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach().item()
'''),
])

JOIN = '",".join(str(gpu) for gpu in ids)'
VISIBLE = ExerciseMutants("01.visible_devices_env", NOTEBOOK, ("visible_devices_env",), mutants=[
    Mutant("ids sorted", replace("str(gpu) for gpu in ids)", "str(gpu) for gpu in sorted(ids))"), "keeps the order"),
    Mutant("spaces after the commas", replace(JOIN, JOIN.replace('","', '", "')), "'2, 3'"),
    Mutant("a list instead of a string", replace(JOIN, "ids"), "strings only"),
    Mutant("this process's own CUDA_VISIBLE_DEVICES ignored",
           replace('",".join(entries[gpu] for gpu in ids)', JOIN), ("the ids themselves", "'2,0'")),
    Mutant("the child always reads in PCI bus order",
           replace('os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")', '"PCI_BUS_ID"'),
           ("another order", "cuda_device_order pci_bus_id")),
    Mutant("no CUDA_DEVICE_ORDER from a process that sees every GPU",
           replace(', "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}', "}"), "nvidia-smi"),
    Mutant("os.environ of this process set",
           replace("    if entries is None:\n",
                   '    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))\n    if entries is None:\n'),
           ("os.environ changed", "cuda_visible_devices")),
    Mutant("duplicate ids accepted", replace("if repeated:", "if False:"), "valueerror for [1, 1]"),
    Mutant("ids past this process's subset accepted", replace("if entries is not None and gpu >= len(entries):",
                                                             "if False:"),
           "[3] with this process on 5,2,7"),
    Mutant("the parent's entries parsed as ints",
           replace("entries[gpu] for gpu in ids", "str(int(entries[gpu])) for gpu in ids"), "uuid"),
    Mutant("the whole environment returned",
           replace('return {"CUDA_VISIBLE_DEVICES": ",".join(str(gpu)',
                   'return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(gpu)'),
           "only cuda_visible_devices and cuda_device_order"),
], variants=[
    Variant("set() for duplicates, the parent's order inherited", '''
def visible_devices_env(ids):
    import os
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate GPU ids in {ids}")
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parent is None:
        for i in ids:
            if type(i) is not int or i < 0:
                raise ValueError(f"bad GPU id {i!r} in {ids}")
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids)), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    mine = parent.replace(" ", "").split(",")
    for i in ids:
        if type(i) is not int or not 0 <= i < len(mine):
            raise ValueError(f"GPU id {i!r}: this process sees {len(mine)} GPUs ({parent})")
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine[i] for i in ids)}
'''),
    Variant("one pass with a seen list, dict built step by step", '''
def visible_devices_env(ids):
    import os
    seen = []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    pool = listed.split(",") if listed is not None else None
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0 or i in seen:
            raise ValueError(f"GPU id {i!r} is not a new index >= 0 in {ids}")
        if pool is not None and i >= len(pool):
            raise ValueError(f"GPU id {i} but this process sees only {len(pool)} GPU(s)")
        seen.append(i)
    env = {}
    order = os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") if pool is not None else "PCI_BUS_ID"
    env["CUDA_DEVICE_ORDER"] = order
    env["CUDA_VISIBLE_DEVICES"] = ",".join(pool[i].strip() if pool is not None else f"{i}" for i in seen)
    return env
'''),
    Variant("the order decided first: nvidia-smi's for a whole machine, else this process's own", '''
def visible_devices_env(ids):
    import os
    subset = os.environ.get("CUDA_VISIBLE_DEVICES")
    order = "PCI_BUS_ID" if subset is None else os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    if len(set(ids)) != len(ids) or any(type(i) is not int or i < 0 for i in ids):
        raise ValueError(f"ids={ids}: each GPU once, as an int >= 0")
    entries = None if subset is None else [e.strip() for e in subset.split(",")]
    if entries is not None and any(i >= len(entries) for i in ids):
        raise ValueError(f"ids={ids}: this process sees {len(entries)} GPU(s) ({subset})")
    chosen = [str(i) if entries is None else entries[i] for i in ids]
    return dict(CUDA_VISIBLE_DEVICES=",".join(chosen), CUDA_DEVICE_ORDER=order)
'''),
])

SPECS = [PICK, STEP, VISIBLE]


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "01", NAMESPACE)
