"""What lesson 06's checks run: the learner's stage in real ranks, its step on virtual GPUs.

:func:`probe_stage` trains the two stages of a model with the learner's
``stage_step``, one stage in each of 2 real ranks (gloo), every scenario in one launch;
:func:`run_pipelined` runs the learner's ``pipelined_step`` on several batches
with the stages on ``cuda:2`` and ``cuda:3`` and names the gradient the answer
matches; :func:`evaluate` calls a function on many arguments. The devices are
virtual (:mod:`..sim.devices`): every move and every stage's input device is
recorded, so a forgotten ``.to`` shows here as it would on two GPUs. Each
function runs all of its configurations in one process (one launch per check)
and returns plain evidence that :mod:`.checkers` judges in the kernel; an error
of the learner's code in one configuration is evidence too, not the end.
"""
from __future__ import annotations

import copy
import threading
import time
import torch
import traceback
from contextlib import contextmanager
from pathlib import Path
from torch import nn

from ..sim.devices import CPU, place, Placed, PlacedLoss, PlacedModule, plain, reset
from ..sim.outcome import in_words, one_thread, outcomes, raised_outcome


_LIBRARIES = (str(Path(__file__).resolve().parents[2]), str(Path(torch.__file__).resolve().parent))


DEVICES = ("cuda:2", "cuda:3")  # pipelined_step's stages: replica 1 of the lesson's DDP over two-device replicas


def _raised(exc: Exception) -> str:
    """``Type: message (where in the learner's code)``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_LIBRARIES)]
    where_ = f" (line {frames[-1].lineno}, in {frames[-1].name}: {frames[-1].line})" if frames else ""
    return in_words(raised_outcome(exc), raised="") + where_


def _stage(inner: nn.Module, name: str, out_tag: str, device=CPU) -> PlacedModule:
    """``inner`` as a stage on a virtual device: its parameters report the device it is moved to."""
    return PlacedModule(inner, name=name, out_tag=out_tag, device=device, virtual_parameters=True)


def _logs() -> dict:
    """The logs of one run: ``stage_log`` (``(stage, "to", device)`` for every move of a stage,
    ``(stage, "input", tag, input device, stage device, batch size)`` for every forward), every
    move, and the loss's calls."""
    stages = [(who, "to", to) for who, _, to in Placed.moves if who in ("stage1", "stage2")]
    inputs = [(m.name, "input", tag, x_on, m_on, size) for m, tag, x_on, m_on, size in PlacedModule.inputs]
    return {"stage_log": stages + inputs, "moves": list(Placed.moves), "loss_log": list(PlacedLoss.calls)}


# -- stage_step ---------------------------------------------------------------------
# (model, batch, steps, seed); "placed": the stages on cuda:0 and cuda:1 (simulated), x and the labels on the CPU
STAGE_SCENARIOS = [("mlp", 8, 3, 1), ("regression", 5, 4, 2), ("mlp placed", 6, 2, 3)]
# pipeline_step's (model, batch, n_micro, steps, seed); "work": stages whose forwards sleep WORK_S each
PIPE_SCENARIOS = [("mlp", 8, 4, 3, 1), ("regression", 10, 4, 3, 2), ("work", 8, 4, 2, 5), ("mlp placed", 6, 3, 2, 3),
                  ("mlp", 6, 4, 2, 4), ("regression", 5, 1, 2, 6), ("mlp", 7, 3, 2, 7)]
WORK_S = 0.03


# The global RNG is seeded and drawn from under this lock: checks judged at once in threads of one process (the
# mutant tests' at_once) would otherwise draw from each other's seed, and a one-process reference would differ.
_SEEDED = threading.Lock()


def stage_setup(kind: str, batch: int, steps: int, seed: int, n_micro: int = 1):
    """The two stages, loss, optimizer factory, batches and activation shape of one scenario (with ``n_micro``
    micro-batches: of the first micro-batch, the largest of ``torch.chunk``)."""
    with _SEEDED:
        return _stage_setup(kind, batch, steps, seed, n_micro)


