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
    from mgpu_lab.pipelining.torch_orders import torch_orders
    p, m = n_stages, n_micro
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    dur = {"F": t_f, "B": t_b + t_w} if schedule == "interleaved" else {"F": t_f, "I": t_b, "W": t_w}
    Act = collections.namedtuple("Act", "kind mb stage")
    queues = {r: [Act(a[0], int(a[1:a.index("/")]), int(a[a.index("/") + 2:])) for a in acts]
              for r, acts in torch_orders(schedule, p, m, virtual).items()}
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
    from mgpu_lab.pipelining.torch_orders import torch_orders
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

SCHEDULE = ExerciseMutants("12.run_schedule", NOTEBOOK, ("run_schedule",), mutants=[
    Mutant("blocking sends (a rank waits in its send while its receiver waits for it)",
           (replace('sends.append(tdist.isend(out.detach(), placement[s + 1], tag=tag(s + 1, i, "F")))',
                    'tdist.send(out.detach(), placement[s + 1], tag=tag(s + 1, i, "F"))'),
            replace('sends.append(tdist.isend(x.grad, placement[s - 1], tag=tag(s - 1, i, "B")))',
                    'tdist.send(x.grad, placement[s - 1], tag=tag(s - 1, i, "B"))')),
           ("deadlock", "blocking send")),
    Mutant("one receive buffer reused across micro-batches",
           replace("x = torch.empty(known[s], dtype=like.dtype, device=like.device)",
                   'x = known.setdefault(("buffer", s), torch.empty(known[s], dtype=like.dtype, device=like.device))'),
           ("its own tensor", "received into the input tensor of micro-batch")),
    Mutant("activations never freed (kept in the dicts after their backward)",
           (replace("out = outs.pop((s, i))", "out = outs[s, i]"), replace("x = ins.pop((s, i))", "x = ins[s, i]")),
           ("held the activations of", "no longer")),
    Mutant("the losses summed, not averaged",
           (replace("(out / n_micro).backward()", "out.backward()"),
            replace("return sum(losses) / len(losses)", "return sum(losses)")),
           ("summed, not averaged", "the sum of the micro-batches' losses")),
    Mutant("the loss kept with its graph (a list of loss tensors, averaged at the end)",
           (replace("losses.append(out.item())", "losses.append(out)"),
            replace("return sum(losses) / len(losses)", "return float(sum(losses) / len(losses))")),
           ("held the activations of", "a list of losses")),
    Mutant("messages matched by their order (no tags)",
           (replace(', tag=tag(s, i, "F"))', ")"), replace(', tag=tag(s, i, "B"))', ")"),
            replace(', tag=tag(s + 1, i, "F")))', "))"), replace(', tag=tag(s - 1, i, "B")))', "))")),
           "whatever order the sender sent its messages in"),
    Mutant("a receive not waited for (irecv posted, its tensor used at once)",
           replace('tdist.recv(x, placement[s - 1], tag=tag(s, i, "F"))',
                   'tdist.irecv(x, placement[s - 1], tag=tag(s, i, "F"))'),
           ("irecv was receiving into", "non-blocking receive returns at once")),
    Mutant("the shape sent with every micro-batch",
           (replace("if s not in known:", "if True:"), replace("if s + 1 not in known:", "if True:")),
           ("message(s) to rank", "travels once")),
], variants=[
    Variant("tags from an index of every message, the shape padded to four numbers, gradients divided at the end", """
def run_schedule(stages, placement, actions, inputs, targets, loss_fn):
    me = tdist.get_rank()
    n = len(placement)
    m = 1 + max(i for _, _, i in actions)
    index = {key: k for k, key in enumerate((kind, s, i) for kind in "FB" for s in range(n) for i in range(m))}
    inp, res, grads_here, shapes, pending, total = {}, {}, {}, {}, [], 0.0
    for kind, s, i in actions:
        if kind == "F":
            src = placement[s - 1] if s else me
            if s == 0:
                a = inputs[i]
            elif src == me:
                a = res[(s - 1, i)].detach().requires_grad_(True)
            else:
                if s not in shapes:
                    dims = torch.zeros(4, dtype=torch.int64)
                    tdist.irecv(dims, src, tag=len(index) + s).wait()
                    shapes[s] = tuple(int(d) for d in dims if d > 0)
                a = torch.zeros(shapes[s])
                tdist.irecv(a, src, tag=index[("F", s, i)]).wait()
                a.requires_grad_(True)
            y = stages[s](a)
            if s == n - 1:
                y = loss_fn(y, targets[i])
                total += y.item()
            elif placement[s + 1] != me:
                if (s + 1) not in shapes:
                    shapes[s + 1] = tuple(y.shape)
                    dims = torch.tensor(list(y.shape) + [0] * (4 - y.dim()))
                    pending.append(tdist.isend(dims, placement[s + 1], tag=len(index) + s + 1))
                pending.append(tdist.isend(y.detach().clone(), placement[s + 1], tag=index[("F", s + 1, i)]))
            inp[(s, i)], res[(s, i)] = a, y
        else:
            y = res.pop((s, i))
            if s == n - 1:
                g = None
            elif placement[s + 1] == me:
                g = grads_here.pop((s, i))
            else:
                g = torch.zeros_like(y)
                tdist.irecv(g, placement[s + 1], tag=index[("B", s, i)]).wait()
            torch.autograd.backward(y, g)
            del y
            a = inp.pop((s, i))
            if s > 0:
                if placement[s - 1] == me:
                    grads_here[(s - 1, i)] = a.grad
                else:
                    pending.append(tdist.isend(a.grad, placement[s - 1], tag=index[("B", s - 1, i)]))
            del a
        pending = [w for w in pending if not w.is_completed()]
    for w in pending:
        w.wait()
    for module in stages.values():
        for p in module.parameters():
            if p.grad is not None:
                p.grad /= m
    return total / m if (n - 1) in stages else None
"""),
    Variant("an executor class: a mailbox per message key, receives posted when the action comes", """
class _Executor:
    def __init__(self, stages, placement, n_micro):
        self.stages, self.placement, self.m = stages, placement, n_micro
        self.rank = tdist.get_rank()
        self.saved, self.local, self.shape, self.works = {}, {}, {}, []

    def key(self, direction, boundary, i):
        return (boundary * self.m + i) * 2 + (direction == "down")

    def get(self, direction, boundary, i, peer, like=None):
        if like is None:
            if boundary not in self.shape:
                header = torch.zeros(6, dtype=torch.int64)
                tdist.irecv(header, peer, tag=10 ** 6 + boundary).wait()
                self.shape[boundary] = tuple(int(v) for v in header[1:1 + int(header[0])])
            buf = torch.empty(self.shape[boundary])
        else:
            buf = torch.empty_like(like)
        tdist.irecv(buf, peer, tag=self.key(direction, boundary, i)).wait()
        return buf

    def put(self, tensor, direction, boundary, i, peer, with_shape=False):
        if with_shape:
            dims = list(tensor.shape)
            self.works.append(tdist.isend(torch.tensor([len(dims)] + dims + [0] * (5 - len(dims))), peer,
                                          tag=10 ** 6 + boundary))
        self.works.append(tdist.isend(tensor.detach().contiguous(), peer, tag=self.key(direction, boundary, i)))

    def forward(self, s, i, inputs, targets, loss_fn, losses):
        last = len(self.placement) - 1
        if s == 0:
            x = inputs[i]
        elif (s - 1) in self.stages:
            x = self.local.pop(("act", s, i)).requires_grad_()
        else:
            x = self.get("up", s, i, self.placement[s - 1]).requires_grad_()
        y = self.stages[s](x)
        if s == last:
            y = loss_fn(y, targets[i]) / self.m
            losses.append(float(y) * self.m)
        elif (s + 1) in self.stages:
            self.local[("act", s + 1, i)] = y.detach()
        else:
            self.put(y, "up", s + 1, i, self.placement[s + 1], with_shape=(s + 1) not in self.shape)
            self.shape.setdefault(s + 1, tuple(y.shape))
        self.saved[(s, i)] = (x, y)

    def backward(self, s, i):
        x, y = self.saved.pop((s, i))
        last = len(self.placement) - 1
        if s == last:
            y.backward()
        elif (s + 1) in self.stages:
            y.backward(self.local.pop(("grad", s, i)))
        else:
            y.backward(self.get("down", s, i, self.placement[s + 1], like=y))
        if s > 0 and (s - 1) in self.stages:
            self.local[("grad", s - 1, i)] = x.grad
        elif s > 0:
            self.put(x.grad, "down", s - 1, i, self.placement[s - 1])


def run_schedule(stages, placement, actions, inputs, targets, loss_fn):
    n_micro = len({i for _, _, i in actions})
    ex = _Executor(stages, placement, n_micro)
    losses = []
    for kind, s, i in actions:
        if kind == "F":
            ex.forward(s, i, inputs, targets, loss_fn, losses)
        else:
            ex.backward(s, i)
    for w in ex.works:
        w.wait()
    return sum(losses) / n_micro if len(placement) - 1 in stages else None
"""),
])

SPECS = [SCHEDULE, ORDER, BUBBLE]


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "12", NAMESPACE, at_once=4)
