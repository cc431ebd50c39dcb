"""What lesson 12's checks run: the learner's 1F1B orders replayed on real ranks, bubbles, pipeline training.

:func:`probe_orders` asks the learner's ``one_f_one_b`` for every rank's order in
each scenario and replays the orders on real ranks (gloo): a forward receives the
activations from the previous rank with a blocking receive (``irecv`` waited with
a timeout, so a deadlock ends in bounded time with each rank saying where it
waits) and sends its own with ``isend``; a backward does the same with gradients
the other way. Every message carries its micro-batch's number, so ranks whose
orders disagree are caught at the first message. The evidence per scenario:
the orders, whether they ran to the end (or where each rank waited), the
gradients against one process's, and the most micro-batches alive at once per
rank. :func:`orders_of` calls the learner's function for many depths in one
process; :func:`probe_train` runs ``pipeline_train`` for each schedule in one launch.
"""
from __future__ import annotations

import datetime
import threading
from contextlib import contextmanager

import torch
import torch.distributed as tdist
from torch import nn

RECV_TIMEOUT = 3.0  # seconds a replayed receive waits before the rank reports that it waits there
WIDTH, ROWS = 4, 2  # the replay's stage width and rows per micro-batch


_SEEDED = threading.Lock()  # seed and build as one step: a checker process may judge several answers in threads


def _model(n_stages: int) -> list[nn.Module]:
    with _SEEDED:
        torch.manual_seed(12)
        return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n_stages)]


def _data(n_micro: int):
    g = torch.Generator().manual_seed(n_micro)
    return torch.randn(n_micro * ROWS, WIDTH, generator=g), torch.randn(n_micro * ROWS, WIDTH, generator=g)


def one_process_grads(n_stages: int, n_micro: int) -> list[list[torch.Tensor]]:
    """Every stage's gradients of the mean loss over the batch, in one process."""
    stages = _model(n_stages)
    x, y = _data(n_micro)
    nn.functional.mse_loss(nn.Sequential(*stages)(x), y).backward()
    return [[p.grad.clone() for p in s.parameters()] for s in stages]


def order_problem(order, rank: int, n_micro: int) -> str:
    """Why ``order`` is no list of F0..F{m-1} and B0..B{m-1}, each once, each B after its F ('' if it is)."""
    if not isinstance(order, (list, tuple)) or not all(isinstance(a, str) for a in order):
        return f"rank {rank}'s order is {type(order).__name__} {str(order)[:60]}, not a list of strings"
    want = [f"F{i}" for i in range(n_micro)] + [f"B{i}" for i in range(n_micro)]
    if sorted(order) != sorted(want):
        extra = sorted(set(order) - set(want)) or sorted(a for a in set(order) if order.count(a) > 1)
        missing = sorted(set(want) - set(order))
        return (f"rank {rank}'s order {list(order)} for {n_micro} micro-batch(es): "
                + (f"has {extra} " if extra else "") + (f"lacks {missing}" if missing else "")).strip()
    late = [f"B{i}" for i in range(n_micro) if order.index(f"B{i}") < order.index(f"F{i}")]
    return f"rank {rank}'s order {list(order)} runs {late[0]} before its forward" if late else ""


def _recv(buf, src, what: str, group):
    try:
        tdist.irecv(buf, src, group=group).wait(timeout=datetime.timedelta(seconds=RECV_TIMEOUT))
    except RuntimeError:  # timed out, or the peer timed out first and closed the connection
        raise _Stuck(f"waits at {what} for rank {src}") from None


def _isend(tensor, dst: int, i: int, what: str, group):
    try:
        return tdist.isend(torch.cat([tensor.flatten(), torch.tensor([float(i)])]), dst, group=group)
    except RuntimeError:
        raise _Stuck(f"at {what} cannot send to rank {dst}, which stopped waiting") from None


class _Stuck(Exception):
    pass


