"""Lesson 12's checks against named wrong answers made from the solution, and correct variants.

Every mutant is a solution cell of ``solutions/12_pipeline_schedules.ipynb`` with one
learner bug put in; its check must fail with words that name the bug. The 1F1B
orders are replayed on real ranks, so a wrong order shows as it would in a real
pipeline: a deadlock (with where each rank waits), the wrong micro-batch arriving,
or more micro-batches alive than 1F1B allows. Every variant is a correct answer
written differently; it must get full marks.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from mutation import ExerciseMutants, Mutant, Variant, mutant_tests, replace

pytestmark = pytest.mark.timeout(300)
NOTEBOOK = "12_pipeline_schedules.ipynb"
NAMESPACE = {"__name__": "__main__", "torch": torch, "nn": nn, "tdist": tdist}

ORDER = ExerciseMutants("12.one_f_one_b", NOTEBOOK, ("one_f_one_b",), mutants=[
    Mutant("a warm-up of n_stages forwards", replace("min(n_stages - rank - 1, n_micro)", "min(n_stages, n_micro)"),
           "alive at once"),
    Mutant("one warm-up forward too many (torch's count, then F and B in turn)",
           replace("min(n_stages - rank - 1, n_micro)", "min(n_stages - rank, n_micro)"), "alive at once"),
    Mutant("one warm-up forward too few (runs, but ranks idle)",
           replace("min(n_stages - rank - 1, n_micro)", "min(max(n_stages - rank - 2, 0), n_micro)"),
           ("idle", "gpipe's bubble")),
    Mutant("the warm-up counted from the wrong end (rank forwards)",
           replace("min(n_stages - rank - 1, n_micro)", "min(rank, n_micro)"),
           ("deadlock, found in bounded time", "rank 0 waits at b0")),
    Mutant("no shrink when n_micro < n_stages", replace("min(n_stages - rank - 1, n_micro)", "n_stages - rank - 1"),
           ("fewer micro-batches than stages", "2 micro-batch")),
    Mutant("the last backwards in reverse order",
           replace("range(n_micro - warmup, n_micro)]", "reversed(range(n_micro - warmup, n_micro))]"),
           "micro-batch"),
    Mutant("backward before forward in the steady phase",
           replace('[f"F{warmup + i}", f"B{i}"]', '[f"B{i}", f"F{warmup + i}"]'), "runs b0 before its forward"),
    Mutant("torch's own order", replace("    ### BEGIN SOLUTION\n", "    ### BEGIN SOLUTION\n"
                                        "    from torch.distributed.pipelining.schedules import _get_1f1b_rank_ops\n"
                                        "    _get_1f1b_rank_ops(1, n_stages, 1, 1, 1, rank, lambda s: rank, "
                                        "lambda s: rank)\n"),
           "_get_1f1b_rank_ops"),
], variants=[
    Variant("greedy: a forward while at most the warm-up's count are alive, else a backward", '''
def one_f_one_b(rank, n_stages, n_micro):
    limit = min(n_stages - rank - 1, n_micro)
    order, f, b = [], 0, 0
    while b < n_micro:
        if f < n_micro and f - b <= limit:
            order.append(f"F{f}")
            f += 1
        else:
            order.append(f"B{b}")
            b += 1
    return order
'''),
    Variant("three phases as slices of two lists", '''
def one_f_one_b(rank, n_stages, n_micro):
    fwd = ["F%d" % i for i in range(n_micro)]
    bwd = ["B%d" % i for i in range(n_micro)]
    w = max(0, min(n_micro, n_stages - 1 - rank))
    steady = [a for pair in zip(fwd[w:], bwd) for a in pair]
    return fwd[:w] + steady + bwd[n_micro - w:]
'''),
])

BUBBLE = ExerciseMutants("12.bubble", NOTEBOOK, ("bubble",), mutants=[
    Mutant("the closed formula for every schedule",
           replace("    ### BEGIN SOLUTION\n", "    ### BEGIN SOLUTION\n"
                                              "    return (n_stages - 1) / (n_micro + n_stages - 1)\n"),
           "closed formula"),
    Mutant("interleaved without its v stages per rank (not divided by v)",
           replace("torch_orders(schedule, p, m, virtual)", "torch_orders(schedule, p, m, 1)"),
           "closed formula (p-1)/(m+p-1)"),
    Mutant("zbv treated as 1f1b", replace('elif schedule == "1f1b":', 'elif schedule in ("1f1b", "zbv"):'),
           "zbv run as 1f1b"),
    Mutant("zbv's weight gradient run inside the input gradient",
           replace('times = {"F": t_f, "B": t_b + t_w, "I": t_b, "W": t_w}',
                   'times = {"F": t_f, "B": t_b + t_w, "I": t_b + t_w, "W": 0.0}'), "backward not split"),
    Mutant("idle over one rank's time, not all ranks'", replace("busy / (p * step)", "busy / step / 2"),
           "ranks x the step's length"),
    Mutant("a percentage", replace("return 1.0 - busy / (p * step)", "return 100 * (1.0 - busy / (p * step))"),
           "percentage"),
], variants=[
    Variant("closed forms where they hold, ZBV replayed event by event", '''
def bubble(schedule, n_stages, n_micro, t_f, t_b, t_w=0.0, virtual=1):
    import collections
    from mgpu_lab.parallel import pp_measure
    p, m = n_stages, n_micro
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    dur = {"F": t_f, "B": t_b + t_w} if schedule == "interleaved" else {"F": t_f, "I": t_b, "W": t_w}
    Act = collections.namedtuple("Act", "kind mb stage")
    queues = {r: [Act(a[0], int(a[1:a.index("/")]), int(a[a.index("/") + 2:])) for a in acts]
              for r, acts in pp_measure.torch_orders(schedule, p, m, virtual).items()}
    n = max(a.stage for q in queues.values() for a in q) + 1
    done, clock, busy = {}, [0.0] * p, 0.0
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while queues[r]:
                a = queues[r][0]
                k, i, s = a.kind, a.mb, a.stage
                deps = []
                if k == "F" and s > 0:
                    deps.append(("F", i, s - 1))
                if k in ("B", "I"):
                    deps.append(("F", i, s))
                    if s < n - 1:
                        deps.append(("I" if schedule == "zbv" else "B", i, s + 1))
                if k == "W":
                    deps.append(("I", i, s))
                if not all(d in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = done[(k, i, s)] = start + dur[k]
                busy += dur[k]
                queues[r].pop(0)
                progress = True
    return 1.0 - busy / (p * max(clock))
'''),
    Variant("time-stepped: each rank runs the first action whose inputs are ready", '''
def bubble(schedule, n_stages, n_micro, t_f, t_b, t_w=0.0, virtual=1):
    from mgpu_lab.parallel.pp_measure import torch_orders
    p, m = n_stages, n_micro
    def order(r):
        if schedule == "gpipe":
            return [("F", i, r) for i in range(m)] + [("B", i, r) for i in range(m)]
        if schedule == "1f1b":
            w = min(p - 1 - r, m)
            out = [("F", i, r) for i in range(w)]
            for i in range(m - w):
                out += [("F", w + i, r), ("B", i, r)]
            return out + [("B", i, r) for i in range(m - w, m)]
        import re
        acts = torch_orders(schedule, p, m, virtual)[r]
        return [(k, int(i), int(st)) for k, i, st in (re.fullmatch(r"([FBIW])(\\d+)/s(\\d+)", a).groups() for a in acts)]
    orders = [order(r) for r in range(p)]
    last = max(s for o in orders for *_, s in o)
    cost = {"F": t_f, "B": t_b + t_w, "I": t_b, "W": t_w}
    end, free, pos = {}, [0.0] * p, [0] * p
    def ready(k, i, s):
        if k == "F":
            return [] if s == 0 else [("F", i, s - 1)]
        if k == "W":
            return [("I", i, s)]
        nxt = [] if s == last else [("I", i, s + 1) if schedule == "zbv" else ("B", i, s + 1)]
        return [("F", i, s)] + nxt
    while any(pos[r] < len(orders[r]) for r in range(p)):
        for r in range(p):
            if pos[r] < len(orders[r]):
                k, i, s = orders[r][pos[r]]
                need = ready(k, i, s)
                if all(n in end for n in need):
                    end[(k, i, s)] = max([free[r]] + [end[n] for n in need]) + cost[k]
                    free[r] = end[(k, i, s)]
                    pos[r] += 1
    total = sum(cost[k] for o in orders for k, _, _ in o)
    return 1 - total / (p * max(free))
'''),
])

TRAIN = ExerciseMutants("12.pipeline_train", NOTEBOOK, ("pipeline_train",), mutants=[
    Mutant("the state not gathered on rank 0", replace("return {k: v for part in parts for k, v in part.items()}",
                                                       "return mine"), "lacks"),
    Mutant("interleaved stages side by side, not in a loop",
           replace("ids = [rank, rank + n_stages]", "ids = [2 * rank, 2 * rank + 1]"), "r + n_stages"),
    Mutant("zbv's stages in a loop, not a V", replace("ids = [rank, total - 1 - rank]", "ids = [rank, rank + n_stages]"),
           "2 x n_stages - 1 - r"),
    Mutant("stage k starts at layer k, not k x its length (stages overlap)",
           replace("list(model)[k * size:(k + 1) * size]", "list(model)[k:k + size]"), "equal runs of consecutive layers"),
    Mutant("gradients never cleared", replace("        optimizer.zero_grad()\n", ""), "clear the gradients"),
    Mutant("the micro-batch losses summed (scale_grads=False)",
           replace("loss_fn=loss_fn)", "loss_fn=loss_fn, scale_grads=False)", count=0), "divide by n_micro"),
    Mutant("the loss divided by n_micro, as torch's schedules do too (scaled twice)",
           replace("loss_fn = nn.MSELoss()", "loss_fn = lambda out, y: nn.functional.mse_loss(out, y) / n_micro"),
           ("divided by n_micro twice", "1/n_micro of one process's")),
    Mutant("zbv's stages listed last first", replace("ids = [rank, total - 1 - rank]", "ids = [total - 1 - rank, rank]"),
           ("scheduleZBVZeroBubble its stages in the order", "increasing order of their index")),
    Mutant("the library's pp_train.train", replace("    ### BEGIN SOLUTION\n", "    ### BEGIN SOLUTION\n"
                                                   "    from mgpu_lab.parallel.pp_train import train as lib\n"
                                                   "    return lib(model_fn, n_stages, schedule, n_micro, batches, "
                                                   "lr)\n"), "pp_train.train"),
], variants=[
    Variant("the schedule class by name, stages from a list of layers, all_gather_object", '''
def pipeline_train(model_fn, n_stages, schedule, n_micro, batches, lr):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    rank, world = tdist.get_rank(), tdist.get_world_size()
    model = model_fn()
    multi = schedule in ("interleaved", "zbv")
    total = 2 * world if multi else world
    size = len(model) // total
    mine_ids = [rank] if not multi else [rank, rank + world] if schedule == "interleaved" else [rank, total - 1 - rank]
    parts = {k: model[k * size:(k + 1) * size] for k in mine_ids}  # a slice keeps the layers and their names
    stages = [PipelineStage(parts[k], k, total, torch.device("cpu")) for k in mine_ids]
    names = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zbv": "ZBVZeroBubble"}
    cls = get_schedule_class(names[schedule])
    sched = cls(stages if multi else stages[0], n_micro, loss_fn=nn.MSELoss())
    params = [p for m in parts.values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=lr)
    for x, y in batches:
        for p in params:
            p.grad = None
        sched.step(*((x,) if 0 in mine_ids else ()), **({"target": y} if total - 1 in mine_ids else {}))
        opt.step()
    state = {name: t.clone() for m in parts.values() for name, t in m.state_dict().items()}
    everyone = [None] * world
    tdist.all_gather_object(everyone, state)
    return {k: v for part in everyone for k, v in part.items()} if rank == 0 else None
'''),
    Variant("sends of the state to rank 0 by tensors, stage lists from the stage count", '''
def pipeline_train(model_fn, n_stages, schedule, n_micro, batches, lr):
    import torch.distributed.pipelining as pp
    rank = tdist.get_rank()
    per_rank = 2 if schedule in ("interleaved", "zbv") else 1
    total = per_rank * n_stages
    layers = list(model_fn())
    per = len(layers) // total
    if schedule == "zbv":
        ids = sorted({rank, total - 1 - rank})
    else:
        ids = list(range(rank, total, n_stages))
    offsets = {k: k * per for k in ids}
    mods = {k: nn.Sequential(*layers[k * per:(k + 1) * per]) for k in ids}
    stages = [pp.PipelineStage(mods[k], k, total, torch.device("cpu")) for k in ids]
    kind = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B, "interleaved": pp.ScheduleInterleaved1F1B,
            "zbv": pp.ScheduleZBVZeroBubble}[schedule]
    run = kind(stages[0] if per_rank == 1 else stages, n_microbatches=n_micro, loss_fn=nn.functional.mse_loss)
    sgd = torch.optim.SGD([p for m in mods.values() for p in m.parameters()], lr=lr)
    for x, y in batches:
        sgd.zero_grad(set_to_none=False)
        if 0 in ids and total - 1 in ids:
            run.step(x, target=y)
        elif 0 in ids:
            run.step(x)
        elif total - 1 in ids:
            run.step(target=y)
        else:
            run.step()
        sgd.step()
    full = model_fn()
    for k, m in mods.items():
        for i, layer in enumerate(m):
            full[offsets[k] + i].load_state_dict(layer.state_dict())
    for k in range(total):
        owner = k if k < n_stages else (total - 1 - k if schedule == "zbv" else k - n_stages)
        for t in nn.Sequential(*list(full)[k * per:(k + 1) * per]).state_dict().values():
            if owner != 0:
                if rank == owner:
                    tdist.send(t.contiguous(), 0)
                elif rank == 0:
                    tdist.recv(t, owner)
    return full.state_dict() if rank == 0 else None
'''),
])

SPECS = [ORDER, BUBBLE, TRAIN]


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "12", NAMESPACE, at_once=4)