def _stage_setup(kind: str, batch: int, steps: int, seed: int, n_micro: int):
    torch.manual_seed(seed)
    if kind.startswith("mlp"):
        stages = [nn.Sequential(nn.Linear(6, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 16), nn.ReLU(),
                                                                            nn.Linear(16, 3))]
        loss_fn, width = nn.CrossEntropyLoss(), 16
        data = [(torch.randn(batch, 6), torch.randint(0, 3, (batch,))) for _ in range(steps)]
    elif kind == "work":  # every forward of a stage sleeps WORK_S: its timing holds on a loaded machine
        from mgpu_lab.pipelining.work import Work

        stages = [nn.Sequential(nn.Linear(6, 8), Work(8, t_f=WORK_S)), nn.Sequential(Work(8, t_f=WORK_S),
                                                                                   nn.Linear(8, 3))]
        loss_fn, width = nn.CrossEntropyLoss(), 8
        data = [(torch.randn(batch, 6), torch.randint(0, 3, (batch,))) for _ in range(steps)]
    else:
        stages = [nn.Sequential(nn.Linear(3, 12), nn.ReLU(), nn.Linear(12, 12)), nn.Linear(12, 1)]
        loss_fn, width = nn.MSELoss(), 12
        data = [(torch.randn(batch, 3), torch.randn(batch, 1)) for _ in range(steps)]

    def optimizer(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    return stages, loss_fn, optimizer, data, (len(torch.chunk(torch.empty(batch), n_micro)[0]), width)


def _returned(value) -> tuple:
    if value is None:
        return ("none",)
    if isinstance(value, float):
        return ("float", value)
    return ("other", type(value).__name__, repr(value)[:80])


def probe_stage(stage_step, scenarios: list, log_dir: str) -> list:
    """In each of 2 real ranks, per scenario: this rank's stage trained by the learner's ``stage_step``
    for a few steps (rank 0 passes x, rank 1 the target). Returns per scenario what each step returned,
    the stage's final parameters, and how many sends this rank issued (:func:`mgpu_lab.comm.record.record`
    sees send, isend and batched point-to-point calls alike)."""
    import torch.distributed as tdist

    from mgpu_lab.comm.record import record

    from ..sim.scenarios import run_scenarios

    rank = tdist.get_rank()

    def one(scenario):
        stages, loss_fn, make_optimizer, data, act_shape = stage_setup(*scenario)
        placed = scenario[0].endswith("placed")
        stage, loss_fn = _rank_stage(stages, rank, placed, loss_fn)
        optimizer = make_optimizer(stage.parameters())
        returns, first = [], None
        reset()
        with record() as log, _placed(placed):
            for x, target in data:
                if placed:
                    x, target = place(x, "inputs"), place(target, "labels")
                got = stage_step(stage, x if rank == 0 else None, None if rank == 0 else target, loss_fn, optimizer,
                                 act_shape)
                returns.append(_returned(got))
                first = first or [p.detach().clone() for p in stage.parameters()]  # after the first step
        sent = sum(e["op"] == "send" for e in log)
        tdist.barrier()
        out = {"returns": returns, "params": [p.detach().clone() for p in stage.parameters()], "first": first,
               "sent": sent}
        if placed:
            out.update(_logs(), received=[e["device"] for e in log if e["op"] == "recv"], device=f"cuda:{rank}")
        return out

    return run_scenarios(log_dir, one, scenarios)


def _rank_stage(stages, rank: int, placed: bool, loss_fn):
    """This rank's stage and the loss; ``placed``: on cuda:<rank> in name (:mod:`..sim.devices`), the loss
    logging where its inputs were."""
    if not placed:
        return stages[rank], loss_fn
    return (_stage(stages[rank], f"stage{rank + 1}", "activations" if rank == 0 else "output", f"cuda:{rank}"),
            PlacedLoss(loss_fn))


class _Clocked(nn.Module):
    """A stage that logs every forward, ``("F", i, start, end, rows, progress)``, and the moment each backward
    reaches its output, ``("B", i, time)``, on ``time.perf_counter`` (one clock for every process of a
    machine, so two ranks' logs line up); ``progress()`` is how many messages the rank had sent (rank 0) or
    posted to receive (rank 1) when the forward began."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.log, self.progress = inner, [], (lambda: 0)

    def forward(self, x):
        i, start, before = sum(e[0] == "F" for e in self.log), time.perf_counter(), self.progress()
        out = self.inner(x)
        self.log.append(("F", i, start, time.perf_counter(), len(x), before))
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, i=i: self.log.append(("B", i, time.perf_counter())))
        return out


def _pipe_step(pipeline_step, stage, rank: int, batch: tuple, loss_fn, optimizer, act_shape, n_micro) -> tuple:
    """One call of the learner's ``pipeline_step``, recorded: what it returned, and the step's evidence (the
    elements of every message this rank sent, the devices of the buffers it received into, the stage's clock)."""
    from mgpu_lab.comm.record import record

    x, target = batch
    mine = "send" if rank == 0 else "recv"
    with record() as log:
        if isinstance(stage, _Clocked):
            stage.log, stage.progress = [], (lambda: sum(e["op"] == mine for e in log.events))
        got = pipeline_step(stage, x if rank == 0 else None, None if rank == 0 else target, loss_fn, optimizer,
                            act_shape, n_micro)
    clock = list(stage.log) if isinstance(stage, _Clocked) else []
    return _returned(got), {"sent": [e["numel"] for e in log if e["op"] == "send"],
                            "received": [e["device"] for e in log if e["op"] == "recv"], "clock": clock}


def probe_pipeline(pipeline_step, scenarios: list, log_dir: str) -> list:
    """In each of 2 real ranks, per scenario ``(model, batch, n_micro, steps, seed)``: this rank's stage
    trained by the learner's ``pipeline_step``. Returns per scenario what each step returned, the stage's
    parameters after the first and the last step, and per step what :func:`_pipe_step` saw; "placed"
    scenarios also the moves and inputs of the simulated GPUs (:func:`_logs`)."""
    import torch.distributed as tdist

    from ..sim.scenarios import run_scenarios

    one_thread()
    rank = tdist.get_rank()

    def one(scenario):
        kind, batch, n_micro, steps, seed = scenario
        stages, loss_fn, make_optimizer, data, act_shape = stage_setup(kind, batch, steps, seed, n_micro)
        placed = kind.endswith("placed")
        stage, loss_fn = _rank_stage(stages, rank, placed, loss_fn)
        stage = stage if placed else _Clocked(stage)
        optimizer = make_optimizer(stage.parameters())
        out = {"returns": [], "steps": [], "first": None, "chunks": [len(c) for c in torch.chunk(data[0][0], n_micro)],
               "row_numel": int(torch.Size(act_shape[1:]).numel())}
        reset()
        with _placed(placed):
            for x, target in data:
                batch = (place(x, "inputs"), place(target, "labels")) if placed else (x, target)
                got, step = _pipe_step(pipeline_step, stage, rank, batch, loss_fn, optimizer, act_shape, n_micro)
                out["returns"].append(got)
                out["steps"].append(step)
                out["first"] = out["first"] or [p.detach().clone() for p in stage.parameters()]
        tdist.barrier()
        out["params"] = [p.detach().clone() for p in stage.parameters()]
        if placed:
            out.update(_logs(), received=[d for s in out["steps"] for d in s["received"]], device=f"cuda:{rank}")
        return out

    return run_scenarios(log_dir, one, scenarios)


@contextmanager
def _placed(on: bool):
    """Two GPUs in name and factories that honour ``device=`` on them (:mod:`..sim`), when ``on``."""
    from ..sim.cuda import simulated_gpus
    from ..sim.devices import GpuFactories

    if not on:
        yield
        return
    with simulated_gpus(2), GpuFactories():
        yield


# -- pipelined_step -----------------------------------------------------------------
def _params(*modules):
    return [p for m in modules for p in m.parameters()]


def _micro_grads(stage1, stage2, x, y, loss_fn, n_micro):
    """Per micro-batch (torch.chunk): gradient of its own mean loss, and its size."""
    out = []
    for xs, ys in zip(torch.chunk(x, n_micro), torch.chunk(y, n_micro)):
        for p in _params(stage1, stage2):
            p.grad = None
        loss_fn(stage2(stage1(xs)), ys).backward()
        out.append(([p.grad.clone() for p in _params(stage1, stage2)], len(xs)))
    return out


def _kept_grads(stage1, stage2, x, y, loss_fn, n_micro, weight: float):
    """``weight`` x the gradient of the mean loss over the first n_micro * (len(x) // n_micro) samples."""
    kept = n_micro * (len(x) // n_micro)
    stage1, stage2 = copy.deepcopy(stage1), copy.deepcopy(stage2)
    for p in _params(stage1, stage2):
        p.grad = None
    if kept == 0 or kept == len(x):
        return [torch.full_like(p, float("nan")) for p in _params(stage1, stage2)]
    (loss_fn(stage2(stage1(x[:kept])), y[:kept]) * (kept / len(x) if weight else 1.0)).backward()
    return [p.grad for p in _params(stage1, stage2)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(g is not None and torch.allclose(g, r, atol=1e-6, rtol=1e-4)
                                    for g, r in zip(a, b))


def run_pipelined(pipelined_step, specs) -> list[dict]:
    """For each ``(batch, n_micro, regression, prefill)``: the learner's step on stages on cuda:2 and cuda:3.

    ``prefill``: the stages' ``.grad`` already hold gradients, as when the caller
    accumulates several steps; the step must add to them.
    """
    one_thread()
    return [_pipelined(pipelined_step, *spec) for spec in specs]


def _pipelined(pipelined_step, batch: int, n_micro: int, regression: bool, prefill: bool) -> dict:
    torch.manual_seed(3)
    if regression:
        s1, s2, loss_fn = nn.Sequential(nn.Linear(5, 7), nn.Tanh()), nn.Linear(7, 1), nn.MSELoss()
        x, y = torch.randn(batch, 5), torch.randn(batch, 1)
    else:
        s1, s2, loss_fn = nn.Sequential(nn.Linear(6, 9), nn.ReLU()), nn.Linear(9, 4), nn.CrossEntropyLoss()
        x, y = torch.randn(batch, 6), torch.randint(0, 4, (batch,))
    r1, r2 = copy.deepcopy(s1), copy.deepcopy(s2)
    ref_loss = loss_fn(r2(r1(x)), y)
    ref_loss.backward()
    ref = [p.grad for p in _params(r1, r2)]
    micro = _micro_grads(copy.deepcopy(r1), copy.deepcopy(r2), x, y, loss_fn, n_micro)
    before = [torch.randn(p.shape, generator=torch.Generator().manual_seed(5 + i)) if prefill else None
              for i, p in enumerate(ref)]
    stage1, stage2 = _stage(s1, "stage1", "activations", DEVICES[0]), _stage(s2, "stage2", "output", DEVICES[1])
    for p, g in zip(_params(stage1, stage2), before):
        p.grad = None if g is None else g.clone()
    reset()
    out = {"batch": batch, "n_micro": n_micro, "devices": list(DEVICES), "ref_loss": float(ref_loss.detach()),
           "chunks": [len(c) for c in torch.chunk(x, n_micro)]}
    try:
        loss = pipelined_step(stage1, stage2, place(x.clone(), "inputs", CPU), place(y.clone(), "labels", CPU),
                              PlacedLoss(loss_fn), n_micro)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - judged as evidence
        return {**out, "raised": _raised(exc), **_logs(), "same": False, "bug": ""}
    out.update(_logs())
    number = isinstance(loss, (int, float, torch.Tensor)) and not isinstance(loss, bool) \
        and torch.as_tensor(plain(loss)).numel() == 1
    out["type"] = "float" if isinstance(loss, float) else type(loss).__name__
    out["loss"] = float(torch.as_tensor(plain(loss)).detach()) if number else repr(loss)[:100]
    grads = [None if p.grad is None else p.grad.detach().clone() for p in _params(stage1, stage2)]
    expected = [r if b is None else r + b for r, b in zip(ref, before)]
    out["same"] = _same(grads, expected)
    out["bug"] = "" if out["same"] else _name_the_bug(grads, before, ref, micro, n_micro, batch, len(_params(s1)),
                                                      (r1, r2, x, y, loss_fn))
    return out


def _name_the_bug(grads, before, ref, micro, n_micro, batch, n_first, setup) -> str:
    """The likely bug whose gradients the learner's match, or ""."""
    if any(g is None for g in grads):
        first_missing = all(g is None for g in grads[:n_first]) and all(g is not None for g in grads[n_first:])
        return "detached" if first_missing else "no_grads"
    prefill = before[0] is not None
    added = [g - b for g, b in zip(grads, before)] if prefill else grads
    if prefill and _same(grads, ref):
        return "zeroed"
    if _same(added[:n_first], [torch.zeros_like(r) for r in ref[:n_first]]) and _same(added[n_first:], ref[n_first:]):
        return "detached"
    total = [sum(g[i] for g, _ in micro) for i in range(len(ref))]
    last, size = micro[-1]
    candidates = [("unscaled", added, total), ("one_over_n", added, [g / n_micro for g in total]),
                  ("last_only", grads, last), ("last_only", grads, [g / len(micro) for g in last]),
                  ("last_only", grads, [g * size / batch for g in last])]
    candidates += [("dropped", added, _kept_grads(*setup, n_micro, weight)) for weight in (0, 1)]
    return next((name for name, got, cand in candidates if _same(got, cand)), "")


# -- bubble_fraction ----------------------------------------------------------------
def evaluate(fn, calls) -> list:
    """``fn(*args)`` for every args tuple: ``("ok", value, is_float)`` or ``("raised", type name, message)``."""
    return [got if got[0] == "raised" else ("ok", *got[1]) for got in outcomes(fn, calls, keep=_number)]


def _number(value) -> tuple:
    """``(value, is_float)`` for a number, ``(repr, False)`` for anything else."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return (value if number else repr(value)[:80]), isinstance(value, float)
