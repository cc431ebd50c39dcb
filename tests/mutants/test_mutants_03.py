"""Lesson 03's checks against named wrong answers made from the solution, and correct variants.

Every mutant is the solution cell of ``solutions/03_data_parallel.ipynb`` with
one learner bug put in; its check must fail with a message that names the bug.
Every variant is a correct answer written differently; it must get full marks.
``data_parallel_forward`` is judged on simulated GPUs, so the mutants that only
break on GPUs (a chunk never moved, ``torch.cat`` across devices) fail here too.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mgpu_lab.parallel.data_parallel import gather, parallel_apply, replicate, scatter
from mutation import ExerciseMutants, Mutant, Variant, cell_of, define, drop_statement, mutant_tests, replace

pytestmark = pytest.mark.timeout(300)
NOTEBOOK = "03_data_parallel.ipynb"
BASE = {"torch": torch, "nn": nn, "replicate": replicate, "parallel_apply": parallel_apply, "scatter": scatter,
        "gather": gather}
CHUNK = "torch.chunk(batch, n, dim=0)"

SPLIT = ExerciseMutants("03.split_batch", NOTEBOOK, ("split_batch",), mutants=[
    Mutant("torch.tensor_split (empty chunks)", replace(CHUNK, "torch.tensor_split(batch, n, dim=0)"),
           "tensor_split"),
    Mutant("torch.split(batch, n): chunks of n samples", replace(CHUNK, "torch.split(batch, n, dim=0)"),
           "torch.split(batch, n)"),
    Mutant("the last dimension split", replace("dim=0", "dim=-1"), "dim 0"),
    Mutant("chunks reversed", replace("dim=0))", "dim=0))[::-1]"), "batch order"),
    Mutant("no ValueError for n < 1", drop_statement("raise ValueError"), ("valueerror", "runtimeerror")),
    Mutant("n=1 refused", replace("if n < 1:", "if n <= 1:"), "n=1 is valid"),
    Mutant("floor-sized slices drop samples",
           replace(f"return list({CHUNK})", "size = len(batch) // n\n    return [batch[i * size:(i + 1) * size] "
                                            "for i in range(n)]"), "ceil(b / n)"),
    Mutant("strided chunks batch[i::n]", replace(f"return list({CHUNK})", "return [batch[i::n] for i in range(n)]"),
           "ceil(b / n)"),
], variants=[
    Variant("ceil-sized slices", '''
def split_batch(batch, n):
    if n < 1:
        raise ValueError(f"need at least one device, got n={n}")
    size = -(-len(batch) // n)
    return [batch[i:i + size] for i in range(0, len(batch), size)]
'''),
    Variant("Tensor.split with the ceil size", '''
def split_batch(batch, n):
    import math
    if not n >= 1:
        raise ValueError(f"n={n} devices: use n >= 1")
    return list(batch.split(math.ceil(batch.shape[0] / n)))
'''),
])

DP = ExerciseMutants("03.data_parallel_forward", NOTEBOOK, ("data_parallel_forward",), mutants=[
    Mutant("chunks never moved", replace("chunk.to(device) for chunk, device in", "chunk for chunk, device in"),
           ("devices[i]", "chunks on ['cpu', 'cpu', 'cpu']")),
    Mutant("every chunk moved to devices[0]", replace("chunk.to(device)", "chunk.to(devices[0])"),
           ("devices[i]", "chunks on ['cuda:0', 'cuda:0', 'cuda:0']")),
    Mutant("chunks moved with .cuda() (cuda:0)", replace("chunk.to(device)", "chunk.cuda()"),
           ("devices[i]", "chunks on ['cuda:0', 'cuda:0', 'cuda:0']")),
    Mutant("the whole batch to every replica", replace("split_batch(batch, len(devices))", "[batch] * len(devices)"),
           "never the whole batch"),
    Mutant("the original model runs every chunk", replace("replicate(model, used)", "[model] * len(used)"),
           ("own replica", "the original model ran 3 time(s)")),
    Mutant("replicas all made for devices[0]", replace("replicate(model, used)", "replicate(model, [devices[0]] * len(used))"),
           "a replica on cuda:0 ran a chunk on cuda:1"),
    Mutant("copy.deepcopy instead of replicate",
           (replace("replicate(model, used)", "[copy.deepcopy(model).to(d) for d in used]"),
            replace("    chunks = [", "    import copy\n    chunks = [")), ("copy.deepcopy", "missing")),
    Mutant("replicas made under torch.no_grad()",
           replace("    replicas = replicate(model, used)", "    with torch.no_grad():\n        replicas = replicate(model, used)"),
           "torch.no_grad()"),
    Mutant("torch.cat before moving the outputs",
           replace("torch.cat([out.to(devices[0]) for out in outputs], dim=0)", "torch.cat(list(outputs), dim=0).to(devices[0])"),
           ("torch.cat refuses", "cat was given tensors on cuda:0, cuda:1, cuda:2")),
    Mutant("gathered on the CPU", replace("out.to(devices[0])", "out.cpu()"), ("devices[0]", "the result on cpu")),
    Mutant("one replica per device, not per chunk", replace("used = devices[: len(chunks)]", "used = devices"),
           ("fewer chunks than devices", "as many replicas")),
], variants=[
    Variant("the library's scatter and gather", '''
def data_parallel_forward(model, batch, devices):
    chunks = scatter(batch, devices)
    used = devices[: len(chunks)]
    outs = parallel_apply(replicate(model, used), chunks, used)
    return gather(outs, devices[0])
'''),
    Variant("a plain loop, non_blocking moves", '''
def data_parallel_forward(model, batch, devices):
    outs = []
    pieces = split_batch(batch, len(devices))
    replicas = replicate(model, devices[: len(pieces)])
    for replica, piece, device in zip(replicas, pieces, devices):
        outs.append(replica(piece.to(device, non_blocking=True)).to(devices[0]))
    return torch.cat(outs)
'''),
    Variant("PyTorch's own pieces, as nn.DataParallel uses them on GPUs", '''
def data_parallel_forward(model, batch, devices):
    chunks = torch.nn.parallel.scatter(batch, devices)
    used = devices[: len(chunks)]
    replicas = torch.nn.parallel.replicate(model, used)
    outputs = torch.nn.parallel.parallel_apply(replicas, chunks, devices=used)
    return torch.nn.parallel.gather(outputs, devices[0])
'''),
])

SPECS = [SPLIT, DP]
# The forward cell calls the learner's split_batch: the solution's, as the notebook defines it.
NAMESPACE = {**BASE, "split_batch": define(cell_of(SPLIT), ("split_batch",), BASE)[0]}


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "03", NAMESPACE)
