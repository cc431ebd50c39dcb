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
import torch.distributed as tdist
from torch import nn

from mutation import ExerciseMutants, Mutant, Variant, drop_statement, mutant_tests, replace, sub

pytestmark = pytest.mark.timeout(300)
NOTEBOOK = "06_model_parallel.ipynb"
NAMESPACE = {"__name__": "__main__", "torch": torch, "nn": nn, "tdist": tdist}

STAGE = ExerciseMutants("06.stage_step", NOTEBOOK, ("stage_step",), mutants=[
    Mutant("the received activations do not require grad", drop_statement("h.requires_grad_()"), "requires grad"),
    Mutant("rank 0's backward from ones, not the received gradient", replace("h.backward(grad)", "h.sum().backward()"),
           "rank 1's stage and losses are right but rank 0's stage is not"),
    Mutant("rank 1 sends the activations back, not their gradient",
           replace("tdist.send(h.grad.contiguous(), dst=0)", "tdist.send(h.detach().contiguous(), dst=0)"),
           "rank 1's stage and losses are right but rank 0's stage is not"),
    Mutant("zero_grad never called", drop_statement("optimizer.zero_grad()"), "never clears the gradients"),
    Mutant("rank 0 never steps", replace("        optimizer.step()\n        return None", "        return None"),
           "rank 0's stage (the first) never changed"),
    Mutant("the loss returned as a tensor", replace("return loss.item()", "return loss"),
           ("rank 1 returned a tensor", "python float")),
    Mutant("the receive buffer made without device= (a CPU tensor beside a GPU stage)",
           replace("h = torch.empty(act_shape, device=device)", "h = torch.empty(act_shape)"),
           ("receive buffer made without device=", "received into a tensor on cpu")),
    Mutant("rank 0's gradient buffer made without device=",
           replace("grad = torch.empty_like(h)", "grad = torch.empty(h.shape)"),
           ("receive buffer made without device=", "rank 0 (stage on cuda:0) received into a tensor on cpu")),
    Mutant("the labels not moved to the stage's device", replace("target.to(device)", "target"),
           ("labels must be where the output is", "the labels reached the loss on cpu")),
    Mutant("x not moved to the stage's device", replace("h = stage(x.to(device))", "h = stage(x)"),
           ("device of its parameters", "x on cpu")),
    Mutant("torch's PipelineStage", replace("    ### BEGIN SOLUTION\n", "    ### BEGIN SOLUTION\n"
                                             "    from torch.distributed.pipelining import PipelineStage\n"
                                             "    PipelineStage(stage, tdist.get_rank(), 2, torch.device('cpu'))\n"),
           "torch.distributed.pipelining.stage.pipelinestage"),
], variants=[
    Variant("roles from the arguments, isend/irecv, torch.autograd.grad", '''
def stage_step(stage, x, target, loss_fn, optimizer, act_shape):
    dev = next(stage.parameters()).device
    params = list(stage.parameters())
    for p in params:
        p.grad = None
    if target is None:  # the first stage
        out = stage(x.to(dev))
        tdist.isend(out.detach(), 1).wait()
        g = torch.zeros(out.shape, device=dev)
        tdist.irecv(g, 1).wait()
        torch.autograd.backward(out, g)
        optimizer.step()
        return None
    buf = torch.zeros(act_shape, device=dev)
    tdist.irecv(buf, 0).wait()
    act = buf.clone().requires_grad_(True)
    loss = loss_fn(stage(act), target.to(dev))
    grads = torch.autograd.grad(loss, [act] + params)
    tdist.isend(grads[0].contiguous(), 0).wait()
    for p, g in zip(params, grads[1:]):
        p.grad = g
    optimizer.step()
    return float(loss)
'''),
    Variant("backward(inputs=...), set_to_none=False, the rank from get_rank", '''
def stage_step(stage, x, target, loss_fn, optimizer, act_shape):
    rank, dev = tdist.get_rank(), next(stage.parameters()).device
    optimizer.zero_grad(set_to_none=False)
    if rank == 1:
        h = torch.empty(act_shape, device=dev)
        tdist.recv(h, src=0)
        h.requires_grad = True
        loss = loss_fn(stage(h), target.to(dev))
        loss.backward(inputs=[h, *stage.parameters()])
        tdist.send(h.grad, dst=0)
        optimizer.step()
        return loss.detach().item()
    out = stage(x.to(dev))
    tdist.send(out.detach(), dst=1)
    back = torch.empty_like(out)
    tdist.recv(back, src=1)
    out.backward(back)
    optimizer.step()
'''),
])