def _replay(order: list, n_stages: int, n_micro: int, group) -> dict:
    """Run this rank's order; returns what happened (never raises for a deadlock or a mismatch)."""
    rank = tdist.get_rank()
    stage = _model(n_stages)[rank]
    x, y = _data(n_micro)
    xs, ys = torch.chunk(x, n_micro), torch.chunk(y, n_micro)
    ins, outs, sends = {}, {}, []
    alive = peak = done = 0
    try:
        for action in order:
            kind, i = action[0], int(action[1:])
            if kind == "F":
                h = xs[i].clone()
                if rank > 0:
                    msg = torch.empty(ROWS * WIDTH + 1)
                    _recv(msg, rank - 1, f"{action} (the activations of micro-batch {i})", group)
                    if int(msg[-1]) != i:
                        return {"done": done, "peak": peak, "stuck": f"at {action} received the activations of "
                                f"micro-batch {int(msg[-1])} from rank {rank - 1}, which sent them in its order"}
                    h = msg[:-1].view(ROWS, WIDTH)
                ins[i] = h.requires_grad_()
                out = stage(ins[i])
                outs[i] = nn.functional.mse_loss(out, ys[i]) / n_micro if rank == n_stages - 1 else out
                if rank < n_stages - 1:
                    sends.append(_isend(out.detach(), rank + 1, i, action, group))
                alive += 1
                peak = max(peak, alive)
            else:
                grad = None
                if rank < n_stages - 1:
                    msg = torch.empty(ROWS * WIDTH + 1)
                    _recv(msg, rank + 1, f"{action} (the gradient of micro-batch {i})", group)
                    if int(msg[-1]) != i:
                        return {"done": done, "peak": peak, "stuck": f"at {action} received the gradient of "
                                f"micro-batch {int(msg[-1])} from rank {rank + 1}, which sent it in its order"}
                    grad = msg[:-1].view(ROWS, WIDTH)
                outs.pop(i).backward(grad)
                if rank > 0:
                    sends.append(_isend(ins[i].grad, rank - 1, i, action, group))
                del ins[i]
                alive -= 1
            done += 1
        for work in sends:
            try:
                work.wait(timeout=datetime.timedelta(seconds=RECV_TIMEOUT))
            except RuntimeError:  # the receiver is stuck elsewhere: its own report says where
                pass
    except _Stuck as exc:
        return {"done": done, "peak": peak, "stuck": str(exc)}
    return {"done": done, "peak": peak, "stuck": "", "grads": [p.grad.clone() for p in stage.parameters()]}


def probe_orders(one_f_one_b, scenarios: list, calls: list = ()) -> dict:
    """In each of ``n_stages`` ranks, per ``(n_stages, n_micro)``: this rank's order from the learner and,
    when every rank's order is well formed, its replay (in a process group of its own). Rank 0 also
    answers ``calls`` (orders judged without ranks), so that one launch serves the whole check."""
    return {"scenarios": _replays(one_f_one_b, scenarios),
            "calls": orders_of(one_f_one_b, calls) if tdist.get_rank() == 0 else []}


def _replays(one_f_one_b, scenarios: list) -> list:
    from ..sim.outcome import outcome

    torch.set_num_threads(1)
    rank, out = tdist.get_rank(), []
    for n_stages, n_micro in scenarios:
        got = outcome(one_f_one_b, rank, n_stages, n_micro)
        order = list(got[1]) if got[0] == "ok" and isinstance(got[1], (list, tuple)) else got
        problem = order_problem(order, rank, n_micro) if got[0] == "ok" else f"rank {rank} raised {got[1]}: {got[2]}"
        problems = [None] * n_stages
        tdist.all_gather_object(problems, problem)
        ev = {"order": order if got[0] == "ok" else None, "problem": next((p for p in problems if p), "")}
        if not ev["problem"]:
            # a group of its own per scenario: a deadlock's timed-out receives close its connections only
            group = tdist.new_group(backend="gloo")
            ev.update(_replay(order, n_stages, n_micro, group))
            stuck = [None] * n_stages
            tdist.all_gather_object(stuck, ev["stuck"])
            if any(stuck):
                ev["stuck_all"] = stuck
                ev.pop("grads", None)
                out.append(ev)
                continue
            ev["same"] = all(torch.allclose(g, r, atol=1e-6) for g, r in
                             zip(ev.pop("grads"), one_process_grads(n_stages, n_micro)[rank]))
        out.append(ev)
    return out


def orders_of(one_f_one_b, calls) -> list:
    """``one_f_one_b(rank, n_stages, n_micro)`` for every call, as outcomes (lists of strings kept)."""
    from ..sim.outcome import outcomes

    return outcomes(one_f_one_b, calls, keep=lambda v: list(v) if isinstance(v, (list, tuple)) else repr(v)[:80])


def evaluate(fn, calls) -> list:
    """``fn(*args)`` for every args tuple: ``("ok", float or repr)`` or ``("raised", type, message)``."""
    from ..sim.outcome import outcomes

    def number(v):
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)[:80]

    return outcomes(fn, calls, keep=number)


# -- pipeline_train ------------------------------------------------------------------
def train_model(kind: str) -> nn.Sequential:
    """The models pipeline_train is judged on: 4 or 8 layers (runs of equal layers for 2 or 4 stages)."""
    with _SEEDED:
        torch.manual_seed(7)
        if kind == "small":
            return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                                 nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4), nn.Identity())
        return nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(8)])


