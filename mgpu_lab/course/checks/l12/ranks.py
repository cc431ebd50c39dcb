"""What lesson 12's checks run: the learner's 1F1B orders replayed on real ranks, bubbles, a pipeline executor.

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
process; :func:`probe_schedule` runs ``run_schedule`` on every scenario of a world
size in one launch, its stages recording what they ran and held (:class:`Held`).
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


# -- run_schedule ----------------------------------------------------------------------
WIDTHS = (3, 5, 4, 6, 2, 5, 3, 4, 3)  # stage k maps WIDTHS[k] features to WIDTHS[k + 1]: every boundary its own shape
MICRO_ROWS = 2  # rows per micro-batch
LOSSES = {"mse": nn.functional.mse_loss, "l1": nn.functional.l1_loss}  # both a mean over the micro-batch


def schedule_stages(n_stages: int) -> list[nn.Module]:
    """The stages a schedule runs: a linear layer and tanh each, widths from :data:`WIDTHS`."""
    with _SEEDED:
        torch.manual_seed(12)
        return [nn.Sequential(nn.Linear(WIDTHS[k], WIDTHS[k + 1]), nn.Tanh()) for k in range(n_stages)]


def schedule_data(n_stages: int, n_micro: int):
    g = torch.Generator().manual_seed(100 * n_stages + n_micro)
    rows = n_micro * MICRO_ROWS
    return torch.randn(rows, WIDTHS[0], generator=g), torch.randn(rows, WIDTHS[n_stages], generator=g)


def schedule_reference(n_stages: int, n_micro: int, loss: str) -> dict:
    """One process over the whole batch: every stage's gradients, the loss, and each stage's input per
    micro-batch (how the check tells which micro-batch a forward ran)."""
    stages = schedule_stages(n_stages)
    x, y = schedule_data(n_stages, n_micro)
    inputs, outputs, h = [], [], x
    for stage in stages:
        inputs.append([c.detach().clone() for c in h.chunk(n_micro)])
        h = stage(h)
        h.retain_grad()
        outputs.append(h)
    value = LOSSES[loss](h, y)
    value.backward()
    return {"grads": [[p.grad.clone() for p in s.parameters()] for s in stages], "loss": float(value.detach()),
            "inputs": inputs, "out_grads": [[c.clone() for c in out.grad.chunk(n_micro)] for out in outputs]}


class Held:
    """What this rank's stages did: every forward and backward in the order they ran (``ran``), and at each
    forward how many micro-batches' activations were alive (``counts``, the largest ``peak``); ``shared``: the
    forwards whose received input was the very tensor of a micro-batch still waiting for its backward;
    ``unwaited``: the forwards and backwards that started from a tensor an ``irecv`` was still receiving into
    (its memory a key of ``posted``, :func:`watch_receives`).

    A micro-batch's activations on a stage are the stage's input (received; the first stage's inputs are the
    caller's) and output tensors; they count from the forward until both are freed. One whose backward
    ran since the previous forward is not counted yet (a loop's local variable may hold it until the next
    action); from the forward after that on, it counts while it is alive.
    """

    def __init__(self, inputs: list, out_grads: list, posted: dict | None = None):
        import itertools

        self.out_grads, self.wrong_grads = out_grads, []  # (stage, micro-batch, the one whose gradient it got)
        self.posted, self.unwaited = {} if posted is None else posted, []  # see :func:`watch_receives`
        self.inputs, self.ran, self.counts, self.peak, self.shared = inputs, [], [], 0, []
        self._inputs = {}  # entry -> (stage, micro-batch, storage of the received input) while that input lives
        self._ids, self._alive, self._backward_at, self._forwards = itertools.count(), {}, {}, 0

    def which(self, stage: int, x) -> int:
        """The micro-batch whose input to ``stage`` ``x`` is (-1 if none)."""
        x = x.detach()
        return next((i for i, want in enumerate(self.inputs[stage])
                     if x.shape == want.shape and torch.allclose(x, want, atol=1e-5)), -1)

    def forward(self, stage: int, i: int, tensors: list) -> None:
        import gc
        import weakref

        entry = next(self._ids)
        if len(tensors) > 1:  # a received input: is it the memory of another micro-batch's input, still alive?
            storage = tensors[0].untyped_storage().data_ptr()
            if storage in self.posted:
                self.unwaited.append(("F", stage, i))
            self.shared += [(stage, i, j) for s, j, ptr in self._inputs.values() if s == stage and ptr == storage]
            self._inputs[entry] = (stage, i, storage)
            weakref.finalize(tensors[0], self._inputs.pop, entry, None)
        self._alive[entry] = len(tensors)
        for tensor in tensors:
            weakref.finalize(tensor, self._freed, entry)
        self.ran.append(("F", stage, i))
        out = tensors[-1]
        if out.requires_grad:
            out.register_hook(lambda grad, entry=entry, stage=stage, i=i: self._backward(entry, stage, i, grad))
        self._forwards += 1
        count = self._count()
        if count > self.peak:
            gc.collect(1)  # a young reference cycle is no holding (a full collection costs ~0.5 s)
            count = self._count()
        self.counts.append(count)
        self.peak = max(self.peak, count)

    def _count(self) -> int:
        recent = self._forwards - 1  # backwards since the previous forward: not counted yet
        return sum(1 for e in self._alive if self._backward_at.get(e, recent + 1) < recent
                   or e not in self._backward_at)

    def _backward(self, entry: int, stage: int, i: int, grad) -> None:
        self.ran.append(("B", stage, i))
        if grad.untyped_storage().data_ptr() in self.posted:
            self.unwaited.append(("B", stage, i))
        wants = self.out_grads[stage]
        n = len(wants)

        def like(j):  # the gradient of micro-batch j's output, whatever the loss's scale (1, n or 1/n)
            return grad.shape == wants[j].shape and any(torch.allclose(grad, c * wants[j], atol=1e-6, rtol=1e-3)
                                                        for c in (1.0, float(n), 1.0 / n))
        if 0 <= i < n and not like(i):
            other = next((j for j in range(n) if like(j)), -1)
            if other >= 0:
                self.wrong_grads.append((stage, i, other))
        self._backward_at[entry] = self._forwards

    def _freed(self, entry: int) -> None:
        self._alive[entry] -= 1
        if not self._alive[entry]:
            del self._alive[entry]


@contextmanager
def watch_receives(posted: dict):
    """Inside: the memory of every tensor an ``irecv`` receives into is a key of ``posted`` until that receive's
    ``wait()`` returns (or ``is_completed()`` says True), so a stage can tell a tensor read before its message
    surely arrived: what such a read sees depends on timing (on a GPU the receive runs on a stream of its own).
    """
    import torch.distributed.distributed_c10d as c10d

    posting = tdist.irecv

    class Request:
        def __init__(self, work, key):
            self._work, self._key = work, key

        def wait(self, *args, **kwargs):
            done = self._work.wait(*args, **kwargs)
            posted.pop(self._key, None)
            return done

        def is_completed(self):
            done = self._work.is_completed()
            if done:
                posted.pop(self._key, None)
            return done

        def __getattr__(self, name):
            return getattr(self._work, name)

    def irecv(tensor, *args, **kwargs):
        work = posting(tensor, *args, **kwargs)
        key = tensor.untyped_storage().data_ptr()
        posted[key] = True
        return Request(work, key)

    patched = [(module, module.irecv) for module in (tdist, c10d) if module.irecv is posting]
    for module, _ in patched:
        module.irecv = irecv
    try:
        yield
    finally:
        for module, original in patched:
            module.irecv = original


class TrackedStage(nn.Module):
    """A stage that tells :class:`Held` what it ran, and which tensors are its activations."""

    def __init__(self, inner: nn.Module, stage: int, held: Held):
        super().__init__()
        self.inner, self.stage, self.held = inner, stage, held

    def forward(self, x):
        i = self.held.which(self.stage, x)
        out = self.inner(x)
        self.held.forward(self.stage, i, ([x] if self.stage > 0 else []) + [out])
        return out


def _grads_verdict(got: list, want: list, n_micro: int) -> str:
    """'same', 'none' (a gradient missing), 'times' / 'over' (n_micro times, 1/n_micro of it) or the difference."""
    if any(g is None for g in got):
        return "none"
    for words, c in (("same", 1.0), ("times", float(n_micro)), ("over", 1.0 / n_micro)):
        if all(g.shape == w.shape and torch.allclose(g, c * w, atol=1e-6, rtol=1e-4) for g, w in zip(got, want)):
            return words
    return f"{max(float((g - w).abs().max()) if g.shape == w.shape else float('inf') for g, w in zip(got, want)):.2e}"


def _returned_value(value) -> tuple:
    if value is None:
        return ("none",)
    if isinstance(value, float):
        return ("float", value)
    return ("other", type(value).__name__, repr(value)[:80])


def probe_schedule(run_schedule, scenarios: list, log_dir: str) -> list:
    """In every rank, per scenario ``(placement, {rank: actions}, n_micro, loss)``: this rank's stages run by the
    learner's ``run_schedule`` inside a recording of its messages (:func:`mgpu_lab.comm.record.record`, whose
    deadlock finder ends a deadlock at once). Returns per scenario what the rank returned, its stages' gradients
    against one process's, what its stages ran and held (:class:`Held`) and the messages it sent."""
    import gc

    import torch.distributed as tdist

    from mgpu_lab.comm.record import record

    from ..sim.outcome import one_thread
    from ..sim.scenarios import run_scenarios

    one_thread()
    rank = tdist.get_rank()

    def one(scenario):
        placement, actions, n_micro, loss = scenario
        n = len(placement)
        ref = schedule_reference(n, n_micro, loss)
        modules, (x, y) = schedule_stages(n), schedule_data(n, n_micro)
        posted: dict = {}
        held = Held(ref["inputs"], ref["out_grads"], posted)
        mine = {s: TrackedStage(modules[s], s, held) for s in range(n) if placement[s] == rank}
        inputs = list(x.chunk(n_micro)) if placement[0] == rank else None
        targets = list(y.chunk(n_micro)) if placement[-1] == rank else None
        with record() as log, watch_receives(posted):
            got = run_schedule(mine, list(placement), [tuple(a) for a in actions[rank]], inputs, targets,
                               LOSSES[loss])
        got = _returned_value(got)
        gc.collect(1)
        tdist.barrier()
        return {"returned": got, "ref_loss": ref["loss"], "ran": held.ran, "peak": held.peak, "counts": held.counts,
                "shared": held.shared, "wrong_grads": held.wrong_grads, "unwaited": held.unwaited,
                "grads": {s: _grads_verdict([p.grad for p in modules[s].parameters()], ref["grads"][s], n_micro)
                          for s in mine},
                "sends": [e["peer"] for e in log if e["op"] in ("send", "send_object_list")]}

    with record():  # installed once for every scenario (each scenario's own recording nests inside)
        return run_scenarios(log_dir, one, scenarios)