PIPELINED = ExerciseMutants("06.pipelined_step", NOTEBOOK, ("pipelined_step",), mutants=[
    Mutant("micro-batches never moved to stage1's device", replace("stage1(xs.to(d1))", "stage1(xs)"),
           ("a micro-batch reached stage1 on cpu", "device of the parameters")),
    Mutant("activations never moved to stage2's device", replace("stage1(xs.to(d1)).to(d2)", "stage1(xs.to(d1))"),
           ("the activations reached stage2 on cuda:2", "device of the parameters")),
    Mutant("labels left on the CPU", replace("ys.to(out.device)", "ys"),
           ("the labels reached the loss on cpu", "where the output is")),
    Mutant("devices hard-coded as 'cpu'",
           replace("d1, d2 = next(stage1.parameters()).device, next(stage2.parameters()).device",
                   'd1, d2 = torch.device("cpu"), torch.device("cpu")'),
           ("reached stage1 on cpu", "device of the parameters")),
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

R1_LOOP = """        h = torch.empty((len(ys), *act_shape[1:]), device=device)
        tdist.recv(h, src=0)
"""

PIPELINE = ExerciseMutants("06.pipeline_step", NOTEBOOK, ("pipeline_step",), mutants=[
    # a hang the recorder reports at once (before 2026-11-30 only at the check's bound, 30 s: see comm.record)
    Mutant("rank 1 cuts n_micro pieces of act_shape[0] rows (torch.chunk may make fewer): a hang",
           replace("pieces = torch.chunk(target, n_micro)",
                   "pieces = [target[i * act_shape[0]:(i + 1) * act_shape[0]] for i in range(n_micro)]"),
           ("the ranks waited for each other", "6 rows, n_micro=4")),
    Mutant("rank 0 computes every forward before its first send",
           (replace("            sends.append(tdist.isend(h.detach().contiguous(), dst=1))", ""),
            replace("        for h in outs:  # the backwards",
                    "        sends = [tdist.isend(h.detach().contiguous(), dst=1) for h in outs]\n"
                    "        for h in outs:  # the backwards")),
           ("never computed at the same time", "rank 0 had sent nothing when it began its last forward")),
    Mutant("rank 1 receives every micro-batch before its first forward",
           replace("    for ys in pieces:\n" + R1_LOOP,
                   "    received = []\n    for ys in pieces:\n"
                   "        received.append(torch.empty((len(ys), *act_shape[1:]), device=device))\n"
                   "        tdist.recv(received[-1], src=0)\n"
                   "    for ys, h in zip(pieces, received):\n"),
           ("never computed at the same time", "rank 1 had asked for all 4 micro-batches' activations")),
    Mutant("rank 1 runs each micro-batch's backward right after its forward",
           replace("        inputs.append(h)\n    for h, loss in zip(inputs, losses):\n        loss.backward()\n",
                   "        inputs.append(h)\n        losses[-1].backward()\n"
                   "    for h, loss in zip(inputs, losses):\n"),
           "rank 1 began a backward before its last forward"),
    Mutant("micro-batch losses unweighted", replace(" * (len(ys) / len(target))", ""),
           "the sum of the micro-batches' mean losses"),
    Mutant("every micro-batch weighted 1/n_micro", replace("(len(ys) / len(target))", "(1 / n_micro)"),
           "every micro-batch weighs 1/n_micro"),
    Mutant("every receive buffer of act_shape, the smaller last micro-batch's too",
           replace("h = torch.empty((len(ys), *act_shape[1:]), device=device)",
                   "h = torch.empty(act_shape, device=device)"),
           ("10 rows, n_micro=4", "larger than the tensor it receives into")),
    Mutant("rank 1 sends the gradients back in reverse order",
           replace("for h, loss in zip(inputs, losses):", "for h, loss in reversed(list(zip(inputs, losses))):"),
           "rank 1's stage and losses are right but rank 0's stage is not"),
    Mutant("each micro-batch's size sent ahead of it",
           (replace("            h = stage(xs.to(device))\n",
                    "            h = stage(xs.to(device))\n"
                    "            tdist.send(torch.tensor([len(xs)], device=device), dst=1)\n"),
            replace(R1_LOOP, "        rows = torch.zeros(1, dtype=torch.long, device=device)\n"
                             "        tdist.recv(rows, src=0)\n"
                             "        h = torch.empty((int(rows), *act_shape[1:]), device=device)\n"
                             "        tdist.recv(h, src=0)\n")),
           ("rank 0 sent 8 message(s)", "for 4 micro-batches")),
    Mutant("zero_grad never called", drop_statement("optimizer.zero_grad()"), "never clears the gradients"),
    Mutant("the loss returned as the mean of the micro-batch losses",
           replace("return sum(loss.item() for loss in losses)",
                   "return sum(loss.item() * len(target) / len(ys) for loss, ys in zip(losses, pieces)) / len(pieces)"),
           "the value returned is not the step's loss"),
    Mutant("the receive buffer made without device= (a CPU tensor beside a GPU stage)",
           replace("h = torch.empty((len(ys), *act_shape[1:]), device=device)",
                   "h = torch.empty((len(ys), *act_shape[1:]))"),
           ("receive buffer made without device=", "rank 1 (stage on cuda:1) received into a tensor on cpu")),
    Mutant("rank 0's gradient buffer made on the CPU",
           replace("grad = torch.empty_like(h)", "grad = torch.empty(h.shape)"),
           ("receive buffer made without device=", "rank 0 (stage on cuda:0) received into a tensor on cpu")),
], variants=[
    Variant("blocking sends, every receive posted at once, autograd.grad, backwards in reverse order", """
def pipeline_step(stage, x, target, loss_fn, optimizer, act_shape, n_micro):
    dev = next(stage.parameters()).device
    params = list(stage.parameters())
    for p in params:
        p.grad = None
    if target is None:  # the first stage
        outs = []
        for xs in x.chunk(n_micro):
            out = stage(xs.to(dev))
            tdist.send(out.detach(), 1)
            outs.append(out)
        for out in reversed(outs):
            g = torch.zeros(out.shape, device=dev)
            tdist.recv(g, 1)
            out.backward(g)
        optimizer.step()
        return None
    pieces = target.chunk(n_micro)
    bufs = [torch.zeros((len(ys), *act_shape[1:]), device=dev) for ys in pieces]
    works = [tdist.irecv(b, 0) for b in bufs]
    acts, losses = [], []
    for b, work, ys in zip(bufs, works, pieces):
        work.wait()
        a = b.requires_grad_()
        acts.append(a)
        losses.append(loss_fn(stage(a), ys.to(dev)) * len(ys) / len(target))
    for a, loss in zip(reversed(acts), reversed(losses)):
        grads = torch.autograd.grad(loss, [a] + params)
        tdist.send(grads[0].contiguous(), 0)
        for p, g in zip(params, grads[1:]):
            p.grad = g if p.grad is None else p.grad + g
    optimizer.step()
    return float(sum(loss.detach() for loss in losses))
"""),
    Variant("one backward per rank over every micro-batch, sizes from act_shape, losses summed then divided", """
def pipeline_step(stage, x, target, loss_fn, optimizer, act_shape, n_micro):
    rank, dev = tdist.get_rank(), next(stage.parameters()).device
    optimizer.zero_grad(set_to_none=False)
    if rank == 0:
        outs, pending = [], []
        for xs in torch.chunk(x, n_micro):
            out = stage(xs.to(dev))
            pending.append(tdist.isend(out.detach().contiguous(), dst=1))
            outs.append(out)
        grads = [torch.empty_like(o) for o in outs]
        for g in grads:
            tdist.irecv(g, src=1).wait()
        torch.autograd.backward(outs, grads)
        for work in pending:
            work.wait()
        optimizer.step()
        return None
    rows, acts, total = act_shape[0], [], 0
    for start in range(0, len(target), rows):  # torch.chunk's pieces: all of act_shape[0] rows but the last
        ys = target[start:start + rows].to(dev)
        a = torch.empty((len(ys),) + tuple(act_shape[1:]), device=dev)
        tdist.recv(a, src=0)
        a.requires_grad_(True)
        total = total + loss_fn(stage(a), ys) * len(ys)
        acts.append(a)
    total = total / len(target)
    total.backward()
    for a in acts:
        tdist.send(a.grad, dst=0)
    optimizer.step()
    return total.item()
"""),
])

BUBBLE = ExerciseMutants("06.bubble_fraction", NOTEBOOK, ("bubble_fraction",), mutants=[
    Mutant("GPipe's formula whatever the times",
           replace("    return 1 - busy / (p * step)", "    return (p - 1) / (m + p - 1)"),
           "gpipe's formula for equal stages and free transfers"),
    Mutant("transfers one way only", replace("2 * (p - 1) * transfer", "(p - 1) * transfer"),
           "transfers counted in one direction only"),
    Mutant("the mean stage sets the pace",
           replace("(max(forward) + max(backward))", "(sum(forward) + sum(backward)) / p"),
           "it is the slowest stage"),
    Mutant("m micro-batches at the slowest pace", replace("(m - 1) * (max", "m * (max"), "m - 1 follow it"),
    Mutant("the busy time not shared among the stages", replace("busy / (p * step)", "busy / step"),
           "over p stages' time"),
    Mutant("a percentage", replace("return 1 - busy / (p * step)", "return 100 * (1 - busy / (p * step))"),
           "not a percentage"),
    Mutant("mismatched stages accepted", drop_statement("one time per stage"), "describe no pipeline"),
    Mutant("bools accepted", replace("isinstance(n_micro, bool) or ", ""), "true is an int in python"),
], variants=[
    Variant("the schedule simulated span by span", '''
def bubble_fraction(forward, backward, n_micro, transfer=0.0):
    p = len(forward)
    if p == 0 or len(backward) != p or type(n_micro) is not int or n_micro < 1:
        raise ValueError("one time per stage in forward and backward, and an int n_micro >= 1")
    free, done = [0.0] * p, {}
    for phase, order, times in (("F", range(p), forward), ("B", range(p - 1, -1, -1), backward)):
        for i in range(n_micro):
            for s in order:
                before = (phase, s - 1 if phase == "F" else s + 1, i)
                start = max(free[s], done[before] + transfer if before in done else 0.0)
                done[phase, s, i] = free[s] = start + times[s]
    step = max(free)
    return sum(step - n_micro * (f + b) for f, b in zip(forward, backward)) / (p * step)
'''),
    Variant("the schedule simulated with backward in reverse micro-batch order: the same idle time", '''
def bubble_fraction(forward, backward, n_micro, transfer=0.0):
    # GPipe runs backward in micro-batch order; with equal micro-batches every order of a phase gives the same
    # spans' lengths and the same step time, so this answer's value is GPipe's (the check accepts it)
    p = len(forward)
    if p == 0 or len(backward) != p or type(n_micro) is not int or n_micro < 1:
        raise ValueError("one time per stage in forward and backward, and an int n_micro >= 1")
    free, done = [0.0] * p, {}
    for phase, order, times in (("F", range(p), forward), ("B", range(p - 1, -1, -1), backward)):
        for i in (range(n_micro) if phase == "F" else range(n_micro - 1, -1, -1)):
            for s in order:
                before = (phase, s - 1 if phase == "F" else s + 1, i)
                start = max(free[s], done[before] + transfer if before in done else 0.0)
                done[phase, s, i] = free[s] = start + times[s]
    step = max(free)
    return sum(step - n_micro * (f + b) for f, b in zip(forward, backward)) / (p * step)
'''),
    Variant("per phase: the first micro-batch's trip plus the bottleneck", '''
def bubble_fraction(forward, backward, n_micro, transfer=0.0):
    import numbers
    if not forward or len(forward) != len(backward):
        raise ValueError(f"{len(forward)} forward times but {len(backward)} backward times")
    if not isinstance(n_micro, numbers.Integral) or isinstance(n_micro, bool) or n_micro < 1:
        raise ValueError(f"n_micro must be a whole number >= 1, got {n_micro!r}")
    links = len(forward) - 1
    phase = [sum(t) + links * transfer + (n_micro - 1) * max(t) for t in (forward, backward)]
    work = [n_micro * (f + b) for f, b in zip(forward, backward)]
    return float(sum(1 - w / sum(phase) for w in work) / len(work))
'''),
])

SPECS = [PIPELINE, STAGE, PIPELINED, BUBBLE]  # the answers that wait longest first (at_once)


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "06", NAMESPACE, at_once=4)
