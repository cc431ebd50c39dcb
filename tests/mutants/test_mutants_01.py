"""Lesson 01's checks against named wrong answers made from the solution, and correct variants.

Every mutant is the solution cell of ``solutions/01_devices.ipynb`` with one
learner bug put in; its check must fail with a message that names the bug.
Every variant is a correct answer written differently; it must get full marks.
"""
from __future__ import annotations

import pytest
import torch

from mutation import ExerciseMutants, Mutant, Variant, drop_statement, mutant_tests, replace, sub

pytestmark = pytest.mark.timeout(300)
NOTEBOOK = "01_devices.ipynb"
NAMESPACE = {"torch": torch}

PICK = ExerciseMutants("01.pick_device", NOTEBOOK, ("pick_device",), mutants=[
    Mutant("index ignored, always cuda:0",
           replace('return torch.device("cuda", index)', 'return torch.device("cuda", 0)'), "use the index"),
    Mutant("no CPU fallback",
           replace('torch.device("cuda", 0) if count else torch.device("cpu")', 'torch.device("cuda", 0)'),
           "torch.device('cpu')"),
    Mutant("torch.device('cuda') without an index for None",
           replace('torch.device("cuda", 0) if count', 'torch.device("cuda") if count'), "first visible gpu"),
    Mutant("strings instead of devices",
           (replace('return torch.device("cuda", index)', 'return f"cuda:{index}"'),
            replace('torch.device("cuda", 0) if count else torch.device("cpu")', '"cuda:0" if count else "cpu"')),
           ("torch.device", "str 'cpu'")),
    Mutant("index == count allowed (off by one)", replace("index < count", "index <= count"),
           ("pick_device(2)", "valid indices are 0 and 1")),
    Mutant("negative index allowed", replace("0 <= index < count", "index < count"), "pick_device(-1)"),
    Mutant("IndexError instead of ValueError", replace("raise ValueError", "raise IndexError"),
           ("valueerror", "indexerror")),
    Mutant("message does not name the visible count",
           replace("{count} GPU(s) are visible", "too few GPUs are visible"), ("pick_device(7)", "mentioning 2")),
    Mutant("explicit index without GPUs falls back to the CPU",
           replace("if index is None:", "if index is None or not count:"), "no gpu visible: pick_device(0)"),
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
                   "inputs = inputs.to(device)\n    labels.to(device)"), "returns a new tensor"),
    Mutant("model moved to 'cuda' (cuda:0)", replace("    optimizer.zero_grad()", '    model.to("cuda")\n    optimizer.zero_grad()'),
           ("model moved to ['cuda']",)),
    Mutant("no zero_grad", drop_statement("zero_grad"), "zero_grad"),
    Mutant("no optimizer.step()", drop_statement("optimizer.step"), ("optimizer.step()", "different weights")),
    Mutant("zero_grad between backward and step",
           (drop_statement("zero_grad"), replace("    optimizer.step()", "    optimizer.zero_grad()\n    optimizer.step()")),
           "in this order"),
    Mutant("the loss tensor returned", replace("return loss.item()", "return loss"), ("float", "tensor")),
    Mutant("loss recomputed after the step", replace("return loss.item()", "return loss_fn(model(inputs), labels).item()"),
           "before optimizer.step()"),
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

VISIBLE = ExerciseMutants("01.visible_devices_env", NOTEBOOK, ("visible_devices_env",), mutants=[
    Mutant("ids sorted", replace("str(gpu) for gpu in ids)", "str(gpu) for gpu in sorted(ids))"), "keep the order"),
    Mutant("spaces after the commas", replace('",".join', '", ".join'), ("no spaces", "'2, 3'")),
    Mutant("a list instead of a string", replace('",".join(str(gpu) for gpu in ids)', "ids"), "dict of str to str"),
    Mutant("only the first GPU", replace("for gpu in ids)", "for gpu in ids[:1])"), ("'2,3'", "'2'")),
    Mutant("the whole environment returned", replace("return {", 'return {**__import__("os").environ, '),
           "set only cuda_visible_devices"),
    Mutant("os.environ of this process set",
           replace("    return {", '    import os\n    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))\n'
                                  "    return {"), ("os.environ", "cuda_visible_devices")),
    Mutant("duplicate ids accepted", replace("if repeated:", "if False:"), "no id twice"),
    Mutant("negative ids accepted", replace(" or gpu < 0", ""), "int >= 0"),
    Mutant("bools accepted as ids", replace("isinstance(gpu, bool) or ", ""), "(not ints)"),
], variants=[
    Variant("set() for duplicates, map(str)", '''
def visible_devices_env(ids):
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate GPU ids in {ids}")
    for i in ids:
        if type(i) is not int or i < 0:
            raise ValueError(f"bad GPU id {i!r} in {ids}")
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))}
'''),
    Variant("one pass with a seen list, dict built step by step", '''
def visible_devices_env(ids):
    seen = []
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool):
            raise ValueError(f"{i!r} is not an int GPU index")
        if i < 0 or i in seen:
            raise ValueError(f"GPU id {i} is negative or repeated in {ids}")
        seen.append(i)
    env = {}
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["CUDA_VISIBLE_DEVICES"] = ",".join(f"{i}" for i in seen)
    return env
'''),
])

SPECS = [PICK, STEP, VISIBLE]


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "01", NAMESPACE)
