"""Lesson 03's checks against named wrong answers made from the solution, and correct variants.

Every mutant is the solution cell of ``solutions/03_data_parallel.ipynb`` with
one learner bug put in; its check must fail with a message that names the bug.
Every variant is a correct answer written differently; it must get full marks.
Both exercises are judged on simulated GPUs, so the mutants that only break on
GPUs (a buffer left on cuda:0, a chunk never moved, ``torch.cat`` across devices)
fail here too.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mgpu_lab.parallel.dp_tools import parallel_apply
from mutation import ExerciseMutants, Mutant, Variant, cell_of, define, mutant_tests, replace

pytestmark = pytest.mark.timeout(300)
NOTEBOOK = "03_data_parallel.ipynb"
BASE = {"torch": torch, "nn": nn, "parallel_apply": parallel_apply}
TO = "param.to(device))"

REPLICATE = ExerciseMutants("03.replicate", NOTEBOOK, ("replicate",), mutants=[
    Mutant("the model itself for every device", replace("replicas.append(copies[module])", "replicas.append(module)"),
           ("replica 1: parameter inp.weight on cuda:0", "the model's own")),
    Mutant("parameters detached", replace(TO, "param.detach().to(device))"),
           ("do not require gradients", "the model's .grad is none")),
    Mutant("new leaf nn.Parameter copies", replace(TO, "torch.nn.Parameter(param.to(device)))"),
           ("leaves of their own", "the model's .grad is none")),
    Mutant("every replica on devices[0]", replace(TO, "param.to(devices[0]))"),
           "replica 1: parameter inp.weight on cuda:0"),
    Mutant("buffers left on the model's device", replace("buf.to(device)", "buf"),
           ("buffer block.1.scale on cuda:0", "buffers")),
    Mutant("nested modules shared with the model", replace("None if child is None else copies[child]", "child"),
           ("replica 0's block is the model's own", "shared with the model")),
    Mutant("the model itself moved to each device",
           replace("    for device in devices:\n", "    for device in devices:\n        module.to(device)\n"),
           ("the model is left as it was", "the model's inp.weight is now on cuda:2")),
    Mutant("device names from indices (cuda:i)",
           replace("for device in devices:", "for i, _ in enumerate(devices):\n        device = f'cuda:{i}'"),
           "replica 1: parameter inp.weight on cuda:1"),
    Mutant("torch's per-module replicate (Module._replicate_for_data_parallel)",
           replace("copies = {m: copy.copy(m) for m in module.modules()}",
                   "copies = {m: m._replicate_for_data_parallel() for m in module.modules()}"),
           "your code calls torch.nn.modules.module.module._replicate_for_data_parallel"),
], variants=[
    Variant("a recursive copy of each module's __dict__, linked parameters set as attributes", '''
def replicate(module, devices):
    def copy_tree(m, device):
        r = m.__class__.__new__(m.__class__)
        r.__dict__ = dict(m.__dict__)
        r._parameters = {}
        r._buffers = {k: None if b is None else b.to(device) for k, b in m._buffers.items()}
        r._modules = {k: None if c is None else copy_tree(c, device) for k, c in m._modules.items()}
        for k, p in m._parameters.items():
            object.__setattr__(r, k, None if p is None else p.to(device))
        return r
    return [copy_tree(module, d) for d in devices]
'''),
    Variant("deep copy, then every parameter swapped for a linked copy", '''
def replicate(module, devices):
    import copy
    replicas = []
    for device in devices:
        replica = copy.deepcopy(module)
        for (_, mine), (_, theirs) in zip(replica.named_modules(), module.named_modules()):
            for key, param in theirs._parameters.items():
                del mine._parameters[key]
                setattr(mine, key, None if param is None else param.to(device))
            for key, buf in theirs._buffers.items():
                mine._buffers[key] = None if buf is None else buf.to(device)
        replicas.append(replica)
    return replicas
'''),
    Variant("a broadcast Function: copies forward, gradients brought back and added in backward", '''
class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, devices, *params):
        ctx.sources, ctx.n = [p.device for p in params], len(params)
        return tuple(p.to(d) for d in devices for p in params)

    @staticmethod
    def backward(ctx, *grads):
        sums = []
        for i, source in enumerate(ctx.sources):
            mine = [g.to(source) for g in grads[i::ctx.n] if g is not None]
            sums.append(sum(mine) if mine else None)
        return (None, *sums)


def replicate(module, devices):
    import copy
    params = [p for m in module.modules() for p in m._parameters.values() if p is not None]
    copies, n, replicas = Broadcast.apply(list(devices), *params), len(params), []
    for k, device in enumerate(devices):
        mine = dict(zip(map(id, params), copies[k * n:(k + 1) * n]))
        new = {m: copy.copy(m) for m in module.modules()}
        for old, rep in new.items():
            rep._modules = {a: None if b is None else new[b] for a, b in old._modules.items()}
            rep._buffers = {a: None if b is None else b.to(device) for a, b in old._buffers.items()}
            rep._parameters = {}
            for a, p in old._parameters.items():
                setattr(rep, a, None if p is None else mine[id(p)])
        replicas.append(new[module])
    return replicas
'''),
])

DP = ExerciseMutants("03.data_parallel_forward", NOTEBOOK, ("data_parallel_forward",), mutants=[
    Mutant("chunks never moved", replace("chunk.to(device) for chunk, device in", "chunk for chunk, device in"),
           ("chunks on ['cpu', 'cpu', 'cpu']",)),
    Mutant("every chunk moved to devices[0]", replace("chunk.to(device)", "chunk.to(devices[0])"),
           ("chunks on ['cuda:0', 'cuda:0', 'cuda:0']",)),
    Mutant("chunks moved with .cuda() (cuda:0)", replace("chunk.to(device)", "chunk.cuda()"),
           ("chunks on ['cuda:0', 'cuda:0', 'cuda:0']",)),
    Mutant("the whole batch to every replica", replace("torch.chunk(batch, len(devices))", "[batch] * len(devices)"),
           "never the whole batch"),
    Mutant("the original model runs every chunk", replace("replicate(model, used)", "[model] * len(used)"),
           ("own replica", "the original model ran 3 time(s)")),
    Mutant("replicas all made for devices[0]",
           replace("replicate(model, used)", "replicate(model, [devices[0]] * len(used))"),
           "a replica on cuda:0 ran a chunk on cuda:1"),
    Mutant("copy.deepcopy instead of replicate",
           (replace("replicate(model, used)", "[copy.deepcopy(model).to(d) for d in used]"),
            replace("    chunks = [", "    import copy\n    chunks = [")), ("deep copy", "gradients: missing")),
    Mutant("replicas made under torch.no_grad()",
           replace("    replicas = replicate(model, used)",
                   "    with torch.no_grad():\n        replicas = replicate(model, used)"), "torch.no_grad()"),
    Mutant("torch.cat before moving the outputs",
           replace("torch.cat([out.to(devices[0]) for out in outputs], dim=0)",
                   "torch.cat(list(outputs), dim=0).to(devices[0])"),
           ("torch.cat refuses", "cat was given tensors on cuda:0, cuda:1, cuda:2")),
    Mutant("gathered on the CPU", replace("out.to(devices[0])", "out.cpu()"), ("devices[0]", "the result on cpu")),
    Mutant("one replica per device, not per chunk", replace("used = devices[: len(chunks)]", "used = devices"),
           ("fewer chunks than devices", "as many replicas")),
    Mutant("PyTorch's scatter and gather", (
        replace("chunks = [chunk.to(device) for chunk, device in zip(torch.chunk(batch, len(devices)), devices)]",
                "chunks = torch.nn.parallel.scatter(batch, devices)"),
        replace("torch.cat([out.to(devices[0]) for out in outputs], dim=0)",
                "torch.nn.parallel.gather(outputs, devices[0])")), "your code calls torch.nn.parallel"),
], variants=[
    Variant("a plain loop, non_blocking moves", '''
def data_parallel_forward(model, batch, devices):
    outs = []
    pieces = batch.chunk(len(devices))
    replicas = replicate(model, devices[: len(pieces)])
    for replica, piece, device in zip(replicas, pieces, devices):
        outs.append(replica(piece.to(device, non_blocking=True)).to(devices[0]))
    return torch.cat(outs)
'''),
    Variant("ceil-sized slices, threads, outputs moved in a second pass", '''
def data_parallel_forward(model, batch, devices):
    size = -(-len(batch) // len(devices))
    chunks = [batch[i:i + size] for i in range(0, len(batch), size)]
    used = devices[: len(chunks)]
    outputs = parallel_apply(replicate(model, used), [c.to(d) for c, d in zip(chunks, used)], used)
    gathered = [o.to(devices[0]) for o in outputs]
    return torch.cat(gathered, dim=0)
'''),
])

SPECS = [REPLICATE, DP]
# The forward cell calls the learner's replicate: the solution's, as the notebook defines it.
NAMESPACE = {**BASE, "replicate": define(cell_of(REPLICATE), ("replicate",), BASE)[0]}


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "03", NAMESPACE)