def train_batches(kind: str, steps: int = 3, batch: int = 8) -> list:
    g = torch.Generator().manual_seed(11)
    width = 4 if kind == "small" else 6
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)) for _ in range(steps)]


def reference_state(kind: str, lr: float) -> dict:
    """The weights after training in one process (whole batch, MSE, SGD)."""
    model = train_model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in train_batches(kind):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _plain(value):
    if value is None:
        return ("none",)
    if isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values()):
        return ("state", {str(k): v.detach().cpu().clone() for k, v in value.items()})
    return ("other", type(value).__name__, repr(value)[:80])


@contextmanager
def recording_pipelining():
    """Inside the block, record what ``torch.distributed.pipelining`` does in this rank.

    Yields a dict: ``"schedules"``, the schedules built (class name, the stage ids in the order the rank
    passed them); ``"actions"``, ``{"F<stage>": n, "B<stage>": n, ...}`` the forwards, backwards (``B``,
    or ``I`` and ``W`` when split) each stage ran; ``"sends"``, the messages this rank's stages sent.
    """
    from torch.distributed.pipelining import schedules, stage

    seen = {"schedules": [], "actions": {}, "sends": 0}
    base, multi, single = stage._PipelineStageBase, schedules.PipelineScheduleMulti, schedules.PipelineScheduleSingle
    own = {(cls, name): cls.__dict__[name] for cls, name in (
        (base, "forward_one_chunk"), (base, "backward_one_chunk"), (base, "backward_weight_one_chunk"),
        (base, "get_fwd_send_ops"), (base, "get_bwd_send_ops"), (multi, "__init__"), (single, "__init__"))}

    def count(kind_of):
        def wrap(method):
            def counted(self, *args, **kwargs):
                key = f"{kind_of(kwargs)}{self.stage_index}"
                seen["actions"][key] = seen["actions"].get(key, 0) + 1
                return method(self, *args, **kwargs)
            return counted
        return wrap

    def sends(method):
        def counted(self, *args, **kwargs):
            ops = method(self, *args, **kwargs)
            seen["sends"] += len(ops)
            return ops
        return counted

    def built(method, many):
        def init(self, *args, **kwargs):
            given = args[0] if args else kwargs.get("stages" if many else "stage")
            ids = [getattr(s, "stage_index", None) for s in (given if many else [given])]
            seen["schedules"].append((type(self).__name__, ids))
            return method(self, *args, **kwargs)
        return init

    wrapped = {(base, "forward_one_chunk"): count(lambda kw: "F"),
               (base, "backward_one_chunk"): count(lambda kw: "B" if kw.get("full_backward", True) else "I"),
               (base, "backward_weight_one_chunk"): count(lambda kw: "W"),
               (base, "get_fwd_send_ops"): sends, (base, "get_bwd_send_ops"): sends,
               (multi, "__init__"): lambda m: built(m, True), (single, "__init__"): lambda m: built(m, False)}
    for (cls, name), method in own.items():
        setattr(cls, name, wrapped[cls, name](method))
    try:
        yield seen
    finally:
        for (cls, name), method in own.items():
            setattr(cls, name, method)


def _in_words(exc: Exception, built: list) -> Exception:
    """The learner's error, with what went wrong said in words when a rank listed its stages out of order."""
    for name, ids in built:
        if len(ids) > 1 and None not in ids and ids != sorted(ids):
            return RuntimeError(
                f"rank {tdist.get_rank()} gave {name} its stages in the order {ids}, and torch's schedule failed "
                f"inside its step: a schedule of several stages per rank takes the rank's stages in increasing "
                f"order of their index ({sorted(ids)})")
    return exc


def probe_train(pipeline_train, scenarios: list, log_dir: str) -> list:
    """Per ``(kind, schedule, n_micro, lr)``: what this rank's ``pipeline_train`` returned (plain) and what
    torch's pipelining did in this rank meanwhile (:func:`recording_pipelining`)."""
    from functools import partial

    from ..sim.scenarios import run_scenarios

    torch.set_num_threads(1)
    world = tdist.get_world_size()

    def one(scenario):
        kind, schedule, n_micro, lr = scenario
        with recording_pipelining() as seen:
            try:
                got = pipeline_train(partial(train_model, kind), world, schedule, n_micro, train_batches(kind), lr)
            except NotImplementedError:
                raise
            except Exception as exc:
                raise _in_words(exc, seen["schedules"]) from exc
        tdist.barrier()
        return {"returned": _plain(got), "ran": seen}

    return run_scenarios(log_dir, one, scenarios)
